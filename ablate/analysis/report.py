"""``ablate-analyze --report``: one self-contained HTML file per sweep, readable offline.

It is the offline dashboard of a sweep: it leads with the verdict (the same answers the command
prints), then per outcome a methods paragraph, the compact tables, every column in a folded
section, and the plots; the flags, and the per-step curves of every arm. Everything is inside the
file: tables as HTML, every plot as a ``data:image/png;base64`` URI, no script, no stylesheet or
font from elsewhere, so the file can be attached to a review and opened without a network. A
methods paragraph names each test, interval, family and seed count, from the tables' own
attributes (what was computed, not what a default would have been). Tables wrap their cells, so
the page fits a 1280-pixel window without a horizontal scroll bar. It is written atomically.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from ablate.analysis.compact import compact_effects, compact_summary
from ablate.analysis.compute import SweepAnalysis
from ablate.analysis.export import text_cells
from ablate.analysis.flags import flags_text
from ablate.analysis.signflip import DRAWS, EXACT_MAX_N
from ablate.analysis.verdict import across_contexts, heading, introduction, legend
from ablate.store import atomic_write

_STYLE = """
body { font-family: sans-serif; max-width: 75em; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0 1.5em; max-width: 100%; }
details table { font-size: 0.65em; table-layout: fixed; width: 100%; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: right; overflow-wrap: anywhere; }
th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.methods { background: #f8f8f8; padding: 0.8em 1em; border-left: 4px solid #888; }
.verdict { border-left: 4px solid #0072B2; padding: 0.2em 1em; }
.verdict li { margin: 0.3em 0; }
.verdict pre.across { font-size: 0.85em; white-space: pre-wrap; }
.verdict ul ul { font-family: monospace; font-size: 0.85em; color: #444; list-style: none; padding-left: 1em; }
"""


def image_uri(path: Path) -> str:
    """A PNG file as a data URI."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def methods_paragraph(summary: pd.DataFrame, effect_table: pd.DataFrame, n_seeds: str) -> str:
    """The methods, in words, from the attributes of one outcome's summary and effect tables."""
    attrs = effect_table.attrs
    level = attrs["level"]
    alpha = 1.0 - level
    interval = {
        "exact": (f"the interval that inverts the exact two-sided sign-flip test (the set of effects the "
                  f"test does not reject at {alpha:.2g}), so it excludes 0 exactly when p < {alpha:.2g}"),
        "t": "Student's t interval of the paired differences",
    }.get(attrs["method"], f"the {attrs['method']} bootstrap interval of the paired differences")
    adjust = {"holm": "Holm's step-down adjustment (family-wise error)",
              "bh": "Benjamini-Hochberg (false discovery rate)", "none": "no adjustment"}[attrs["adjust"]]
    families = "; ".join(f"{name} ({n} tests)" for name, n in attrs["families"].items() if n) or "no tests"
    primary = (f" Primary questions, in order: {', '.join(attrs['primary'])}; they are tested by serial "
               f"gatekeeping (each gate at the full {alpha:.2g} with {attrs['adjust']} inside it, a gate "
               "tested only when every earlier hypothesis was rejected); every other row is exploratory."
               if attrs["primary"] else
               " No primary questions were declared: every row is exploratory, in the default families.")
    margin = (f" Equivalence: two one-sided sign-flip tests of |effect| < {attrs['margin']:g} "
              f"({attrs['outcome']} units), adjusted in the same families." if attrs.get("margin") else "")
    return (
        f"Outcome {attrs['outcome']}; seeds per arm: {n_seeds}. Effects are mean paired differences over "
        f"seeds (a seed is the unit: arms of one seed share initial weights and prompts). Test: the "
        f"two-sided sign-flip test, exact (all 2^n sign patterns) up to {EXACT_MAX_N} seeds, Monte Carlo "
        f"with {DRAWS:,} patterns above. Intervals at {level:.0%}: {interval}; adjusted intervals invert the "
        f"same test at the level its family allows and exclude 0 exactly when p_adj < {alpha:.2g}. "
        f"Multiplicity: {adjust} within each family: {families}.{primary}{margin} Single-arm summaries use "
        f"the {summary.attrs.get('interval', 't')} interval of the mean; no interval below "
        f"{attrs['min_seeds']} (paired) seeds."
    )


def _table(frame: pd.DataFrame) -> str:
    """``frame`` as an HTML table whose cells read as in the Markdown and LaTeX files (4 significant
    digits, NaN empty). Written here rather than by ``DataFrame.to_html``, which formats cell by
    cell through its own machinery: the effects of a sweep of thousands of cells took seconds."""
    cells = text_cells(frame, digits=4)
    head = "".join(f"<th>{html.escape(column)}</th>" for column in cells.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(text)}</td>" for text in row) + "</tr>" for row in cells.rows)
    return f'<table class="dataframe"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _figure(image: Path) -> str:
    """An image with its file's name as its alternative text and its title (what it draws) as its caption."""
    name = html.escape(Path(image).stem)
    caption = html.escape(figure_title(image) or Path(image).stem)
    return f'<figure><img alt="{name}" src="{image_uri(image)}"><figcaption>{caption}</figcaption></figure>'


def figure_title(image: Path) -> str:
    """The title a PNG of :mod:`ablate.analysis.plots` records ("" for a PNG without one)."""
    from PIL import Image  # matplotlib's own image library: a figure exists only where it is installed

    with Image.open(image) as png:
        return str(png.text.get("Title", ""))


def verdict_html(result: SweepAnalysis) -> str:
    """The verdict as the command prints it: per outcome a heading, per subject its answer and the rows it cites."""
    parts = ['<div class="verdict">']
    across = across_contexts(result.verdict)
    if across:
        parts.append(f'<pre class="across">{html.escape(chr(10).join(across).rstrip())}</pre>')
    shown = None
    for answer in result.verdict:
        if (answer.outcome, answer.context) != shown:
            if shown is not None:
                parts.append("</ul>")
            shown = (answer.outcome, answer.context)
            title = heading(answer.outcome, answer.context, result.margins.get(answer.outcome))
            parts.append(f"<h3>{html.escape(title)}</h3><ul>")
        cited = "".join(f"<li>{html.escape(row.text())}</li>" for row in answer.evidence)
        parts.append(f"<li><b>{html.escape(answer.subject)}: {html.escape(answer.finding)}</b> - "
                     f"{html.escape(answer.sentence)}<ul>{cited}</ul></li>")
    parts.append("</ul></div>" if shown is not None else "<p>no effect rows to read: the sweep needs none, full "
                 "and random arms</p></div>")
    return "".join(parts)


def write_report(path: Path, result: SweepAnalysis, *, sweep: str, design: Sequence[str],
                 images: Mapping[str, Sequence[Path]]) -> Path:
    """Write the report of one sweep to ``path`` (one HTML file, atomically) and return it."""
    parts = [f"<h1>Sweep {html.escape(sweep)}</h1>", "<ul>"]
    parts += [f"<li>{html.escape(line)}</li>" for line in design]
    parts.append("</ul>")
    parts.append(f"<h2>Verdict: budget or selection?</h2><p>{html.escape(introduction())}</p>")
    parts.append(verdict_html(result))
    if any(answer.evidence for answer in result.verdict):
        notes = legend(result.settings.level, result.settings.needed)
        parts.append("<p>Notes on the answers:</p><ul>" + "".join(f"<li>{html.escape(note.removeprefix('- '))}</li>"
                                                                  for note in notes) + "</ul>")
    for outcome, tables in result.outcomes.items():
        effect_table = tables.effects
        parts.append(f"<h2>{html.escape(outcome)}</h2>")
        parts.append(f'<p class="methods">'
                     f"{html.escape(methods_paragraph(tables.summary, effect_table, result.seeds_per_arm))}</p>")
        parts.append("<h3>Summary per arm</h3><p>effective_budget: the share of routes that replay changed.</p>"
                     + _table(compact_summary(tables.summary)))
        parts.append("<h3>Effects (paired by seed)</h3><p>ci_adj_low/ci_adj_high: the interval adjusted to the "
                     "row's family, as p_adj; claim: what the adjusted tests support; every column below.</p>")
        parts.append(_table(compact_effects(effect_table)))
        parts.append("<details><summary>Every column: summary, effects (ci_low/ci_high unadjusted), power and "
                     "seeds (80% power, exact test simulated, each row at alpha over its family's size)</summary>"
                     + _table(tables.summary) + _table(effect_table) + _table(tables.plan) + "</details>")
        parts += [_figure(image) for image in images.get(outcome, ())]
    parts.append("<h2>Flags</h2>" + ("".join(f"<p>{html.escape(line)}</p>" for line in flags_text(result.flags, 1000))
                                     + (f"<details><summary>Every column</summary>{_table(result.flags)}</details>"
                                        if not result.flags.empty else "")))
    if result.survival is not None:
        parts.append("<h2>Time to collapse</h2><p>Collapse: the collapsed outcome's rule (the smoothed reward "
                     "stays below the collapse threshold after its best value); a run that never collapses is "
                     "censored at its last step. p: paired permutation log-rank test against none (arms "
                     "swapped within each seed).</p>" + _table(result.survival[1]))
    if images.get(""):
        parts.append("<h2>Every arm step by step</h2>")
        parts += [_figure(image) for image in images[""]]
    document = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>ablate: {html.escape(sweep)}</title><style>{_STYLE}</style></head><body>"
                + "\n".join(parts) + "</body></html>\n")
    atomic_write(path, lambda tmp: tmp.write_text(document, encoding="utf-8"))
    return path
