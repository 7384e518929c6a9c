"""Grid sweeps over (policy, budget, seed): planning, resume, progress and the final tally.

The Hydra sweeper (``hydra_plugins/ablate_grid_sweeper``) expands the grid like Hydra's basic
sweeper, then hands the job overrides to :func:`plan_grid`, which makes the grid budget-matched
and resumable *before* any launcher sees it:

- ``none`` and ``full`` have one budget by definition, so their cells drop the budget override
  and collapse to one cell per seed, whichever launcher runs them.
- Each job is composed and turned into a :class:`~ablate.cell.Cell`, so a bad value fails the
  whole sweep before the first cell starts, and each cell's identity is known.
- Each cell is classified by the run store (:func:`ablate.store.inspect_cell`): complete cells
  are skipped, cells another live worker is running are waited for, and all others (new,
  failed, interrupted, unfinished, corrupt) are launched.

While cells run, :class:`ProgressReporter` polls the store, and at the end :func:`tally` counts
each cell by what the store says it became, never by what the launcher returned: a cell counts
as complete only if its complete result is in the store.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from omegaconf import DictConfig

from ablate.budget import FIXED_BUDGETS
from ablate.cell import Cell, ConfigError, cell_from_config
from ablate.store import CellState, CellView, inspect_cell, sweep_dir

#: How a launched cell ended up, for progress and the tally (``left``: no newer attempt yet).
DONE, RUNNING, FAILED, INTERRUPTED, LEFT = "done", "running", "failed", "interrupted", "left"


@dataclass(frozen=True)
class PlannedCell:
    overrides: list[str]
    cell: Cell
    directory: Path
    #: What the run store said about the cell when the sweep was planned.
    prior: CellView

    @property
    def to_launch(self) -> bool:
        return self.prior.state.rerun

    @property
    def waited_for(self) -> bool:
        """Another live worker was running it: this sweep waits for its result instead."""
        return self.prior.state is CellState.RUNNING


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def plan_grid(jobs: Sequence[Sequence[str]], compose: Callable[[list[str]], DictConfig]) -> list[PlannedCell]:
    """Budget-matched, de-duplicated cells of a grid, with their state in the run store.

    ``compose(overrides)`` returns the app config of one job (the sweeper composes with Hydra;
    tests may pass any function that builds the config).
    """
    planned: list[PlannedCell] = []
    seen: set[str] = set()
    for job in jobs:
        overrides = list(job)
        try:
            cfg = compose(overrides)
            fixed = FIXED_BUDGETS.get(cfg.policy.name)
            if fixed is not None and cfg.budget is not None and cfg.budget != fixed:
                overrides = [o for o in overrides if override_key(o) != "budget"] + ["budget=null"]
                cfg = compose(overrides)
            cell = cell_from_config(cfg)
        except ConfigError as error:
            raise ConfigError(f"{error} (in the sweep job {' '.join(job)})") from None
        if cell.cell_id in seen:
            continue
        seen.add(cell.cell_id)
        directory = sweep_dir(cfg.store_dir, cell.sweep) / cell.dirname
        planned.append(PlannedCell(overrides, cell, directory, inspect_cell(directory, cell.cell_id)))
    return planned


def describe_plan(sweep: str, planned: Sequence[PlannedCell]) -> str:
    states = Counter(p.prior.state for p in planned)
    parts = [f"{states[CellState.COMPLETE]} complete (skipped)", f"{states[CellState.FAILED]} failed (rerun)",
             f"{states[CellState.UNFINISHED]} unfinished (rerun)", f"{states[CellState.NEW]} new"]
    if states[CellState.INTERRUPTED]:
        parts.insert(2, f"{states[CellState.INTERRUPTED]} interrupted (rerun)")
    if states[CellState.CORRUPT]:
        parts.append(f"{states[CellState.CORRUPT]} damaged (rerun)")
    if states[CellState.RUNNING]:
        parts.append(f"{states[CellState.RUNNING]} running elsewhere (waited for)")
    return f"sweep {sweep}: {len(planned)} cells: " + ", ".join(parts)


def outcome(cell: PlannedCell) -> tuple[str, CellView]:
    """What became of a launched or waited-for cell, from the run store alone.

    A status counts only once its attempt is newer than the one found when the sweep was planned
    (an old failure waiting for its rerun is ``left``), except for a cell another worker was
    already running, whose current attempt is the one this sweep waits for.
    """
    view = inspect_cell(cell.directory, cell.cell.cell_id)
    if view.state is CellState.COMPLETE:
        return DONE, view
    if view.state is CellState.RUNNING:
        return RUNNING, view
    if view.attempt <= cell.prior.attempt and not cell.waited_for:
        return LEFT, view
    if view.state is CellState.INTERRUPTED:
        return INTERRUPTED, view
    if view.state in (CellState.NEW, CellState.UNFINISHED) and cell.waited_for:
        return LEFT, view  # its worker stopped without a result
    return FAILED, view


def tracked(planned: Sequence[PlannedCell]) -> list[PlannedCell]:
    """The cells whose outcome this sweep reports: the ones it launches or waits for."""
    return [cell for cell in planned if cell.to_launch or cell.waited_for]


def current_counts(planned: Sequence[PlannedCell]) -> Counter[str]:
    """done / running / failed / interrupted / left among the cells this sweep launches or waits for."""
    return Counter(outcome(cell)[0] for cell in tracked(planned))


def wait_for_others(planned: Sequence[PlannedCell], interval: float) -> None:
    """Block while a cell of the sweep is held by a live worker (another sweep, another host)."""
    while any(outcome(cell)[0] == RUNNING for cell in tracked(planned)):
        time.sleep(interval)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def progress_line(sweep: str, counts: Counter[str], elapsed: float) -> str:
    """``sweep s: 7 done, 1 running, 0 failed, 12 left [0:35 elapsed, 5.0 s/cell, ETA 1:00]``.

    The rate counts cells that ended in this sweep; the ETA spreads the remaining ones (running
    included) at that rate, so it holds for parallel launchers too.
    """
    finished = counts[DONE] + counts[FAILED] + counts[INTERRUPTED]
    remaining = counts[RUNNING] + counts[LEFT]
    timing = f"{format_duration(elapsed)} elapsed"
    if finished and remaining:
        per_cell = elapsed / finished
        timing += f", {per_cell:.1f} s/cell, ETA {format_duration(per_cell * remaining)}"
    interrupted = f", {counts[INTERRUPTED]} interrupted" if counts[INTERRUPTED] else ""
    return (f"sweep {sweep}: {counts[DONE]} done, {counts[RUNNING]} running, {counts[FAILED]} failed{interrupted}, "
            f"{counts[LEFT]} left [{timing}]")


class ProgressReporter:
    """Reports how many cells are done, running, failed and left, with the elapsed time and an ETA.

    It polls the run store from a thread, so it works whichever launcher runs the cells (in
    process, joblib workers, Ray, SLURM): the store is the one place they all write to. On a
    terminal it draws a tqdm bar; otherwise it prints a line whenever the counts change, which
    reads well in a log file.
    """

    def __init__(self, sweep: str, planned: Sequence[PlannedCell], interval: float = 1.0,
                 stream: TextIO | None = None) -> None:
        self.sweep, self.planned, self.interval = sweep, planned, interval
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._last: tuple[int, ...] | None = None
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=len(tracked(planned)), desc=f"sweep {sweep}", unit="cell", file=self.stream,
                             dynamic_ncols=True)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"progress-{sweep}")

    def __enter__(self) -> "ProgressReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.report()
        if self._bar is not None:
            self._bar.close()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def report(self) -> None:
        counts = current_counts(self.planned)
        if self._bar is not None:
            self._bar.n = counts[DONE] + counts[FAILED] + counts[INTERRUPTED]
            self._bar.set_postfix_str(f"{counts[RUNNING]} running, {counts[FAILED]} failed", refresh=False)
            self._bar.refresh()
            return
        key = (counts[DONE], counts[RUNNING], counts[FAILED], counts[INTERRUPTED], counts[LEFT])
        if key != self._last:
            self._last = key
            print(progress_line(self.sweep, counts, self.elapsed), file=self.stream, flush=True)


@dataclass(frozen=True)
class Tally:
    """The final count of a sweep, and one line per cell that did not complete."""

    counts: Counter[str]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self, sweep: str, elapsed: float, where: Path | None) -> str:
        extra = "".join(f", {self.counts[key]} {key}" for key in (INTERRUPTED, "not run") if self.counts[key])
        return (f"sweep {sweep}: {self.counts['complete']} complete, {self.counts['failed']} failed{extra}, "
                f"{self.counts['skipped']} skipped in {format_duration(elapsed)} (results under {where or '-'})")


def tally(planned: Sequence[PlannedCell]) -> Tally:
    """Count every cell by its state in the store; a cell that did not run never counts as done."""
    counts: Counter[str] = Counter()
    problems = []
    for cell in planned:
        if not (cell.to_launch or cell.waited_for):
            counts["skipped"] += 1
            continue
        ended, view = outcome(cell)
        name, where = cell.cell.name, cell.directory
        if ended == DONE:
            counts["complete"] += 1
        elif ended == INTERRUPTED:
            counts[INTERRUPTED] += 1
            problems.append(f"interrupted: {name}: {view.detail or 'interrupted'} ({where}); a rerun of the sweep "
                            "runs it again")
        elif ended == FAILED:
            counts["failed"] += 1
            problems.append(f"failed: {name}: {view.detail or view.state.value} ({where})")
        else:
            counts["not run"] += 1
            problems.append(f"not run: {name}: {view.detail or 'the launcher did not run it'} ({where}); a rerun "
                            "of the sweep runs it")
    return Tally(counts, problems)
