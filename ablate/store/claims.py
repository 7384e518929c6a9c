"""Claims: the one worker that may write a cell, and the fence that stops a worker that lost it.

A worker holds a cell through ``claim.json``, which names its host, pid and process start time
and is kept visibly alive by a heartbeat thread. A claim whose holder is dead (checked directly on
the same host, by heartbeat elsewhere) is stale and may be taken over; every write that marks a
cell is fenced by :meth:`Claim.check`, so a worker paused past the stale limit and resumed cannot
overwrite the cell another worker took over.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from filelock import FileLock

from ablate.store.files import StoreError, make_directory, read_json, remove_dead_writers_files
from ablate.store.layout import CLAIM_FILE, now

log = logging.getLogger(__name__)

#: A claim whose heartbeat is older than this is stale when its holder cannot be checked directly
#: (another host, or a claim written without the holder's process start time).
STALE_AFTER = 120.0
#: How often a holder refreshes its claim's heartbeat (a thread, so long steps do not matter).
HEARTBEAT_EVERY = 20.0


class CellBusy(RuntimeError):
    """Another live worker holds the cell's claim."""


class ClaimLost(RuntimeError):
    """This worker no longer holds the claim of the cell it runs: another worker took the cell over.

    It happens to a worker paused or stalled longer than the stale limit (a SLURM suspend, a VM
    pause, an NFS stall): its claim looked dead and was taken. The worker must write nothing more
    to the cell, whose files are now the other worker's.
    """


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


@contextmanager
def held(cell_dir: Path) -> Iterator[Claim]:
    make_directory(cell_dir, "the cell's directory")
    taken = claim(cell_dir)
    try:
        yield taken
    finally:
        taken.release()
