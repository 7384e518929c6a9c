"""``run_cell(cfg)``: one cell end to end, from a composed config to a complete run store entry.

Order matters for "nothing is lost": every value of the config is checked before anything is
written; every step is appended to the store before it is sent to W&B; W&B can fail without
failing the cell; and whatever happens (an exception, Ctrl-C, SIGTERM, a full disk) the cell's
status, records and W&B run are closed. An interrupted cell is recorded as ``interrupted`` with
the steps it logged, and the next run of the same command runs it again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import secrets
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import yaml
from omegaconf import DictConfig

from ablate.backends import RunContext, get_backend
from ablate.cell import Cell
from ablate.compose import ConfigError, cell_from_config
from ablate.config import choice_value
from ablate.diagnostics import validate_record
from ablate.deadline import time_limit
from ablate.interrupts import as_interrupted, check_not_stopping, from_signal, signals_interrupt
from ablate.outcomes import cell_outcomes
from ablate.progress import Progress
from ablate.store import (
    CELL_FILE,
    CellBusy,
    CellRecorder,
    CellState,
    ClaimLost,
    StoreError,
    describe_error,
    held,
    inspect_cell,
    read_json,
    read_summary,
)
from ablate.tracking import WandbTracker, start_tracker

log = logging.getLogger(__name__)

#: Set to 1 (tests do) to make a schema violation an error instead of a logged warning.
STRICT_SCHEMA_ENV = "ABLATE_STRICT_SCHEMA"


def in_multirun() -> bool:
    """Inside a sweep the sweeper reports progress; a per-cell line would garble it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def wandb_run_id(directory: Path) -> str:
    """The cell's one W&B run id: kept from an earlier attempt, else drawn at random.

    Drawn, not derived from the cell: a derived id repeats wherever the same cell is run again
    (another machine, a wiped store, a colleague's checkout), and W&B would then resume or
    refuse someone else's run. Kept in ``cell.json``, so every attempt of a cell, on any host,
    logs to the same run.
    """
    try:
        kept = read_json(directory / CELL_FILE).get("wandb_run_id")
    except (FileNotFoundError, StoreError):
        kept = None
    if isinstance(kept, str) and kept:
        return kept
    return secrets.token_hex(8)


def run_cell(cfg: DictConfig) -> dict[str, Any]:
    """Compose the cell of ``cfg`` and run it (:func:`run`): the testable function of the app."""
    return run(cell_from_config(cfg))


def run(cell: Cell) -> dict[str, Any]:
    """Run one cell and return its summary; a complete cell is not rerun (``summary["skipped"]``).

    Raises :class:`~ablate.config.ConfigError` for a launch its backend refuses (nothing written),
    :class:`~ablate.store.CellBusy` when another live worker holds the cell,
    :class:`~ablate.store.ClaimLost` when another worker took the cell over while this one was
    paused (nothing more is written),
    :class:`~ablate.interrupts.Interrupted` on Ctrl-C, SIGTERM or SIGHUP (the cell is recorded as
    interrupted), and the backend's own error when the cell fails (recorded as failed).
    """
    preflight = get_backend(cell.backend.name).preflight
    if getattr(cell.backend, "dry_run", False):  # a checked launch command; nothing is written
        return {"dry_run": preflight(cell) if preflight else f"backend={cell.backend.name} runs in process"}
    directory = cell.directory
    if inspect_cell(directory, cell.identity).state is CellState.COMPLETE:
        log.info("%s: complete in %s, skipped", cell.name, directory)
        return {**read_summary(directory), "skipped": True}
    check_not_stopping()  # a worker of a stopping sweep starts no new cell, nor checks its launch
    if preflight is not None:  # a launch that cannot work fails here, before the cell is written
        preflight(cell)
    check_not_stopping()  # the sweep may have stopped during the launch check
    with signals_interrupt(), held(directory) as claim:
        view = inspect_cell(directory, cell.identity)
        if view.state is CellState.COMPLETE:  # another worker finished it while we looked
            return {**read_summary(directory), "skipped": True}
        run_id = wandb_run_id(directory)
        recorder = CellRecorder(directory, claim)
        recorder.start(dataclasses.replace(cell.identity, wandb_run_id=run_id).to_json(), config_yaml(cell.resolved),
                       view.attempt + 1)
        return _run_started_cell(cell, recorder, run_id)


