"""Write analysis tables as CSV, Parquet, Markdown and LaTeX.

Markdown and LaTeX are rendered here (plain pipe tables; a booktabs ``tabular``) so that
neither ``tabulate`` nor ``jinja2`` is needed. Index levels become ordinary leading columns.
Every file is written as the run store writes its own (a temporary file, then a rename), so an
analysis killed midway leaves each file whole, old or new, never empty or half written; a write
that fails is one :class:`~ablate.analysis.writing.OutputError` naming the file.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Iterable

import pandas as pd

from ablate.budget import budget_label
from ablate.analysis.writing import naming
from ablate.store import atomic_write, make_directory

FORMATS: dict[str, str] = {"csv": ".csv", "parquet": ".parquet", "md": ".md", "latex": ".tex"}


def export_table(
    table: pd.DataFrame,
    path_stem: str | Path,
    formats: Iterable[str] = ("csv", "parquet", "md", "latex"),
) -> list[Path]:
    """Write ``table`` to ``<path_stem>.<ext>`` for each format; returns the written paths."""
    stem = Path(path_stem)
    with naming(stem.parent):
        make_directory(stem.parent, "the output folder")
    flat = _flat(table)
    written = []
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"format={fmt!r}: expected one of {sorted(FORMATS)}")
        path = stem.with_name(stem.name + FORMATS[fmt])
        with naming(path):
            if fmt == "csv":
                atomic_write(path, lambda tmp: flat.to_csv(tmp, index=False))
            elif fmt == "parquet":
                atomic_write(path, lambda tmp: flat.to_parquet(tmp, index=False))
            else:
                text = to_markdown(table) if fmt == "md" else to_latex(table)
                atomic_write(path, lambda tmp: tmp.write_text(text + "\n"))
        written.append(path)
    return written


def to_markdown(table: pd.DataFrame, digits: int = 4, *, escape_html: bool = True) -> str:
    """A GitHub pipe table; floats with ``digits`` significant digits, NaN as an empty cell.

    ``escape_html`` (the default, for files) writes ``<``, ``>`` and ``&`` as entities: results
    pages are built from these files, and a name such as ``<script>`` must stay text there. A
    terminal shows the table as it is (``escape_html=False``).
    """
    flat = _flat(table)
    escape = (lambda text: html.escape(text, quote=False)) if escape_html else (lambda text: text)
    header = [escape(str(c)) for c in flat.columns]
    body = [[escape(_cell(v, digits, c)).replace("|", "\\|") for c, v in zip(flat.columns, row)]
            for row in flat.itertuples(index=False)]
    align = ["---:" if pd.api.types.is_numeric_dtype(flat[c]) else ":---" for c in flat.columns]
    lines = [header, align, *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def to_latex(table: pd.DataFrame, digits: int = 4) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), special characters escaped."""
    flat = _flat(table)
    spec = "".join("r" if pd.api.types.is_numeric_dtype(flat[c]) else "l" for c in flat.columns)
    lines = [f"\\begin{{tabular}}{{{spec}}}", "\\toprule"]
    lines.append(" & ".join(_latex_escape(str(c)) for c in flat.columns) + " \\\\")
    lines.append("\\midrule")
    for row in flat.itertuples(index=False):
        lines.append(" & ".join(_latex_escape(_cell(v, digits, c)) for c, v in zip(flat.columns, row)) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines)


def _flat(table: pd.DataFrame) -> pd.DataFrame:
    has_named_index = any(name is not None for name in table.index.names)
    return table.reset_index() if has_named_index else table.reset_index(drop=True)


def _cell(value: object, digits: int, column: object = None) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        # Budgets are arms: two distinct budgets never print alike (1 and 0.9999999999999999).
        return budget_label(value) if column == "budget" else f"{value:.{digits}g}"
    return "" if value is None else str(value)


_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
    "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "<": r"\textless{}", ">": r"\textgreater{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(ch, ch) for ch in text)
