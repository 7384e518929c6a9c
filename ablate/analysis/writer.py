"""Write a :class:`~ablate.analysis.compute.SweepAnalysis` to its output folder: tables, plots, report.

Every file is written atomically (a temporary file, then a rename: :mod:`ablate.store`), so an
analysis stopped midway leaves each output whole, old or new. What a writer killed outright left
behind (``.<name>.<pid>.<thread>.tmp`` of a process that is gone) is removed by the next run.
A write that fails (a full disk, a folder that cannot be made) ends in one
:class:`OutputError` naming the file and the reason.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ablate.analysis.compute import SweepAnalysis
from ablate.analysis.export import export_table
from ablate.analysis.extras import MissingExtraError
from ablate.store import StoreError, atomic_write, make_directory


class OutputError(RuntimeError):
    """An output of the analysis could not be written: the message names the file and the reason."""


@dataclass
class Written:
    """What :func:`write_outputs` wrote: the PNG images per outcome ("" for the sweep's own) and the report."""

    out: Path
    images: dict[str, list[Path]] = field(default_factory=dict)
    plots_skipped: str | None = None  # why no plot was drawn (matplotlib missing)
    report: Path | None = None


def write_outputs(result: SweepAnalysis, out: Path, *, plots: bool = True, report: bool = False,
                  report_design: list[str] | None = None, sweep: str = "") -> Written:
    """Write every table of ``result`` (and its plots, and with ``report`` the HTML report) into ``out``."""
    with naming(out):
        make_directory(out, "the analysis output folder")
        remove_dead_writers_files(out)
    written = Written(out)
    drawing = _plots_module(written) if plots else None
    with naming(out / "cells.csv"):
        atomic_write(out / "cells.csv", lambda tmp: result.cells.to_csv(tmp, index=False))
    for outcome, tables in result.outcomes.items():
        _export(tables.summary, out / f"table_{outcome}")
        _export(tables.effects, out / f"effects_{outcome}", formats=("csv", "md"))
        _export(tables.plan, out / f"power_{outcome}", formats=("csv", "md"))
        for key, _, _, compared in tables.compared:
            _export(compared, out / f"compare_{file_part(key)}_{outcome}", formats=("csv", "md"))
        if drawing is not None:
            written.images[outcome] = _draw(drawing, result, outcome, out)
    _export(result.flags, out / "flags", formats=("csv", "md"))
    if drawing is not None and result.steps is not None:
        with naming(out / "steps.png"):
            written.images[""] = _png(drawing.plot_step_curves(result.steps, out / "steps", by=result.keys,
                                                               level=result.settings.level))
    if result.survival is not None:
        times, table = result.survival
        _export(table, out / "survival", formats=("csv", "md"))
        if drawing is not None:
            with naming(out / "collapse_survival.png"):
                written.images.setdefault("", []).extend(
                    _png(drawing.plot_collapse_survival(times, out / "collapse_survival", by=result.keys)))
    if report:
        from ablate.analysis.report import write_report

        with naming(out / "report.html"):
            written.report = write_report(out / "report.html", result, sweep=sweep, design=report_design or [],
                                          images=written.images)
    return written


def _draw(drawing: Any, result: SweepAnalysis, outcome: str, out: Path) -> list[Path]:
    tables = result.outcomes[outcome]
    paths = []
    with naming(out / f"budget_response_{outcome}.png"):
        paths += drawing.plot_budget_response(tables.summary, out / f"budget_response_{outcome}")
    with naming(out / f"selection_effects_{outcome}.png"):
        paths += drawing.plot_selection_effects(tables.effects, out / f"selection_effects_{outcome}")
    if "effective_budget_mean" in result.cells.columns:
        with naming(out / f"effective_budget_{outcome}.png"):
            paths += drawing.plot_effective_budget(result.cells, out / f"effective_budget_{outcome}",
                                                   outcome=outcome, by=result.keys)
    return _png(paths)


def _png(paths: list[Path]) -> list[Path]:
    return [path for path in paths if path.suffix == ".png"]


def _export(table: Any, stem: Path, formats: tuple[str, ...] = ("csv", "parquet", "md", "latex")) -> None:
    with naming(stem):
        export_table(table, stem, formats=formats)


def _plots_module(written: Written) -> Any:
    """The plotting module, or None with the reason in ``written`` (an install without matplotlib)."""
    try:
        from ablate.analysis import plots
    except MissingExtraError as error:
        written.plots_skipped = str(error)
        return None
    return plots


@contextmanager
def naming(target: Path) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``target`` into one :class:`OutputError` naming the file.

    The error's own file name is used when it has one (a temporary file is named by the file it
    stands for); else ``target``.
    """
    try:
        yield
    except StoreError as error:
        raise OutputError(str(error)) from None
    except OSError as error:
        path = _final_path(error.filename) if error.filename else target
        reason = error.strerror or str(error) or type(error).__name__
        raise OutputError(f"{path}: cannot write ({reason}); nothing half-written is left there") from None


def _final_path(filename: Any) -> Path:
    """``.x.png.<pid>.<thread>.tmp`` -> ``x.png`` (the file an atomic write stands for)."""
    path = Path(os.fsdecode(filename))
    parts = path.name.split(".")
    if path.name.startswith(".") and path.name.endswith(".tmp") and len(parts) >= 5:
        return path.with_name(".".join(parts[1:-3]))
    return path


def remove_dead_writers_files(folder: Path) -> list[Path]:
    """Remove the temporary files in ``folder`` whose writer (the pid in their name) is gone.

    An analysis killed mid-write (SIGKILL, SIGTERM during a plot) leaves
    ``.<name>.<pid>.<thread>.tmp``; one of a live process is another analysis writing now, and
    stays.
    """
    removed = []
    for tmp in folder.glob(".*.tmp"):
        parts = tmp.name.split(".")
        if len(parts) < 5 or not parts[-3].isdigit() or _alive(int(parts[-3])):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def file_part(key: str) -> str:
    """A config key as part of a file name: ``policy.per_layer`` -> ``policy-per_layer``."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in key)