def config_yaml(resolved: dict[str, Any]) -> str:
    """The resolved config as the YAML of ``config.yaml``, in the config's own key order (libyaml's
    emitter where PyYAML has it: the file is written once per cell, and OmegaConf's takes 30 ms)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(resolved, Dumper=dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _run_started_cell(cell: Cell, recorder: CellRecorder, run_id: str) -> dict[str, Any]:
    """Everything after the cell's files exist runs inside one ``try``: an interrupt while W&B
    starts is recorded like one in the middle of a step."""
    strict = os.environ.get(STRICT_SCHEMA_ENV) == "1"
    tracker: WandbTracker | None = None
    progress: Progress | None = None

    def log_step(step: int, record: dict[str, float], native: dict[str, float] | None = None) -> None:
        """One step: schema keys (validated) and backend-native metrics under their own names."""
        combined = {**(native or {}), **record}
        check_numbers(step, combined, cell.backend.name)  # first: it ends the cell, the schema's warning would not
        for problem in validate_record(record, strict=strict):
            recorder.warn(f"step {step}: {problem}")
        recorder.record(step, combined)
        assert tracker is not None and progress is not None
        tracker.log(combined, step=step)
        progress.update(step, record)

    try:
        tracking = cell.tracking
        tracker = start_tracker(
            mode=choice_value(tracking.mode), project=tracking.project, entity=tracking.entity,
            tags=tracking.tag_list(), run_dir=recorder.dir, run_id=run_id, group=cell.sweep, job_type=cell.policy,
            name=cell.display_name, config=cell.flat_config(), init_timeout=tracking.init_timeout,
        )
        progress = Progress(cell.name, cell.steps, enabled=tracking.progress and not in_multirun())
        with time_limit(cell.timeout):
            get_backend(cell.backend.name).run(cell, RunContext(directory=recorder.dir, log_step=log_step, log=log))
        if recorder.records.empty:  # a complete cell always has records: the analysis relies on it
            raise RuntimeError(f"backend={cell.backend.name} returned without logging a step")
        summary = summarize_records(recorder.records)
        _close_tracker(tracker, recorder, 0, summary)
        recorder.complete(summary)
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt) and from_signal(error):
            interrupted = as_interrupted(error)
            _close_tracker(tracker, recorder, interrupted.exit_status)
            recorder.fail(interrupted, None, CellState.INTERRUPTED)
            raise interrupted from None
        # What ends a program (SystemExit, a KeyboardInterrupt that no signal caused, GeneratorExit)
        # raised by a plugin ends its cell only: as an Exception, every launcher fails that one job.
        failure = error if isinstance(error, Exception) else CellExit(f"{describe_error(error)} raised by the cell's "
                                                                      "own code: it ends this cell, not the program")
        _close_tracker(tracker, recorder, 1)
        recorder.fail(failure, traceback.format_exc())
        if failure is error:
            raise
        raise failure from error
    finally:
        if progress is not None:
            progress.close()
    for warning in recorder.warnings:
        log.warning("%s: %s", cell.name, warning)
    return summary


class CellExit(RuntimeError):
    """A cell whose own code raised what ends a program (``SystemExit``, ``GeneratorExit``, a
    ``KeyboardInterrupt`` that no signal caused): the cell fails, the sweep goes on."""


def check_numbers(step: int, record: dict[str, Any], backend: str) -> None:
    """Every value a backend logs is a real number: the store's records and the analysis are numbers.

    NaN and infinities are numbers (an undefined or diverged step), and None stands for NaN.
    """
    for key, value in record.items():
        if value is not None and not isinstance(value, numbers.Real):
            raise TypeError(f"step {step}: {key}={value!r} (a {type(value).__name__}) logged by "
                            f"backend={backend}: expected a number")


def _close_tracker(tracker: WandbTracker | None, recorder: CellRecorder, exit_code: int,
                   summary: dict[str, Any] | None = None) -> None:
    """Finish the W&B run (idempotent) and move its warnings to the cell's status."""
    if tracker is not None:
        tracker.finish(summary=summary, exit_code=exit_code)
        recorder.warnings.extend(tracker.warnings)
        tracker.warnings.clear()


