"""The local run store: the source of truth for every cell (docs/design.md section 5).

This module owns the store: its layout, the one vocabulary of cell states (:class:`CellState`)
that planning, progress, the final tally and the analysis all use, the claims that keep two
workers off one cell, and the writer of a cell's files (:class:`CellRecorder`).

Layout: ``<store_dir>/<sweep>/<cell name>-<id[:8]>/`` holds ``cell.json`` (identity),
``config.yaml`` (resolved config), ``status.json`` (running / complete / failed / interrupted,
with error and traceback), ``records.jsonl`` (one line per step, appended and flushed as the
cell runs), ``records.parquet`` (the same records, written when the cell ends),
``summary.json``, ``claim.json`` while a worker holds the cell, and ``wandb/`` (its W&B run).
Entries of a sweep directory whose name starts with ``_`` (Hydra's ``_hydra``) are not cells.

Every whole file is written atomically (temporary file, fsync, rename) and a temporary file is
removed when the write fails (a full disk), so a crash leaves either the old or the new version,
never half of one. The step log is append-only: a crash can at most cut its last line, which
readers skip.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
from filelock import FileLock

from ablate.config import check_sweep_name

log = logging.getLogger(__name__)

CELL_FILE, CONFIG_FILE, STATUS_FILE = "cell.json", "config.yaml", "status.json"
RECORDS_LOG, RECORDS_FILE, SUMMARY_FILE = "records.jsonl", "records.parquet", "summary.json"
CLAIM_FILE, WANDB_DIR = "claim.json", "wandb"
#: What a new attempt of a cell replaces: the previous attempt's results and its W&B run.
ATTEMPT_FILES = (RECORDS_FILE, RECORDS_LOG, SUMMARY_FILE)

#: A claim whose heartbeat is older than this is stale when its holder cannot be checked directly
#: (another host, or a claim written without the holder's process start time).
STALE_AFTER = 120.0
#: How often a holder refreshes its claim's heartbeat (a thread, so long steps do not matter).
HEARTBEAT_EVERY = 20.0


class StoreError(RuntimeError):
    """A run store file that cannot be read: names the file and what is wrong with it."""


class CellBusy(RuntimeError):
    """Another live worker holds the cell's claim."""


class ClaimLost(RuntimeError):
    """This worker no longer holds the claim of the cell it runs: another worker took the cell over.

    It happens to a worker paused or stalled longer than the stale limit (a SLURM suspend, a VM
    pause, an NFS stall): its claim looked dead and was taken. The worker must write nothing more
    to the cell, whose files are now the other worker's.
    """


class CellState(str, Enum):
    """Where a cell stands in the run store: the one vocabulary of the store's readers.

    ``status.json`` records ``running``, ``complete``, ``failed`` or ``interrupted``; the other
    states are derived: ``new`` (never started), ``unfinished`` (recorded as running, but no
    live worker holds it: killed or crashed) and ``corrupt`` (a file that must be readable is
    not: ``status.json``, or a complete cell's ``cell.json``, summary or Parquet records).
    """

    NEW = "new"
    RUNNING = "running"
    UNFINISHED = "unfinished"
    COMPLETE = "complete"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CORRUPT = "corrupt"

    @property
    def rerun(self) -> bool:
        """Whether a sweep (re)launches a cell in this state: all but complete and running ones."""
        return self not in (CellState.COMPLETE, CellState.RUNNING)


