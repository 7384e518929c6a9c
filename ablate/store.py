"""The local run store: the source of truth for every cell (DESIGN.md section 5).

Layout: ``<store_dir>/<sweep>/<cell name>-<id[:8]>/`` holds ``cell.json`` (identity),
``config.yaml`` (resolved config), ``status.json`` (running / complete / failed, with error and
traceback), ``records.jsonl`` (one line per step, appended and flushed as the cell runs),
``records.parquet`` (the same records, written when the cell ends) and ``summary.json``.

Every whole file is written atomically (temporary file, fsync, rename), so a crash leaves either
the old or the new version, never half of one. The step log is append-only: a crash can at most
cut its last line, which readers skip. A ``claim`` file holding the owner's host and pid keeps two
workers off the same cell; a claim whose process is gone (same host) or that has not been
refreshed for ``STALE_AFTER`` seconds (other hosts) is taken over.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from filelock import FileLock

STATUS_RUNNING, STATUS_COMPLETE, STATUS_FAILED = "running", "complete", "failed"
CLAIM_FILE = "claim.json"
STALE_AFTER = 600.0


class StoreError(RuntimeError):
    """A run store file that cannot be read: names the file and what is wrong with it."""


class CellBusy(RuntimeError):
    """Another live worker holds the cell's claim."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as JSON null, so every file is strict JSON that any tool can read."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def atomic_write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(_json_safe(dict(data)), indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise StoreError(f"{path}: corrupt run store file ({error}); expected JSON written by ablate") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: corrupt run store file: expected a JSON object, found {type(data).__name__}")
    return data


def read_summary(cell_dir: Path) -> dict[str, Any]:
    """A cell's summary, with the nulls that stand for NaN turned back into NaN."""
    return {key: math.nan if value is None else value for key, value in read_json(cell_dir / "summary.json").items()}


def read_records(cell_dir: Path) -> pd.DataFrame:
    """A cell's per-step records: the Parquet file when the cell ended, else the step log."""
    parquet = cell_dir / "records.parquet"
    if parquet.exists():
        try:
            return pd.read_parquet(parquet)
        except Exception as error:
            raise StoreError(f"{parquet}: corrupt records file ({error}); expected Parquet written by ablate") from None
    rows = []
    log = cell_dir / "records.jsonl"
    if log.exists():
        lines = log.read_text().splitlines()
        for number, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if number != len(lines) - 1:  # only a cut last line is expected after a crash
                    raise StoreError(f"{log}:{number + 1}: corrupt step record; expected one JSON object per line") from None
    frame = pd.DataFrame(rows)
    # JSON has no NaN: undefined values were written as null and come back as floats here.
    return frame.astype({column: "float64" for column in frame.columns if column != "step"})


@dataclass
class Claim:
    """A worker's hold on a cell; :meth:`refresh` keeps it visibly alive for other hosts."""

    path: Path
    refresh_every: float = STALE_AFTER / 4
    _last: float = 0.0

    def refresh(self) -> None:
        """Touch the claim, at most every ``refresh_every`` seconds (cheap to call every step)."""
        if time.monotonic() - self._last >= self.refresh_every:
            os.utime(self.path)
            self._last = time.monotonic()

    def release(self) -> None:
        try:
            if read_json(self.path).get("pid") == os.getpid():
                self.path.unlink()
        except (FileNotFoundError, StoreError):
            pass


def claim_is_stale(path: Path) -> bool:
    """Whether a claim's holder is gone: a dead pid on this host, or no refresh for STALE_AFTER."""
    try:
        holder = read_json(path)
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True
    except StoreError:
        return True  # claims are written whole (see claim()), so an unreadable one is damage
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False
    return age > STALE_AFTER


