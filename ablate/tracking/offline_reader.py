"""Read a W&B run back from its local transaction log, with no account and no server.

W&B has no public reader for offline runs, yet the ``.wandb`` file is the only complete local
copy of what a cell sent to W&B: this module turns it into plain Python values so tests and
the analysis can check what a dashboard will show. Records are decoded with wandb's own
protobuf classes (``wandb.proto.wandb_internal_pb2.Record``); the block framing is in
``logfile``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

from ablate.tracking.logfile import scan_log

#: History column holding each row's x-axis value (the tracker logs it under this name).
STEP_KEY = "step"


@dataclass(frozen=True)
class OfflineRun:
    """One W&B run as written to its transaction log.

    ``history`` has one dict per ``log`` call, each with ``STEP_KEY``; keys W&B adds itself
    (``_step``, ``_runtime``, ``_timestamp``, ``_wandb``) are left out of ``history`` and
    ``summary``. ``complete`` is True only when the run's exit record was read: a run that
    crashed, or whose file is still being written, is incomplete. ``problem`` says why reading
    stopped before the end of the file (a truncated or corrupt tail), or is ``None``.
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


def read_offline_run(path: Path | str) -> OfflineRun:
    """Decode the run at ``path`` (a run directory or its ``.wandb`` file).

    A truncated file gives every record written whole and ``complete=False``; a file that is
    not a W&B transaction log raises ``ValueError`` naming the path.
    """
    log_file = resolve_log_file(path)
    scan = scan_log(log_file)
    records, problem = _decode(log_file, scan.payloads, scan.problem)
    builder = _RunBuilder()
    for record in records:
        builder.add(record)
    return builder.build(log_file, problem)


def is_complete(path: Path | str) -> bool:
    """Whether the run's log already holds its exit record.

    Cheaper than ``read_offline_run``: records are decoded from the end backwards and none is
    converted to Python values. The exit record is usually the last one, but records that
    ``wandb-core`` produces in the background (system metrics, the machine description) can
    follow it, so the search does not stop at the last record.
    """
    for payload in reversed(scan_log(resolve_log_file(path)).payloads):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError:
            continue  # an undecodable record cannot be the exit record
        if record.HasField("exit"):
            return True
    return False


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


def _decode(
    log_file: Path, payloads: Iterable[bytes], problem: str | None
) -> tuple[list[pb.Record], str | None]:
    """Parse payloads into records, stopping (not raising) at the first undecodable one."""
    records = []
    for index, payload in enumerate(payloads):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as error:
            return records, f"{log_file}: record {index} is not a wandb Record ({error})"
        records.append(record)
    return records, problem


def _item_key(item: Any) -> str:
    """The flat key of a config, history or summary item (``key`` or its ``nested_key`` path)."""
    return item.key or ".".join(item.nested_key)


def _history_value(item: pb.HistoryItem) -> Any:
    """A logged value, from its typed form when wandb wrote one, else from its JSON text.

    wandb 0.31 writes ``value_json`` by default and typed scalars when the
    ``x_history_value_encoding`` setting asks for them; the typed form keeps ints and floats
    apart, so it wins when both are present.
    """
    case = item.WhichOneof("value")
    if case is None:
        return json.loads(item.value_json)
    if case == "none":
        return None
    if case == "json":
        return json.loads(item.json)
    return getattr(item, case)


def _is_internal(key: str) -> bool:
    return key.startswith("_")


class _RunBuilder:
    """Folds records in log order into the fields of an ``OfflineRun``."""

    def __init__(self) -> None:
        self.run: pb.RunRecord | None = None
        self.config: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.exit: pb.RunExitRecord | None = None

    def add(self, record: pb.Record) -> None:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            self.run = record.run
            self._update_config(record.run.config)
        elif kind == "config":
            self._update_config(record.config)
        elif kind == "history":
            self._add_history(record.history)
        elif kind == "summary":
            self._update_summary(record.summary)
        elif kind == "exit":
            self.exit = record.exit

    def _update_config(self, config: pb.ConfigRecord) -> None:
        for item in config.update:
            key = _item_key(item)
            if key != "_wandb":
                self.config[key] = json.loads(item.value_json)
        for item in config.remove:
            self.config.pop(_item_key(item), None)

    def _add_history(self, history: pb.HistoryRecord) -> None:
        values = {_item_key(item): _history_value(item) for item in history.item}
        row = {key: value for key, value in values.items() if not _is_internal(key)}
        row.setdefault(STEP_KEY, values.get("_step", history.step.num))
        self.history.append(row)

    def _update_summary(self, summary: pb.SummaryRecord) -> None:
        for item in summary.update:
            key = _item_key(item)
            if not _is_internal(key):
                self.summary[key] = json.loads(item.value_json)
        for item in summary.remove:
            self.summary.pop(_item_key(item), None)

    def build(self, log_file: Path, problem: str | None) -> OfflineRun:
        run = self.run or pb.RunRecord()
        return OfflineRun(
            path=log_file,
            run_id=run.run_id,
            name=run.display_name,
            group=run.run_group,
            job_type=run.job_type,
            project=run.project,
            tags=list(run.tags),
            config=self.config,
            history=self.history,
            summary=self.summary,
            exit_code=self.exit.exit_code if self.exit is not None else None,
            complete=self.exit is not None,
            problem=problem,
        )
