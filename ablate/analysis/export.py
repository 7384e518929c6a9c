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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pandas as pd

from ablate.analysis.frames import without_attrs
from ablate.analysis.writing import naming
from ablate.budget import budget_label
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
    cells = text_cells(table, digits)
    escape = (lambda text: html.escape(text, quote=False)) if escape_html else (lambda text: text)
    header = [escape(c) for c in cells.columns]
    body = [[escape(text).replace("|", "\\|") for text in row] for row in cells.rows]
    align = ["---:" if numeric else ":---" for numeric in cells.numeric]
    lines = [header, align, *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def to_latex(table: pd.DataFrame, digits: int = 4) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), special characters escaped."""
    cells = text_cells(table, digits)
    spec = "".join("r" if numeric else "l" for numeric in cells.numeric)
    lines = [f"\\begin{{tabular}}{{{spec}}}", "\\toprule"]
    lines.append(" & ".join(_latex_escape(c) for c in cells.columns) + " \\\\")
    lines.append("\\midrule")
    for row in cells.rows:
        lines.append(" & ".join(_latex_escape(text) for text in row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines)


@dataclass(frozen=True)
class TextCells:
    """A table as the text of its cells: what every written form of a table (Markdown, LaTeX, the
    report's HTML) prints, so that the forms agree to the digit."""

    columns: list[str]
    numeric: list[bool]  # per column: right-aligned
    rows: list[list[str]]


def text_cells(table: pd.DataFrame, digits: int = 4) -> TextCells:
    """``table``'s cells as text: its index as columns when named (else dropped), floats with
    ``digits`` significant digits (budgets exactly), NaN and None as empty cells."""
    flat = _flat(table)
    columns = list(flat.columns)
    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in flat.dtypes]
    rows = [[_cell(v, digits, c) for c, v in zip(columns, row)] for row in flat.itertuples(index=False)]
    return TextCells([str(c) for c in columns], numeric, rows)


def _flat(table: pd.DataFrame) -> pd.DataFrame:
    """The table with its index as columns (a named one) or dropped, without attrs: it is read cell by cell."""
    has_named_index = any(name is not None for name in table.index.names)
    return without_attrs(table.reset_index() if has_named_index else table.reset_index(drop=True))


def _cell(value: object, digits: int, column: object = None) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        # Budgets are arms: two distinct budgets never print alike (1 and 0.9999999999999999).
        return budget_label(value) if column == "budget" else f"{value:.{digits}g}"
    return "" if value is None or value is pd.NA else str(value)


_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
    "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "<": r"\textless{}", ">": r"\textgreater{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIALS.get(ch, ch) for ch in text)