def summarize_records(records) -> dict[str, Any]:
    """Outcomes (ablate.outcomes) plus the last value of every logged key."""
    summary: dict[str, Any] = {}
    if not records.empty:
        last = records.iloc[-1]
        summary.update({key: float(last[key]) for key in records.columns if key != "step"})
        summary["steps"] = int(len(records))
    summary.update(cell_outcomes(records))
    return summary


def objective(summary: dict[str, Any], name: str) -> float:
    if name not in summary:
        raise KeyError(f"objective={name!r} is not in the cell's summary: expected one of {', '.join(sorted(summary))}")
    return float(summary[name])


def objective_values(cell: Cell, summary: dict[str, Any]) -> float | list[float]:
    values = [objective(summary, name) for name in cell.objective]
    return values if cell.multi_objective else values[0]


def run_cell_from_cli(cfg: DictConfig) -> float | list[float]:
    """The app's task: compose the cell, run it and return its objective for a sweeper.

    Run alone (not in a sweep), a bad config, a busy cell or an interrupt ends the command with
    one line and the conventional exit status (2 for a bad config, 130 for Ctrl-C, 143 for
    SIGTERM, 129 for SIGHUP), and every cell ends with one line saying where its results are. In
    a sweep, the exceptions propagate to the sweeper, which reports for the whole grid.
    """
    if in_multirun():
        cell = cell_from_config(cfg)
        return objective_values(cell, run(cell))
    started = time.monotonic()
    try:
        cell = cell_from_config(cfg)
    except ConfigError as error:
        _exit(str(error), 2)
    where = f"{cell.name} ({cell.directory})"
    try:
        summary = run(cell)
    except ConfigError as error:
        _exit(str(error), 2)
    except CellBusy as error:
        _exit(f"{error}: not started; run it again once that worker is done", 1)
    except (ClaimLost, StoreError) as error:  # nothing (more) written: the line says why
        _exit(str(error), 1)
    except KeyboardInterrupt as error:
        interrupted = as_interrupted(error)
        recorded = inspect_cell(cell.directory).state is CellState.INTERRUPTED
        what = ("is recorded as interrupted with the steps it logged; run the same command again to rerun it"
                if recorded else "had not started")
        _exit(f"interrupted by {interrupted.signal_name}: {where} {what}", interrupted.exit_status)
    except Exception as error:
        recorded = inspect_cell(cell.directory).state is CellState.FAILED
        _exit(f"{where}: failed after {time.monotonic() - started:.1f} s: {describe_error(error)} "
              f"({'its traceback is in status.json' if recorded else 'not recorded in the run store'})", 1)
    if "dry_run" in summary:
        print(summary["dry_run"], flush=True)
        print(f"{cell.name}: dry run, nothing run or written", flush=True)
        return math.nan
    outcome = "already complete, skipped" if summary.get("skipped") else f"complete in {time.monotonic() - started:.1f} s"
    values = objective_values(cell, summary)
    shown = ", ".join(f"{name}={value:.4g}" for name, value in zip(cell.objective, values if isinstance(values, list) else [values]))
    print(f"{where}: {outcome}, {shown}", flush=True)
    return values


def _exit(message: str, status: int) -> NoReturn:
    print(f"ablate: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)
