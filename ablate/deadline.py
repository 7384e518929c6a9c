"""A cell's time limit (``cell_timeout``): past it, the cell's own code is stopped by an exception.

A policy that never returns would otherwise hold its sweep forever. The limit is an interval
timer of the process (``SIGALRM``), whose handler raises in the main thread wherever the cell is:
in a policy's Python loop (between two bytecodes), in a sleep or a wait that the signal
interrupts (verl's metrics file), or right after a long torch operation returns. Every launcher
runs a cell in its process's main thread (in process, the local pool's workers, Ray's workers,
submitit's jobs), the one thread where a signal handler runs.

The handler raises a ``BaseException`` (:class:`_Expired`), as a signal's ``KeyboardInterrupt``
is one: library code that catches ``Exception`` (torch's operator lookup does, and raises an
``AttributeError`` of its own instead) cannot swallow it. Leaving the block turns it into
:class:`CellTimeout`, an ``Exception``, which fails the one cell under every launcher.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class CellTimeout(RuntimeError):
    """A cell that ran past its ``cell_timeout``; the runner records it ``failed`` with its steps."""


class _Expired(BaseException):
    """The time limit, on its way out of the cell's code (see the module doc)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Within the block, :class:`CellTimeout` ends it once ``seconds`` have passed (None: no limit)."""
    if seconds is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise CellTimeout(f"cell_timeout={seconds:g} needs the cell to run in its process's main thread, the only "
                          "one a timer's signal reaches")

    def expire(signum: int, frame: FrameType | None) -> None:
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)  # the config holds it finite and > 0
    try:
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)  # skipped only where the timer has fired already
    except _Expired:
        raise CellTimeout(f"timeout: the cell ran past cell_timeout={seconds:g} s; the steps it logged are "
                          "kept") from None
    finally:
        signal.signal(signal.SIGALRM, previous)
