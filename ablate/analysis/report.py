"""``ablate-analyze --report``: one self-contained HTML file per sweep, readable offline.

Everything is inside the file: tables as HTML, every plot as a ``data:image/png;base64`` URI, no
script, no stylesheet or font from elsewhere, so the file can be attached to a review and opened
without a network. A methods paragraph names each test, interval, family and seed count, from
the tables' own attributes (what was computed, not what a default would have been).
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from ablate.analysis.signflip import DRAWS, EXACT_MAX_N

_STYLE = """
body { font-family: sans-serif; max-width: 75em; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: right; }
th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.methods { background: #f8f8f8; padding: 0.8em 1em; border-left: 4px solid #888; }
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
    flat = frame.reset_index() if any(name is not None for name in frame.index.names) else frame
    return flat.to_html(index=False, na_rep="", float_format=lambda v: "" if math.isnan(v) else f"{v:.4g}",
                        border=0, escape=True)


def write_report(
    path: Path,
    *,
    sweep: str,
    design: Sequence[str],
    summaries: Mapping[str, pd.DataFrame],
    effect_tables: Mapping[str, pd.DataFrame],
    plans: Mapping[str, pd.DataFrame],
    flags: pd.DataFrame,
    images: Mapping[str, Sequence[Path]],
    n_seeds: str,
    survival: pd.DataFrame | None = None,
) -> Path:
    """Write the report of one sweep to ``path`` (one HTML file) and return it."""
    parts = [f"<h1>Sweep {html.escape(sweep)}</h1>", "<ul>"]
    parts += [f"<li>{html.escape(line)}</li>" for line in design]
    parts.append("</ul>")
    for outcome, effect_table in effect_tables.items():
        parts.append(f"<h2>{html.escape(outcome)}</h2>")
        parts.append(f'<p class="methods">{html.escape(methods_paragraph(summaries[outcome], effect_table, n_seeds))}</p>')
        parts.append("<h3>Summary per arm</h3>" + _table(summaries[outcome]))
        parts.append("<h3>Effects (paired by seed)</h3><p>ci_low/ci_high: unadjusted; ci_adj_low/ci_adj_high: "
                     "adjusted to the row's family, as p_adj; claim: what the adjusted tests support.</p>")
        parts.append(_table(effect_table))
        if outcome in plans:
            parts.append("<h3>Power and seeds (80% power, exact test simulated, each row at alpha over its "
                         "family's size)</h3>" + _table(plans[outcome]))
        for image in images.get(outcome, ()):
            parts.append(f'<figure><img alt="{html.escape(Path(image).stem)}" src="{image_uri(image)}">'
                         f"<figcaption>{html.escape(Path(image).stem)}</figcaption></figure>")
    parts.append("<h2>Flags</h2>" + (_table(flags) if not flags.empty else "<p>no arms to judge</p>"))
    if survival is not None:
        parts.append("<h2>Time to collapse</h2><p>Collapse: the collapsed outcome's rule (the smoothed reward "
                     "stays below the collapse threshold after its best value); a run that never collapses is "
                     "censored at its last step. p: paired permutation log-rank test against none (arms "
                     "swapped within each seed).</p>" + _table(survival))
    for image in images.get("", ()):
        parts.append(f'<figure><img alt="{html.escape(Path(image).stem)}" src="{image_uri(image)}">'
                     f"<figcaption>{html.escape(Path(image).stem)}</figcaption></figure>")
    document = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>ablate: {html.escape(sweep)}</title><style>{_STYLE}</style></head><body>"
                + "\n".join(parts) + "</body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document, encoding="utf-8")
    return path
