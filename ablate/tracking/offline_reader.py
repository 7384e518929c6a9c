"""Read a W&B run back from its local transaction log (the ``run-<id>.wandb`` file), offline.

Why a reader at all, when the run store already holds every record a cell logged: the ``.wandb``
file is the only copy of what W&B itself received, and two jobs need it. The tracker waits after
``finish()`` until the file holds the run's exit record (``wandb-core`` completes the file in the
background, see ``wandb_run``), and the tests and ``load_runs(source="wandb-offline")`` check what
a dashboard will show against the run store. Nothing else answers either question: W&B's public
API reads runs from a server, not from disk.

The file is decoded by wandb's own reader: the ``wandb leet inspect --json`` command that wandb
0.31 ships prints every record of a transaction log as one JSON object per line (protobuf's JSON
form of ``wandb_internal_pb2.Record``), tolerating a truncated or damaged tail. We run the
``wandb-core`` binary that the command launches, with the same arguments, so a read costs
milliseconds instead of a Python start-up. Only the question the tracker asks after every cell,
whether the exit record is there yet, is answered in process from the log's framing
(:mod:`ablate.tracking.transaction_log`): a process per cell cost more than the run itself.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ablate.tracking.transaction_log import exit_record_found

#: History column holding each row's x-axis value (the tracker logs it under this name).
STEP_KEY = "step"
#: How protobuf's JSON form writes the floats that JSON has no literal for.
SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True)
class OfflineRun:
    """One W&B run as written to its transaction log.

    ``history`` has one dict per ``log`` call, each with ``STEP_KEY``; keys W&B adds itself
    (``_step``, ``_runtime``, ``_timestamp``, ``_wandb``) are left out of ``history`` and
    ``summary``. ``complete`` is True only when the run's exit record was read: a run that
    crashed, or whose file is still being written, is incomplete. ``problem`` is what the reader
    said about a truncated or damaged file (the records it could read are still returned), or
    ``None``.
    """

    path: Path
    run_id: str
    name: str
    group: str
    job_type: str
    project: str
    tags: list[str]
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    exit_code: int | None
    complete: bool
    problem: str | None


def find_offline_runs(root: Path | str) -> list[Path]:
    """Every run directory (one holding a ``*.wandb`` file) under ``root``, sorted."""
    return sorted({log.parent for log in Path(root).rglob("*.wandb") if log.is_file()})


def resolve_log_file(path: Path | str) -> Path:
    """The ``.wandb`` file of a run given the file itself or its run directory."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such W&B run directory or .wandb file")
    logs = sorted(path.glob("*.wandb"))
    if len(logs) != 1:
        raise ValueError(
            f"{path}: expected exactly one *.wandb file in a W&B run directory, found {len(logs)}"
            + (f" ({', '.join(log.name for log in logs)})" if logs else "")
        )
    return logs[0]


def read_records(path: Path | str) -> tuple[Path, list[dict[str, Any]], str | None]:
    """The log file, its records as JSON objects, and what the reader said about damage (or None).

    Raises ``ValueError`` naming the path when the file is not a W&B transaction log at all.
    """
    from wandb.util import get_core_path

    log_file = resolve_log_file(path)
    command = [get_core_path(), "leet", "inspect", "--no-observability", "--json", "--run-file", str(log_file),
               str(log_file.parent)]
    # Its JSON is UTF-8 whatever the locale (a tag or a path may hold any character).
    result = subprocess.run(command, capture_output=True, encoding="utf-8", timeout=120)
    message = result.stderr.strip() or None
    if result.returncode != 0:
        raise ValueError(f"{log_file}: not a readable W&B transaction log ({message or f'exit status {result.returncode}'})")
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return log_file, records, message


def read_offline_run(path: Path | str) -> OfflineRun:
    """Decode the run at ``path`` (a run directory or its ``.wandb`` file).

    A truncated file gives every record written whole and ``complete=False``; a file that is
    not a W&B transaction log raises ``ValueError`` naming the path.
    """
    log_file, records, problem = read_records(path)
    builder = _RunBuilder()
    for record in records:
        builder.add(record)
    return builder.build(log_file, problem)


def is_complete(path: Path | str) -> bool:
    """Whether the run's log already holds its exit record (records after it are allowed).

    Read in this process (:mod:`ablate.tracking.transaction_log`); a log whose header that reader
    does not know is read by wandb's reader."""
    found = exit_record_found(resolve_log_file(path))
    if found is None:
        return any(record.get("type") == "exit" for record in read_records(path)[1])
    return found


def history_frame(run: OfflineRun) -> pd.DataFrame:
    """The run's history as one row per step (columns: ``step`` then every key, sorted).

    Several ``log`` calls at the same step merge into one row, later values winning, so the
    frame matches what the W&B UI plots at that step. Keys are sorted because ``wandb-core``
    does not keep the order in which a step's keys were logged.
    """
    rows: dict[Any, dict[str, Any]] = {}
    for entry in run.history:
        rows.setdefault(entry[STEP_KEY], {}).update(entry)
    frame = pd.DataFrame(list(rows.values()))
    if frame.empty:
        return pd.DataFrame(columns=[STEP_KEY])
    return frame[[STEP_KEY, *sorted(c for c in frame.columns if c != STEP_KEY)]]


def _value(value: Any) -> Any:
    return SPECIAL_FLOATS.get(value, value) if isinstance(value, str) else value


def _visible(values: dict[str, Any]) -> dict[str, Any]:
    """Logged values without the keys W&B adds itself (``_step``, ``_runtime``, ``_wandb``...)."""
    return {key: _value(value) for key, value in values.items() if not key.startswith("_")}


class _RunBuilder:
    """Folds records in log order into the fields of an ``OfflineRun``."""

    def __init__(self) -> None:
        self.run: dict[str, Any] = {}
        self.config: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.exit: dict[str, Any] | None = None

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        body = record.get(kind, {}) if isinstance(kind, str) else {}
        if kind == "run":
            self.run = body
            self._update(self.config, body.get("config", {}))
        elif kind == "config":
            self._update(self.config, body)
        elif kind == "history":
            item = body.get("item", {})
            row = _visible(item)
            row.setdefault(STEP_KEY, item.get("_step", body.get("step", {}).get("num", 0)))
            self.history.append(row)
        elif kind == "summary":
            self._update(self.summary, body)
        elif kind == "exit":
            self.exit = body

    @staticmethod
    def _update(target: dict[str, Any], change: dict[str, Any]) -> None:
        target.update(_visible(change.get("update", {})))
        for key in change.get("remove", {}):
            target.pop(key, None)

    def build(self, log_file: Path, problem: str | None) -> OfflineRun:
        run = self.run
        return OfflineRun(
            path=log_file,
            run_id=run.get("run_id", ""),
            name=run.get("display_name", ""),
            group=run.get("run_group", ""),
            job_type=run.get("job_type", ""),
            project=run.get("project", ""),
            tags=list(run.get("tags", [])),
            config=self.config,
            history=self.history,
            summary=self.summary,
            exit_code=int(self.exit.get("exit_code", 0)) if self.exit is not None else None,
            complete=self.exit is not None,
            problem=problem,
        )