@dataclass(frozen=True)
class CellView:
    """What the store says about one cell directory, read once."""

    directory: Path
    state: CellState
    #: The attempt recorded in ``status.json`` (0: never started or unreadable).
    attempt: int
    #: The recorded error of a failed or interrupted cell, why a cell is corrupt, or who runs it.
    detail: str | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CellIdentity:
    """The fields of ``cell.json``: which cell a directory holds. The runner writes it, every reader reads it here."""

    cell_id: str
    #: The human name (``fisher-b0.25-s3``); the directory is ``<name>-<cell_id[:8]>``.
    name: str
    backend: str
    policy: str
    budget: float
    seed: int
    sweep: str | None = None
    schema_version: str | None = None
    #: The Optuna trial number of a study's cell.
    trial: int | None = None
    #: The policy's non-default settings, ``tau=1.0`` ("" for defaults): with the policy, the arm.
    variant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    #: The cell's one W&B run id, kept across attempts.
    wandb_run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], path: Path) -> "CellIdentity":
        """Check every field's type and range; a wrong one is a :class:`StoreError` naming it."""
        checks: dict[str, tuple[Any, str]] = {
            "cell_id": (lambda v: isinstance(v, str) and len(v) >= 8, "a hex identity of at least 8 characters"),
            "name": (lambda v: isinstance(v, str) and bool(v), "a cell name"),
            "backend": (lambda v: isinstance(v, str) and bool(v), "a backend name"),
            "policy": (lambda v: isinstance(v, str) and bool(v), "a policy name"),
            "budget": (lambda v: (_is_int(v) or isinstance(v, float)) and 0 <= v <= 1, "a number in [0, 1]"),
            "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
            "sweep": (lambda v: v is None or isinstance(v, str), "a sweep name"),
            "schema_version": (lambda v: v is None or isinstance(v, str), "a version string"),
            "trial": (lambda v: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
            "variant": (lambda v: isinstance(v, str), "a string"),
            "settings": (lambda v: isinstance(v, dict), "a mapping of policy settings"),
            "wandb_run_id": (lambda v: v is None or isinstance(v, str), "null or a W&B run id"),
        }
        values: dict[str, Any] = {}
        for spec in fields(cls):
            if spec.name not in data:
                if spec.default is not MISSING or spec.default_factory is not MISSING:
                    continue  # written by an older ablate, or not this kind of cell (trial)
                raise StoreError(f"{path}: corrupt cell identity: no {spec.name}; expected {checks[spec.name][1]}")
            value = data[spec.name]
            ok, expected = checks[spec.name]
            if not ok(value):
                raise StoreError(f"{path}: corrupt cell identity: {spec.name}={value!r}; expected {expected}")
            values[spec.name] = float(value) if spec.name == "budget" else value
        return cls(**values)


def read_identity(cell_dir: Path) -> CellIdentity:
    """A cell's ``cell.json``, checked field by field and against its directory's name."""
    path = cell_dir / CELL_FILE
    identity = CellIdentity.from_json(read_json(path), path)
    if cell_dir.name != f"{identity.name}-{identity.cell_id[:8]}":
        raise StoreError(f"{path}: corrupt cell identity: it names the cell {identity.name}-{identity.cell_id[:8]}, "
                         f"not the directory {cell_dir.name} it is in")
    return identity


def cell_directories(sweep_path: Path) -> list[Path]:
    """The cells of a sweep directory: each entry with a ``cell.json`` (written when a cell is claimed)."""
    return sorted(p.parent for p in sweep_path.glob(f"*/{CELL_FILE}") if not p.parent.name.startswith("_"))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def store_root(store_dir: str | os.PathLike[str]) -> Path:
    """The store root as an absolute path: the one place ``store_dir`` is resolved.

    Relative to the directory the command started in, so that every worker of a sweep (Ray, SLURM,
    joblib, each with its own working directory) writes to the same store.
    """
    return Path(store_dir).expanduser().absolute()


def sweep_dir(store_dir: str | os.PathLike[str], sweep: str) -> Path:
    return store_root(store_dir) / check_sweep_name(sweep)


# --- atomic files ---------------------------------------------------------------------------


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def atomic_write(path: Path, write: Any) -> None:
    """``write(tmp)`` then fsync and rename over ``path``; the temporary file never outlives a failure."""
    tmp = _tmp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


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
    return {key: math.nan if value is None else value for key, value in read_json(cell_dir / SUMMARY_FILE).items()}


def records_frame(rows: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Step records as a frame; every column but ``step`` is float (JSON nulls become NaN)."""
    frame = pd.DataFrame(rows)
    return frame.astype({column: "float64" for column in frame.columns if column != "step"})


def read_records(cell_dir: Path) -> pd.DataFrame:
    """A cell's per-step records: the Parquet file when the cell ended, else the step log."""
    parquet = cell_dir / RECORDS_FILE
    if parquet.exists():
        try:
            return pd.read_parquet(parquet)
        except Exception as error:  # pyarrow raises several unrelated types for a damaged file
            raise StoreError(f"{parquet}: corrupt records file ({error}); expected Parquet written by ablate") from None
    rows = []
    log_file = cell_dir / RECORDS_LOG
    if log_file.exists():
        lines = log_file.read_text().splitlines()
        for number, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if number != len(lines) - 1:  # only a cut last line is expected after a crash
                    raise StoreError(f"{log_file}:{number + 1}: corrupt step record; expected one JSON object per line") from None
    return records_frame(rows)


def _check_parquet(path: Path) -> None:
    """Raise StoreError unless ``path`` is a Parquet file whose footer reads (cheap: no data read)."""
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing, but the cell's status is 'complete'") from None
    except Exception as error:
        raise StoreError(f"{path}: corrupt records file ({error}); expected Parquet written by ablate") from None


# --- claims ---------------------------------------------------------------------------------


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if there is no such process.

    With the pid, this identifies a process: a reused pid (in containers, pid 1 comes back after
    every restart) belongs to a process that started later.
    """
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return math.nan  # alive, but its start time cannot be read: the heartbeat decides


def this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "since": now()}


def holder_is_alive(holder: Mapping[str, Any], heartbeat_age: float) -> bool:
    """Whether the process that wrote a claim still runs.

    On the same host the process itself is checked: alive, and started when the claim says (a
    reused pid is another process). A claim without a start time (written by an older ablate) or
    on another host is alive while its heartbeat is fresher than ``STALE_AFTER``.
    """
    if holder.get("host") != socket.gethostname():
        # A heartbeat further in the future than the stale limit comes from a clock that cannot be
        # trusted; counting it as fresh would keep every other worker waiting until that time.
        return -STALE_AFTER <= heartbeat_age <= STALE_AFTER
    try:
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    started = _process_start(pid)
    if started is None:
        return False
    recorded = holder.get("process_start")
    if not isinstance(recorded, (int, float)) or math.isnan(started):
        return heartbeat_age <= STALE_AFTER
    return abs(started - recorded) < 0.5


def claim_holder(path: Path) -> dict[str, Any] | None:
    """The holder of a live claim at ``path``, or None when there is none or it is stale."""
    try:
        holder = read_json(path)
        age = time.time() - path.stat().st_mtime
    except (FileNotFoundError, StoreError):
        return None  # claims are written whole (see claim()), so an unreadable one is damage
    return holder if holder_is_alive(holder, age) else None


def describe_holder(holder: Mapping[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


class Claim:
    """A worker's hold on a cell, kept visibly alive by a heartbeat thread until released."""

    def __init__(self, path: Path, identity: Mapping[str, Any], heartbeat_every: float = HEARTBEAT_EVERY) -> None:
        self.path, self.identity = path, dict(identity)
        #: Set once the claim is found to be another worker's; it never comes back.
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_every,), daemon=True,
                                        name=f"claim-heartbeat-{path.parent.name}")
        self._thread.start()

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            if not self.owned():  # never keep another worker's claim alive
                self.lost = True
                return
            try:
                os.utime(self.path)
            except OSError as error:
                log.warning("%s: claim heartbeat failed (%s)", self.path, error)

    def owned(self) -> bool:
        try:
            held = read_json(self.path)
        except (FileNotFoundError, StoreError):
            return False
        return all(held.get(k) == self.identity[k] for k in ("host", "pid", "process_start"))

    def check(self) -> None:
        """The fence: raise :class:`ClaimLost` unless this worker still holds the claim.

        Called before every write that marks the cell (its identity, status, records, summary),
        so that a worker that resumes after losing its claim cannot overwrite the result of the
        worker that took the cell over.
        """
        if not self.lost and self.owned():
            return
        self.lost = True
        try:
            now_held = f"now held by {describe_holder(read_json(self.path))}"
        except (FileNotFoundError, StoreError):
            now_held = "since taken over and released"
        raise ClaimLost(
            f"{self.path.parent.name}: this worker ({describe_holder(self.identity)}) lost its claim on the cell, "
            f"{now_held}: it was paused or stalled past the {STALE_AFTER:g} s stale limit and another worker took "
            f"the cell over; it stops without writing, the cell's files are the other worker's ({self.path.parent})")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.owned():
            self.path.unlink(missing_ok=True)


