"""The writer of one cell's files: every method leaves the cell's directory consistent."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ablate.store.claims import Claim, ClaimLost
from ablate.store.files import atomic_write, atomic_write_bytes, atomic_write_json, is_disk_full, json_safe
from ablate.store.layout import (
    ATTEMPT_FILES,
    CELL_FILE,
    CONFIG_FILE,
    RECORDS_FILE,
    RECORDS_LOG,
    STATUS_FILE,
    SUMMARY_FILE,
    WANDB_DIR,
    now,
    records_frame,
)
from ablate.store.state import CellState

log = logging.getLogger(__name__)

class CellRecorder:
    """Writes one cell's files as it runs; every method leaves the directory consistent.

    The records it wrote are kept in memory too (:attr:`records`), so the summary is computed
    from what was logged without reading the files back.
    """

    def __init__(self, cell_dir: Path, claim: Claim | None = None) -> None:
        self.dir = cell_dir
        #: The claim this recorder writes under: every write that marks the cell is fenced by it.
        self.claim = claim
        self.warnings: list[str] = []
        self._rows: list[dict[str, Any]] = []
        self._frame: pd.DataFrame | None = None
        self._status: dict[str, Any] = {}
        self._log = None

    @property
    def records(self) -> pd.DataFrame:
        """Every step recorded so far, as written to the step log (built once per new step)."""
        if self._frame is None or len(self._frame) != len(self._rows):
            self._frame = records_frame(self._rows)
        return self._frame

    def _fence(self) -> None:
        if self.claim is not None:
            self.claim.check()

    def start(self, cell: Mapping[str, Any], config_yaml: str, attempt: int) -> None:
        """Begin attempt ``attempt``: the previous attempt's records, summary and W&B run go."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fence()
        for stale in ATTEMPT_FILES:
            (self.dir / stale).unlink(missing_ok=True)
        shutil.rmtree(self.dir / WANDB_DIR, ignore_errors=True)
        atomic_write_json(self.dir / CELL_FILE, cell)
        atomic_write_bytes(self.dir / CONFIG_FILE, config_yaml.encode())
        self._status = {
            "status": CellState.RUNNING.value, "attempt": attempt, "started_at": now(), "finished_at": None,
            "host": socket.gethostname(), "pid": os.getpid(), "error": None, "traceback": None, "warnings": [],
        }
        atomic_write_json(self.dir / STATUS_FILE, self._status)
        self._log = open(self.dir / RECORDS_LOG, "a", buffering=1)

    def record(self, step: int, record: Mapping[str, float]) -> None:
        assert self._log is not None, "start() first"
        if self.claim is not None and self.claim.lost:  # seen by the heartbeat: stop at the next step
            self.claim.check()
        row = {"step": step, **record}
        self._log.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
        self._log.flush()
        self._rows.append(row)  # only once it is on disk

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def complete(self, summary: Mapping[str, Any]) -> None:
        """Parquet records, summary, then the status: a crash before the last leaves a rerun.

        Each write is fenced: a worker that lost its claim stops with :class:`ClaimLost` before it.
        """
        self._close_log()
        self._write_parquet()
        self._fence()
        atomic_write_json(self.dir / SUMMARY_FILE, summary)
        self._write_status(CellState.COMPLETE, None, None)

    def fail(self, error: BaseException, tb: str | None, state: CellState = CellState.FAILED) -> None:
        """Record a failed or interrupted attempt, keeping its steps.

        Best effort: it runs while an error propagates (a full disk among them), so a write that
        fails here, whatever it raises, is logged, never raised over the original error, and the
        status is written even when the records cannot be. If even the status cannot be written,
        it stays ``running`` with no live claim, which every reader treats as unfinished. A worker
        that lost its claim writes nothing.
        """
        self._close_log()
        if self.claim is not None:
            try:
                self.claim.check()
            except ClaimLost as lost:
                if not isinstance(error, ClaimLost):  # else the error on its way up says it
                    log.warning("%s", lost)
                return
        for write in (self._write_parquet, lambda: self._write_status(state, error, tb)):
            try:
                write()
            except Exception as failure:  # a full disk, a lost claim, records Parquet cannot hold
                log.warning("%s: could not record the %s attempt (%s)", self.dir, state.value, failure)

    def _close_log(self) -> None:
        if self._log is not None:
            try:
                self._log.close()
            except OSError as error:  # the flush of a full disk: the lines before it are on disk
                log.warning("%s: closing the step log failed (%s)", self.dir, error)
            self._log = None

    def _write_parquet(self) -> None:
        records = self.records
        if not records.empty:
            self._fence()
            atomic_write(self.dir / RECORDS_FILE, lambda tmp: records.to_parquet(tmp, index=False))

    def _write_status(self, state: CellState, error: BaseException | None, tb: str | None) -> None:
        self._status.update({
            "status": state.value, "finished_at": now(), "warnings": list(self.warnings),
            "error": None if error is None else describe_error(error), "traceback": tb,
        })
        path = self.dir / STATUS_FILE
        self._fence()
        try:
            atomic_write_json(path, self._status)
        except OSError as failure:
            if not is_disk_full(failure) or state is CellState.COMPLETE:
                raise
            # A full disk has no room for a temporary copy, but the old status file has room for a
            # short new one. Rewritten in place: a crash in that instant leaves it unreadable,
            # which every reader treats as damage to rerun, as it would treat "running".
            short = {**self._status, "traceback": None, "warnings": self._status["warnings"][-3:]}
            data = (json.dumps(json_safe(short), sort_keys=True, default=str) + "\n").encode()
            with open(path, "r+b") as handle:
                handle.write(data)
                handle.truncate()
                handle.flush()
                os.fsync(handle.fileno())


def describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
