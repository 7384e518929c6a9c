"""What a sweep does around any launcher: name its stop file, wait for the cells still held, end processes.

The run store, not the launcher, says what became of a cell: :func:`settle` waits (at most
``SETTLE_SECONDS``) until no live worker holds one of the sweep's cells, so that the tally never
calls a running cell "not run". :func:`stop_file` names the file through which a stopping sweep
tells its worker processes (:mod:`ablate.interrupts`). :func:`end_processes` ends what a launcher
started and could not stop otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

from ablate.interrupts import STOP_FILE_ENV
from ablate.store import CellState
from ablate.sweep import PlannedCell, outcome

#: How long a stopping sweep waits for its running cells to record the interrupt.
SETTLE_SECONDS = 60.0
#: How long a process the sweep ends with SIGTERM has before SIGKILL.
KILL_AFTER = 5.0


@contextmanager
def stop_file(sweep_dir: Path) -> Iterator[None]:
    """Name this sweep's stop file for every worker process it starts (they inherit the variable)."""
    path = sweep_dir / f".stopping-{os.getpid()}"
    previous = os.environ.get(STOP_FILE_ENV)
    os.environ[STOP_FILE_ENV] = str(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        if previous is None:
            os.environ.pop(STOP_FILE_ENV, None)
        else:
            os.environ[STOP_FILE_ENV] = previous


def running(cells: Sequence[PlannedCell]) -> list[PlannedCell]:
    return [cell for cell in cells if outcome(cell)[0] is CellState.RUNNING]


def settle(cells: Sequence[PlannedCell], timeout: float = SETTLE_SECONDS, interval: float = 0.2) -> None:
    """Wait (at most ``timeout`` seconds) until no live worker holds one of ``cells``."""
    deadline = time.monotonic() + timeout
    while running(cells) and time.monotonic() < deadline:
        time.sleep(interval)


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """The live processes ``pid`` (this process by default) started, directly or not.

    A zombie is not one: a job whose worker was killed leaves its controller's shell unreaped
    (submitit drops the handle when the job raises), and counting it would wait for it forever.
    Zombies that are this process's own children are reaped here.
    """
    with suppress(psutil.Error):
        live = []
        for process in psutil.Process(pid).children(recursive=True):
            with suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    live.append(process)
                elif process.ppid() == os.getpid():
                    with suppress(ChildProcessError):
                        os.waitpid(process.pid, os.WNOHANG)
        return live
    return []


def process_tree(pid: int | None) -> list[psutil.Process]:
    """The process ``pid`` and the live processes it started (none if it has ended)."""
    try:
        return [psutil.Process(pid), *descendants(pid)] if pid is not None else []
    except psutil.Error:
        return []


def end_processes(processes: Sequence[psutil.Process]) -> None:
    """SIGTERM ``processes``, then SIGKILL those still alive after ``KILL_AFTER``."""
    for process in processes:
        with suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=KILL_AFTER)
    for process in alive:
        with suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=KILL_AFTER)