def claim(cell_dir: Path) -> Claim:
    """Take the cell's claim or raise :class:`CellBusy`; stale claims of dead workers are taken over.

    The claim appears whole: it is written to a private file and hard-linked into place, which
    fails if a claim exists. Taking over a stale claim happens under a file lock, so two workers
    that both find it stale cannot both win.
    """
    path = cell_dir / CLAIM_FILE
    if path.is_dir():
        raise StoreError(f"{path}: a directory where the cell's claim file should be; remove it, then run again")
    identity = this_process()
    mine = cell_dir / f".claim.{identity['host']}.{identity['pid']}"
    try:
        mine.write_text(json.dumps(identity))
        with FileLock(str(cell_dir / ".claim.lock"), timeout=60):
            try:
                os.link(mine, path)
            except FileExistsError:
                holder = claim_holder(path)
                if holder is not None:
                    raise CellBusy(f"{cell_dir.name} is being run by {describe_holder(holder)}") from None
                _log_takeover(path)
                os.replace(mine, path)  # atomic takeover, serialised by the lock
    finally:
        mine.unlink(missing_ok=True)
    remove_dead_writers_files(cell_dir)
    return Claim(path, identity)


def _log_takeover(path: Path) -> None:
    """Say whose stale claim is taken over, and why when its heartbeat is in the future."""
    try:
        holder, age = read_json(path), time.time() - path.stat().st_mtime
    except (OSError, StoreError):
        return
    why = (f"its heartbeat is {-age:.0f} s in the future (a clock off by more than {STALE_AFTER:g} s)" if age < 0
           else f"its heartbeat is {age:.0f} s old")
    log.warning("%s: taking over the stale claim of %s: %s", path.parent.name, describe_holder(holder), why)


