"""Grid sweeps over (policy, budget, seed): planning, resume, progress and the final tally.

The Hydra sweeper (``hydra_plugins/ablate_grid_sweeper``) expands the grid like Hydra's basic
sweeper, then hands the job overrides to :func:`plan_grid`, which makes the grid budget-matched
and resumable *before* any launcher sees it:

- ``none`` and ``full`` have one budget by definition, so their cells drop the budget override
  and collapse to one cell per seed, whichever launcher runs them; ``none`` replays no route, so
  its cells drop the replay variant's overrides too (``replay.source=rollout,train``).
- Each job is composed and turned into a :class:`~ablate.cell.Cell`, so a bad value fails the
  whole sweep before the first cell starts, and each cell's identity is known.
- Each cell is classified by the run store (:func:`ablate.store.inspect_cell`): complete cells
  are skipped, cells another live worker is running are waited for, and all others (new,
  failed, interrupted, unfinished, corrupt) are launched.
- The cells are put in seed-major order (:func:`seed_major`): every arm of the first seed, then
  every arm of the next, so a sweep stopped at any point holds whole seeds of every arm.

While cells run, :class:`ProgressReporter` polls the store, and at the end :func:`tally` counts
each cell by what the store says it became, never by what the launcher returned: a cell counts
as complete only if its complete result is in the store.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from ablate.cell import Cell
from ablate.compose import ConfigError, cell_from_config
from ablate.overrides import quoted_override
from ablate.policies import fixed_budget_of, load_plugins
from ablate.store import CellState, CellView, StoreError, inspect_cell, make_directory

#: Off a terminal, progress is printed this many times over a sweep (and when a cell fails).
LOG_STEPS = 10
#: The words progress lines use for the states of the cells a sweep launches or waits for.
PROGRESS_WORDS = {CellState.COMPLETE: "done", CellState.RUNNING: "running", CellState.FAILED: "failed",
                  CellState.INTERRUPTED: "interrupted", CellState.NEW: "left"}


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
    """Budget-matched, de-duplicated cells of a grid, with their state in the run store, seed-major.

    ``compose(overrides)`` returns the app config of one job (the sweeper composes with Hydra;
    tests may pass any function that builds the config). A composer that also has
    ``template(overrides)`` (the grid sweeper's) plans a job without composing it where it can:
    the planning then costs the grid's compositions, not its cells.
    """
    planned: list[PlannedCell] = []
    seen: set[str] = set()
    for job, label in zip(jobs, arm_labels(jobs)):
        overrides = list(job) + ([quoted_override("tracking.label", label)] if label else [])
        try:
            overrides, cell = _planned_cell(overrides, compose)
        except ConfigError as error:
            raise ConfigError(f"{error} (in the sweep job {' '.join(job)})") from None
        if cell.cell_id in seen:
            continue
        seen.add(cell.cell_id)
        planned.append(PlannedCell(overrides, cell, cell.directory, inspect_cell(cell.directory, cell.identity)))
    return seed_major(planned)


def seed_major(planned: Sequence[PlannedCell]) -> list[PlannedCell]:
    """The cells by seed, in the order the grid first names each seed, and within a seed in grid order.

    Hydra's grid is the product of the keys in the order they appear, so a sweep file's
    ``policy, budget, seed`` runs one policy after another: stopped early, it would hold ``none``,
    ``full`` and ``random`` and nothing to compare a selection with. Seed-major, a sweep stopped
    after any number of cells holds every arm at its first seeds (the last seed partly), and each
    launcher starts the cells in this order.
    """
    rank: dict[int, int] = {}
    for cell in planned:
        rank.setdefault(cell.cell.seed, len(rank))
    return sorted(planned, key=lambda cell: rank[cell.cell.seed])


def _planned_cell(overrides: list[str], compose: Callable[[list[str]], DictConfig]) -> tuple[list[str], Cell]:
    """The job's cell, and its overrides with the budget dropped for a policy whose budget is fixed.

    ``none`` and ``full`` have one budget by definition: a grid's budgets collapse to it. A policy
    that replays nothing (``none``) has no replay variant either: a grid's ``replay.*`` values collapse.
    """
    templates = getattr(compose, "template", None)
    found = templates(overrides) if templates is not None else None
    if found is not None:
        template, values = found
        fixed = template.fixed_budget
        if fixed is not None and values.get("budget") not in (None, fixed):
            overrides = _without_budget(overrides)
            values = {**values, "budget": None}
        if fixed == 0 and _replay_keys(overrides):
            overrides = _without_replay(overrides)
            values = {key: value for key, value in values.items() if key.split(".")[0] != "replay"}
        return overrides, template.cell(values)
    cfg = compose(overrides)
    load_plugins(str(module) for module in cfg.get("plugins") or ())
    fixed = fixed_budget_of(cfg.policy.name)
    if fixed is not None and cfg.budget is not None and cfg.budget != fixed:
        overrides = _without_budget(overrides)
        cfg = compose(overrides)
    if fixed == 0 and _replay_keys(overrides):
        overrides = _without_replay(overrides)
        cfg = compose(overrides)
    return overrides, cell_from_config(cfg)


def _without_budget(overrides: list[str]) -> list[str]:
    return [o for o in overrides if override_key(o) != "budget"] + ["budget=null"]


def _replay_keys(overrides: list[str]) -> bool:
    return any(override_key(o).split(".")[0] == "replay" for o in overrides)


def _without_replay(overrides: list[str]) -> list[str]:
    return [o for o in overrides if override_key(o).split(".")[0] != "replay"]


#: Override keys a cell's name already carries (with its variant: the policy's own settings and the
#: replay variant), or that never set an arm apart.
NAMED_KEYS = ("policy", "replay", "budget", "seed", "trial", "store_dir", "sweep", "tracking")


def arm_labels(jobs: Sequence[Sequence[str]]) -> list[str]:
    """Per job, the overrides that vary across the grid and its cell's name does not show
    (``backend.router_noise=0.2``): two arms' W&B runs must not share a display name."""
    present: dict[str, set[str]] = {}
    jobs_with: Counter[str] = Counter()
    for job in jobs:
        for override in job:
            present.setdefault(override_key(override), set()).add(override.lstrip("+~"))
        jobs_with.update({override_key(override) for override in job})
    varied = {key for key, values in present.items()
              if key.split(".")[0] not in NAMED_KEYS and (len(values) > 1 or jobs_with[key] < len(jobs))}
    return [" ".join(o.lstrip("+~") for o in job if override_key(o) in varied) for job in jobs]


def empty_sweeps(overrides: Sequence[Override]) -> list[str]:
    """The sweep overrides that expand to no value (``seed=range(0,0)``): a grid with none has no cells."""
    return [o.input_line or o.key_or_group for o in overrides
            if o.is_sweep_override() and not list(o.sweep_string_iterator())]


def repeated_values(overrides: Sequence[Override]) -> list[str]:
    """``seed=0,0: 0 twice`` for each sweep override that lists a value more than once (one cell runs)."""
    notes = []
    for override in overrides:
        if override.is_sweep_override():
            values = Counter(override.sweep_string_iterator())
            twice = [f"{value} {count} times" for value, count in values.items() if count > 1]
            if twice:
                notes.append(f"{override.input_line or override.key_or_group} lists {', '.join(twice)}")
    return notes


def make_sweep_directory(config: DictConfig) -> Path:
    """Create the sweep's directory (``hydra.sweep.dir``), or end the sweep in one line that says what stands in the way."""
    directory = Path(config.hydra.sweep.dir)
    try:
        make_directory(directory, "the sweep's directory")
    except StoreError as error:
        print(f"ablate: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return directory


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


def outcome(cell: PlannedCell) -> tuple[CellState, CellView]:
    """What became of a launched or waited-for cell in this sweep, from the run store alone.

    One of COMPLETE, RUNNING, FAILED, INTERRUPTED, or NEW for a cell that this sweep has not (re)run
    (yet). A status counts only once its attempt is newer than the one found when the sweep was
    planned (an old failure waiting for its rerun is NEW here), except for a cell another worker
    was already running, whose current attempt is the one this sweep waits for. An attempt that
    ended damaged or whose worker died (CORRUPT, UNFINISHED) counts as FAILED; the view says which.
    """
    view = inspect_cell(cell.directory, cell.cell.identity)
    if view.state in (CellState.COMPLETE, CellState.RUNNING):
        return view.state, view
    if view.state is CellState.CORRUPT and cell.prior.state is CellState.CORRUPT and view.detail == cell.prior.detail:
        return CellState.FAILED, view  # still the same damage: the detail says what to repair
    if view.attempt <= cell.prior.attempt and not cell.waited_for:
        return CellState.NEW, view
    if view.state is CellState.INTERRUPTED:
        return view.state, view
    if view.state in (CellState.NEW, CellState.UNFINISHED) and cell.waited_for:
        return CellState.NEW, view  # its worker stopped without a result
    return CellState.FAILED, view


def tracked(planned: Sequence[PlannedCell]) -> list[PlannedCell]:
    """The cells whose outcome this sweep reports: the ones it launches or waits for."""
    return [cell for cell in planned if cell.to_launch or cell.waited_for]


def wait_for_others(planned: Sequence[PlannedCell], interval: float) -> None:
    """Block while a cell of the sweep is held by a live worker (another sweep, another host)."""
    while any(outcome(cell)[0] is CellState.RUNNING for cell in tracked(planned)):
        time.sleep(interval)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def finished(counts: Counter[CellState]) -> int:
    return counts[CellState.COMPLETE] + counts[CellState.FAILED] + counts[CellState.INTERRUPTED]


def progress_line(sweep: str, counts: Counter[CellState], elapsed: float, eta: float | None = None) -> str:
    """``sweep s: 7 done, 1 running, 0 failed, 12 left [0:35 elapsed, 5.0 s/cell, ETA 1:00]``.

    The rate counts cells that ended in this sweep. The ETA is ``eta`` when given (see
    :class:`Pace`), else the remaining cells (running included) at that rate.
    """
    remaining = counts[CellState.RUNNING] + counts[CellState.NEW]
    timing = f"{format_duration(elapsed)} elapsed"
    if finished(counts) and remaining:
        per_cell = elapsed / finished(counts)
        timing += f", {per_cell:.1f} s/cell, ETA {format_duration(per_cell * remaining if eta is None else eta)}"
    shown = [state for state in PROGRESS_WORDS if counts[state] or state is not CellState.INTERRUPTED]
    return f"sweep {sweep}: " + ", ".join(f"{counts[state]} {PROGRESS_WORDS[state]}" for state in shown) + f" [{timing}]"


class Pace:
    """The time left, from how long cells take and how many run at once.

    A cell's duration runs from when the reporter first sees it running to when it first sees it
    complete. The work left is what each running cell still needs (the mean duration less its
    age, at least nothing) plus a mean duration per cell not started; spread over as many
    workers as run now, that is the ETA. Unlike the elapsed time per cell, it is not inflated by a
    launcher's start-up (Ray, submitit) nor by cells that ran side by side and ended together.
    """

    def __init__(self) -> None:
        self.started: dict[Path, float] = {}
        self.durations: list[float] = []
        self._ended: set[Path] = set()

    def update(self, states: dict[Path, CellState], now: float) -> None:
        for path, state in states.items():
            if state is CellState.RUNNING:
                self.started.setdefault(path, now)
            elif state is not CellState.NEW and path not in self._ended:
                self._ended.add(path)
                if state is CellState.COMPLETE and path in self.started:
                    self.durations.append(now - self.started[path])

    def eta(self, states: dict[Path, CellState], now: float) -> float | None:
        """Seconds left, or None before a cell was seen both starting and completing."""
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        ages = [now - self.started.get(path, now) for path, state in states.items() if state is CellState.RUNNING]
        waiting = sum(state is CellState.NEW for state in states.values())
        work = sum(max(mean - age, 0.0) for age in ages) + waiting * mean
        return work / max(len(ages), 1)


class ProgressReporter:
    """Reports how many cells are done, running, failed and left, with the elapsed time and an ETA.

    It polls the run store from a thread, so it works whichever launcher runs the cells (in
    process, joblib workers, Ray, SLURM): the store is the one place they all write to. On a
    terminal it draws a tqdm bar; otherwise (a log file) it prints a line when the sweep starts,
    each time another tenth of its cells has ended (:data:`LOG_STEPS`), at once when a cell fails
    or is interrupted, and at the end: a line per change of the counts was two lines per cell.
    """

    def __init__(self, sweep: str, planned: Sequence[PlannedCell], interval: float = 1.0,
                 stream: TextIO | None = None) -> None:
        self.sweep, self.planned, self.interval = sweep, planned, interval
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._last: tuple[int, ...] | None = None
        self._shown: tuple[int, ...] | None = None
        #: Off a terminal, a line each time this many more cells have ended.
        self._log_step = max(1, -(-len(tracked(planned)) // LOG_STEPS))
        self._bar = None
        self.pace = Pace()
        self._tracked = tracked(planned)
        #: Cells seen complete: a complete cell stays so, and is not read again at every report.
        self._complete: set[Path] = set()
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=len(self._tracked), desc=f"sweep {sweep}", unit="cell", file=self.stream,
                             dynamic_ncols=True)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"progress-{sweep}")

    def __enter__(self) -> "ProgressReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.report(final=True)
        if self._bar is not None:
            self._bar.close()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _state(self, cell: PlannedCell) -> CellState:
        if cell.directory in self._complete:
            return CellState.COMPLETE
        state = outcome(cell)[0]
        if state is CellState.COMPLETE:
            self._complete.add(cell.directory)
        return state

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.report()

    def report(self, final: bool = False) -> None:
        states = {cell.directory: self._state(cell) for cell in self._tracked}
        counts = Counter(states.values())
        self.pace.update(states, time.monotonic())
        if self._bar is not None:
            # Done means ended for good: an interrupted cell runs again, so a stopped sweep's bar
            # stays where its complete and failed cells put it.
            self._bar.n = counts[CellState.COMPLETE] + counts[CellState.FAILED]
            stopped = f", {counts[CellState.INTERRUPTED]} interrupted" if counts[CellState.INTERRUPTED] else ""
            self._bar.set_postfix_str(f"{counts[CellState.RUNNING]} running, {counts[CellState.FAILED]} failed{stopped}",
                                      refresh=False)
            self._bar.refresh()
            return
        shown = tuple(counts[state] for state in PROGRESS_WORDS)
        # A new line when another tenth of the cells has ended, a cell failed or was interrupted, and
        # at the end, each only if the counts changed since the last line.
        step = (finished(counts) // self._log_step, counts[CellState.FAILED], counts[CellState.INTERRUPTED])
        if (step != self._last or final) and shown != self._shown:
            self._last, self._shown = step, shown
            eta = self.pace.eta(states, time.monotonic())
            print(progress_line(self.sweep, counts, self.elapsed, eta), file=self.stream, flush=True)


#: The words of the final tally: cells complete before the sweep are "skipped", a cell the sweep
#: did not manage to run is "not run", and one a live worker still holds is "still running".
TALLY_WORDS = {CellState.COMPLETE: "complete", CellState.FAILED: "failed", CellState.INTERRUPTED: "interrupted",
               CellState.RUNNING: "still running", CellState.NEW: "not run"}


#: The errors of a full disk, as a cell's recorded error names them (``OSError: [Errno 28] ...``).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Cells named one per line under the tally; the dry run lists them all.
MOST_PROBLEMS = 20
#: The cells not run that the tally's one line for them names.
NOT_RUN_NAMED = 3


@dataclass(frozen=True)
class Tally:
    """The final count of a sweep (by :func:`outcome` state, plus ``skipped``), and one line per
    cell that did not complete."""

    counts: Counter[CellState]
    skipped: int
    problems: list[str]
    #: Cells that failed because their disk was full (their recorded error is ENOSPC or EDQUOT).
    disk_full: int = 0
    #: What cells that completed warned of: in a sweep their log lines stay in each job's file.
    warnings: list[str] = field(default_factory=list)
    #: The names of the cells the sweep did not reach (their lines are among ``problems``).
    not_run: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self, sweep: str, elapsed: float, where: Path | None) -> str:
        parts = [f"{self.counts[state]} {word}" for state, word in TALLY_WORDS.items()
                 if self.counts[state] or state in (CellState.COMPLETE, CellState.FAILED)]
        return (f"sweep {sweep}: {', '.join(parts)}, {self.skipped} skipped in {format_duration(elapsed)} "
                f"(results under {where or '-'})")

    def report(self, sweep: str, elapsed: float, where: Path | None, most: int = MOST_PROBLEMS) -> list[str]:
        """The tally line, then one line per cell that failed, was interrupted or is still running (the
        first ``most`` of them), and one line for the cells not run: a stopped sweep leaves most of its
        cells so, and a line for each said nothing the count does not."""
        named = [problem for problem in self.problems if not problem.startswith("not run: ")]
        shown = [f"  {problem}" for problem in named[:most]]
        if len(named) > most:
            shown.append(f"  ... and {len(named) - most} more (hydra.sweeper.dry_run=true lists every cell "
                         "with its state)")
        if self.not_run:
            first = ", ".join(self.not_run[:NOT_RUN_NAMED])
            more = f" and {len(self.not_run) - NOT_RUN_NAMED} more" if len(self.not_run) > NOT_RUN_NAMED else ""
            shown.append(f"  not run: {len(self.not_run)} cell{'s' if len(self.not_run) != 1 else ''} ({first}{more}); "
                         "a rerun of the sweep runs them")
        shown += [f"  warning: {warning}" for warning in self.warnings[:most]]
        if len(self.warnings) > most:
            shown.append(f"  ... and {len(self.warnings) - most} more warnings (each cell's status.json lists its own)")
        return [self.line(sweep, elapsed, where), *shown]


def tally(planned: Sequence[PlannedCell]) -> Tally:
    """Count every cell by its state in the store; a cell that did not run never counts as done."""
    counts: Counter[CellState] = Counter()
    problems, warnings, not_run = [], [], []
    disk_full = 0
    for cell in tracked(planned):
        ended, view = outcome(cell)
        counts[ended] += 1
        name, where = cell.cell.name, cell.directory
        warnings += [f"{name}: {warning}" for warning in view.warnings]
        disk_full += ended is CellState.FAILED and any(f"[Errno {code}]" in (view.detail or "") for code in DISK_FULL)
        if ended is CellState.INTERRUPTED:
            problems.append(f"interrupted: {name}: {view.detail or 'interrupted'} ({where}); a rerun of the sweep "
                            "runs it again")
        elif ended is CellState.FAILED:
            problems.append(f"failed: {name}: {view.detail or view.state.value} ({where})")
        elif ended is CellState.RUNNING:
            problems.append(f"still running: {name}: {view.detail} ({where}); its worker had not ended when the "
                            "sweep did")
        elif ended is not CellState.COMPLETE:
            not_run.append(name)
            problems.append(f"not run: {name}: {view.detail or 'the launcher did not run it'} ({where}); a rerun "
                            "of the sweep runs it")
    return Tally(counts, len(planned) - len(tracked(planned)), problems, disk_full, warnings, not_run)