def claim(cell_dir: Path) -> Claim:
    """Take the cell's claim or raise :class:`CellBusy`; stale claims of dead workers are taken over.

    The claim appears whole: it is written to a private file and hard-linked into place, which
    fails if a claim exists. Taking over a stale claim happens under a file lock, so two workers
    that both find it stale cannot both win.
    """
    path = cell_dir / CLAIM_FILE
    mine = cell_dir / f".claim.{socket.gethostname()}.{os.getpid()}"
    mine.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": now()}))
    try:
        with FileLock(str(cell_dir / ".claim.lock"), timeout=60):
            try:
                os.link(mine, path)
            except FileExistsError:
                if not claim_is_stale(path):
                    raise CellBusy(f"{cell_dir.name} is being run by {path.read_text().strip()}") from None
                os.replace(mine, path)  # atomic takeover, serialised by the lock
                return Claim(path)
    finally:
        mine.unlink(missing_ok=True)
    return Claim(path)


class CellRecorder:
    """Writes one cell's files as it runs; every method leaves the directory consistent."""

    def __init__(self, cell_dir: Path) -> None:
        self.dir = cell_dir
        self.warnings: list[str] = []
        self._status: dict[str, Any] = {}
        self._log = None

    def start(self, cell: Mapping[str, Any], config_yaml: str, attempt: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in ("records.parquet", "records.jsonl", "summary.json"):
            (self.dir / stale).unlink(missing_ok=True)
        atomic_write_json(self.dir / "cell.json", cell)
        atomic_write_bytes(self.dir / "config.yaml", config_yaml.encode())
        self._status = {
            "status": STATUS_RUNNING, "attempt": attempt, "started_at": now(), "finished_at": None,
            "host": socket.gethostname(), "pid": os.getpid(), "error": None, "traceback": None, "warnings": [],
        }
        atomic_write_json(self.dir / "status.json", self._status)
        self._log = open(self.dir / "records.jsonl", "a", buffering=1)

    def record(self, step: int, record: Mapping[str, float]) -> None:
        assert self._log is not None, "start() first"
        self._log.write(json.dumps(_json_safe({"step": step, **record}), allow_nan=False) + "\n")
        self._log.flush()

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def _close(self, status: str, summary: Mapping[str, Any] | None, error: BaseException | None, tb: str | None) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        try:
            records = read_records(self.dir)
        except StoreError as damaged:  # keep the step log as it is; the status must still be closed
            self.warnings.append(f"records not converted to Parquet: {damaged}")
            records = pd.DataFrame()
        if not records.empty:
            buffer = self.dir / f".records.parquet.{os.getpid()}.tmp"
            records.to_parquet(buffer, index=False)
            with open(buffer, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(buffer, self.dir / "records.parquet")
        if summary is not None:
            atomic_write_json(self.dir / "summary.json", summary)
        self._status.update({
            "status": status, "finished_at": now(), "warnings": list(self.warnings),
            "error": None if error is None else f"{type(error).__name__}: {error}", "traceback": tb,
        })
        atomic_write_json(self.dir / "status.json", self._status)

    def complete(self, summary: Mapping[str, Any]) -> None:
        self._close(STATUS_COMPLETE, summary, None, None)

    def fail(self, error: BaseException, tb: str) -> None:
        self._close(STATUS_FAILED, None, error, tb)


def cell_status(cell_dir: Path) -> str | None:
    """``running`` / ``complete`` / ``failed``, or None for a cell never started here."""
    try:
        return str(read_json(cell_dir / "status.json")["status"])
    except FileNotFoundError:
        return None
    except KeyError:
        raise StoreError(f"{cell_dir / 'status.json'}: corrupt run store file: no 'status' field") from None


def is_complete(cell_dir: Path, cell_id: str) -> bool:
    """Complete *and* the same cell (a changed config under the same name is a new cell)."""
    if cell_status(cell_dir) != STATUS_COMPLETE or not (cell_dir / "summary.json").exists():
        return False
    return read_json(cell_dir / "cell.json").get("cell_id") == cell_id


@contextmanager
def held(cell_dir: Path) -> Iterator[Claim]:
    cell_dir.mkdir(parents=True, exist_ok=True)
    taken = claim(cell_dir)
    try:
        yield taken
    finally:
        taken.release()