def remove_dead_writers_files(cell_dir: Path) -> None:
    """Remove the temporary files of atomic writes that a killed writer left in ``cell_dir``.

    Only the claim's holder writes a cell's files, so once the claim is taken every temporary
    file in the directory belongs to a writer that is gone (kill -9, the OOM killer, a lost node).
    """
    for tmp in cell_dir.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


@contextmanager
def held(cell_dir: Path) -> Iterator[Claim]:
    make_directory(cell_dir, "the cell's directory")
    taken = claim(cell_dir)
    try:
        yield taken
    finally:
        taken.release()


def make_directory(path: Path, what: str) -> None:
    """``mkdir -p``, failing with one :class:`StoreError` that says what stands in the way."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StoreError(f"{path}: a file where {what} should be; move it away, then run again") from None
    except OSError as error:
        raise StoreError(f"{path}: cannot create {what} ({error.strerror}); expected a writable directory") from None


# --- reading a cell's state -----------------------------------------------------------------


def inspect_cell(directory: Path, cell_id: str | None = None) -> CellView:
    """Classify one cell directory; never raises for damage, which is the ``corrupt`` state.

    ``cell_id``, when given, must match the identity in ``cell.json`` for the cell to count as
    complete: a directory of another config under the same name is not this cell's result. A
    complete cell counts only when its identity (every field of :class:`CellIdentity`, and the
    directory it names), config, summary and Parquet records read back (the Parquet footer is
    checked, not every row), so a damaged cell is rerun instead of skipped, and read by no analysis.
    """
    if directory.exists() and not directory.is_dir():
        return CellView(directory, CellState.CORRUPT, 0,
                        f"{directory}: a file where the cell's directory should be; move it away, then run again")
    if (directory / CLAIM_FILE).is_dir():
        return CellView(directory, CellState.CORRUPT, 0,
                        f"{directory / CLAIM_FILE}: a directory where the cell's claim file should be; remove it, "
                        "then run again")
    try:
        status = read_json(directory / STATUS_FILE)
    except FileNotFoundError:
        return CellView(directory, CellState.NEW, 0)
    except StoreError as error:
        return CellView(directory, CellState.CORRUPT, 0, str(error))
    attempt = status.get("attempt")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
    recorded = status.get("status")
    if recorded == CellState.RUNNING.value:
        holder = claim_holder(directory / CLAIM_FILE)
        if holder is None:
            return CellView(directory, CellState.UNFINISHED, attempt, "no live worker holds it (killed or crashed)")
        return CellView(directory, CellState.RUNNING, attempt, describe_holder(holder))
    if recorded in (CellState.FAILED.value, CellState.INTERRUPTED.value):
        return CellView(directory, CellState(recorded), attempt, status.get("error"))
    if recorded != CellState.COMPLETE.value:
        return CellView(directory, CellState.CORRUPT, attempt,
                        f"{directory / STATUS_FILE}: unknown status {recorded!r}; expected running, complete, "
                        "failed or interrupted")
    try:
        identity = read_identity(directory)
        read_json(directory / SUMMARY_FILE)
        _check_parquet(directory / RECORDS_FILE)
        if not (directory / CONFIG_FILE).is_file():
            raise FileNotFoundError(errno.ENOENT, "missing", str(directory / CONFIG_FILE))
    except FileNotFoundError as error:
        return CellView(directory, CellState.CORRUPT, attempt, f"{error.filename}: missing, but the cell is complete")
    except StoreError as error:
        return CellView(directory, CellState.CORRUPT, attempt, str(error))
    if cell_id is not None and identity.cell_id != cell_id:
        return CellView(directory, CellState.NEW, attempt, f"holds another cell ({identity.cell_id})")
    return CellView(directory, CellState.COMPLETE, attempt)


# --- writing a cell -------------------------------------------------------------------------


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


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
        self._status: dict[str, Any] = {}
        self._log = None

    @property
    def records(self) -> pd.DataFrame:
        """Every step recorded so far, as written to the step log."""
        return records_frame(self._rows)

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
        self._log.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
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
        fails here is logged, never raised over the original error. If even the status cannot be
        written, it stays ``running`` with no live claim, which every reader treats as unfinished.
        A worker that lost its claim writes nothing.
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
            except (OSError, ClaimLost) as failure:
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
            data = (json.dumps(_json_safe(short), sort_keys=True, default=str) + "\n").encode()
            with open(path, "r+b") as handle:
                handle.write(data)
                handle.truncate()
                handle.flush()
                os.fsync(handle.fileno())


def describe_error(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
