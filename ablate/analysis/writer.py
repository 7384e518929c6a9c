"""Write a :class:`~ablate.analysis.compute.SweepAnalysis` to its output folder: tables, plots, report.

Each file is written whole or not at all, and a failed write is one error naming the file
(:mod:`ablate.analysis.writing`); the temporary files a killed analysis left are removed first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ablate.analysis.compute import SweepAnalysis
from ablate.analysis.export import export_table
from ablate.analysis.extras import MissingExtraError
from ablate.analysis.report import write_report
from ablate.analysis.writing import file_part, naming, remove_dead_writers_files
from ablate.store import atomic_write, make_directory


@dataclass
class Written:
    """What :func:`write_outputs` wrote: the PNG images per outcome ("" for the sweep's own) and the report."""

    out: Path
    images: dict[str, list[Path]] = field(default_factory=dict)
    plots_skipped: str | None = None  # why no plot was drawn (matplotlib missing)
    report: Path | None = None


def write_outputs(result: SweepAnalysis, out: Path, *, plots: bool = True, report: bool = False, plan: bool = False,
                  report_design: list[str] | None = None, sweep: str = "") -> Written:
    """Write every table of ``result`` into ``out``: with ``plots`` the figures, with ``plan`` the power
    plans (``power_<outcome>``), with ``report`` the HTML report."""
    with naming(out):
        make_directory(out, "the analysis output folder")
        remove_dead_writers_files(out)
    written = Written(out)
    drawing = _plots_module(written) if plots else None
    with naming(out / "cells.csv"):
        atomic_write(out / "cells.csv", lambda tmp: result.cells.to_csv(tmp, index=False))
    for outcome, tables in result.outcomes.items():
        export_table(tables.summary, out / f"table_{outcome}")
        export_table(tables.effects, out / f"effects_{outcome}", formats=("csv", "md"))
        if plan:
            export_table(tables.plan, out / f"power_{outcome}", formats=("csv", "md"))
        for key, _, _, compared in tables.compared:
            export_table(compared, out / f"compare_{file_part(key)}_{outcome}", formats=("csv", "md"))
        if drawing is not None:
            written.images[outcome] = _draw(drawing, result, outcome, out)
    export_table(result.flags, out / "flags", formats=("csv", "md"))
    if drawing is not None and result.steps is not None:
        written.images[""] = _png(drawing.plot_step_curves(result.steps, out / "steps", by=result.keys,
                                                           level=result.settings.level))
    if result.survival is not None:
        times, table = result.survival
        export_table(table, out / "survival", formats=("csv", "md"))
        if drawing is not None:
            curves = drawing.plot_collapse_survival(times, out / "collapse_survival", by=result.keys)
            written.images.setdefault("", []).extend(_png(curves))
    if report:
        with naming(out / "report.html"):
            written.report = write_report(out / "report.html", result, sweep=sweep, design=report_design or [],
                                          images=written.images)
    return written


def _draw(drawing: Any, result: SweepAnalysis, outcome: str, out: Path) -> list[Path]:
    tables = result.outcomes[outcome]
    paths = drawing.plot_budget_response(tables.summary, out / f"budget_response_{outcome}")
    paths += drawing.plot_selection_effects(tables.effects, out / f"selection_effects_{outcome}")
    if "effective_budget_mean" in result.cells.columns:
        paths += drawing.plot_effective_budget(result.cells, out / f"effective_budget_{outcome}", outcome=outcome,
                                               by=result.keys)
    return _png(paths)


def _png(paths: list[Path]) -> list[Path]:
    return [path for path in paths if path.suffix == ".png"]


def _plots_module(written: Written) -> Any:
    """The plotting module, or None with the reason in ``written`` (an install without matplotlib)."""
    try:
        from ablate.analysis import plots
    except MissingExtraError as error:
        written.plots_skipped = str(error)
        return None
    return plots
