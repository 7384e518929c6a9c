"""Grid sweeps over (policy, budget, seed): planning, resume, progress and the final tally.

The Hydra sweeper (``hydra_plugins/ablate_grid_sweeper``) expands the grid like Hydra's basic
sweeper, then hands the job overrides to :func:`plan_grid`, which makes the grid budget-matched
and resumable *before* any launcher sees it:

- ``none`` and ``full`` have one budget by definition, so their cells drop the budget override
  and collapse to one cell per seed, whichever launcher runs them.
- Each job is composed and turned into a :class:`~ablate.cell.Cell`, so a bad value fails the
  whole sweep before the first cell starts, and each cell's identity is known.
- Cells already complete in the run store are not launched again; failed and unfinished ones are.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from omegaconf import DictConfig

from ablate.budget import FIXED_BUDGETS
from ablate.cell import Cell, ConfigError, cell_from_config
from ablate.runner import cell_dir_of
from ablate.store import (
    CLAIM_FILE,
    STATUS_COMPLETE,
    STATUS_FAILED,
    STATUS_RUNNING,
    StoreError,
    claim_is_stale,
    cell_status,
    is_complete,
    read_json,
)

NEW, COMPLETE, FAILED, UNFINISHED, BUSY = "new", "complete", "failed", "unfinished", "busy"


@dataclass
class PlannedCell:
    overrides: list[str]
    cell: Cell
    directory: Path
    #: State in the run store before the sweep started: new, complete, failed, unfinished, busy.
    state: str
    #: The cell's attempt number in the run store before the sweep started (0: never started).
    attempt: int

    @property
    def to_launch(self) -> bool:
        return self.state in (NEW, FAILED, UNFINISHED)


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def prior_state(directory: Path, cell_id: str) -> str:
    """What the run store says about a cell before it is (re)launched."""
    try:
        status = cell_status(directory)
    except StoreError:
        return UNFINISHED  # a status cut by a crash: rerun it
    if status is None:
        return NEW
    if status == STATUS_COMPLETE:
        return COMPLETE if is_complete(directory, cell_id) else NEW
    if status == STATUS_FAILED:
        return FAILED
    claim = directory / CLAIM_FILE
    return BUSY if claim.exists() and not claim_is_stale(claim) else UNFINISHED


def _attempt(directory: Path) -> int:
    try:
        return int(read_json(directory / "status.json").get("attempt", 0))
    except (FileNotFoundError, StoreError, ValueError, TypeError):
        return 0


def plan_grid(jobs: Sequence[Sequence[str]], compose: Callable[[list[str]], DictConfig]) -> list[PlannedCell]:
    """Budget-matched, de-duplicated cells of a grid, with their state in the run store."""
    planned: list[PlannedCell] = []
    seen: set[str] = set()
    for job in jobs:
        overrides = list(job)
        cfg = compose(overrides)
        fixed = FIXED_BUDGETS.get(cfg.policy.name)
        if fixed is not None and cfg.budget is not None and cfg.budget != fixed:
            overrides = [o for o in overrides if override_key(o) != "budget"] + ["budget=null"]
            cfg = compose(overrides)
        try:
            cell = cell_from_config(cfg)
        except ConfigError as error:
            raise ConfigError(f"{error} (in the sweep job {' '.join(job)})") from None
        if cell.cell_id in seen:
            continue
        seen.add(cell.cell_id)
        directory = cell_dir_of(cfg, cell)
        planned.append(PlannedCell(overrides, cell, directory, prior_state(directory, cell.cell_id), _attempt(directory)))
    return planned


def describe_plan(sweep: str, planned: Sequence[PlannedCell]) -> str:
    states = Counter(p.state for p in planned)
    parts = [f"{states[COMPLETE]} complete (skipped)", f"{states[FAILED]} failed (rerun)",
             f"{states[UNFINISHED]} unfinished (rerun)", f"{states[NEW]} new"]
    if states[BUSY]:
        parts.append(f"{states[BUSY]} running elsewhere (skipped)")
    return f"sweep {sweep}: {len(planned)} cells: " + ", ".join(parts)


def current_counts(planned: Sequence[PlannedCell]) -> Counter[str]:
    """done / running / failed / left among the cells this sweep launches.

    A status only counts once its attempt is newer than the one found when the sweep was planned,
    so an old failure waiting for its rerun is "left", not "failed".
    """
    counts: Counter[str] = Counter()
    for cell in planned:
        if not cell.to_launch:
            continue
        try:
            status = read_json(cell.directory / "status.json")
        except (FileNotFoundError, StoreError):
            status = {}
        if int(status.get("attempt", 0)) <= cell.attempt:
            counts["left"] += 1
        elif status.get("status") == STATUS_RUNNING:
            counts["running"] += 1
        elif status.get("status") == STATUS_COMPLETE:
            counts["done"] += 1
        else:
            counts["failed"] += 1
    return counts


class ProgressReporter:
    """Prints how many cells are done, running, failed and left whenever that changes.

    It polls the run store from a thread, so it works whichever launcher runs the cells (in
    process, joblib workers, Ray, SLURM): the store is the one place they all write to.
    """

    def __init__(self, sweep: str, planned: Sequence[PlannedCell], interval: float = 1.0,
                 stream: TextIO | None = None) -> None:
        self.sweep, self.planned, self.interval = sweep, planned, interval
        self.stream = stream or sys.stdout
        self._stop = threading.Event()
        self._last: tuple[int, ...] | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "ProgressReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.report()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def report(self) -> None:
        counts = current_counts(self.planned)
        key = (counts["done"], counts["running"], counts["failed"], counts["left"])
        if key != self._last:
            self._last = key
            print(f"sweep {self.sweep}: {key[0]} done, {key[1]} running, {key[2]} failed, {key[3]} left",
                  file=self.stream, flush=True)


def tally(planned: Sequence[PlannedCell]) -> tuple[Counter[str], list[str]]:
    """Final counts (complete, failed, skipped) and one line per failed cell with its error."""
    counts: Counter[str] = Counter()
    failures = []
    for cell in planned:
        if not cell.to_launch:
            counts["skipped"] += 1
            continue
        try:
            status = read_json(cell.directory / "status.json")
        except (FileNotFoundError, StoreError) as error:
            counts["failed"] += 1
            failures.append(f"{cell.cell.name}: no readable status ({error})")
            continue
        if int(status.get("attempt", 0)) <= cell.attempt:
            counts["failed"] += 1
            failures.append(f"{cell.cell.name}: was not run by the launcher ({cell.directory})")
        elif status.get("status") == STATUS_COMPLETE:
            counts["complete"] += 1
        else:
            counts["failed"] += 1
            failures.append(f"{cell.cell.name}: {status.get('error') or status.get('status')} ({cell.directory})")
    return counts, failures
