"""Ctrl-C, SIGTERM and SIGHUP as one exception, so a cell can record itself as interrupted.

SIGTERM is what SLURM, ``timeout`` and process managers send, SIGHUP what a closed terminal or a
dropped ssh session sends; by default each kills Python without running any ``finally``, which
would leave a cell recorded as running. While :func:`signals_interrupt` is active, SIGINT,
SIGTERM and SIGHUP raise :class:`Interrupted`, a
``KeyboardInterrupt`` (so code that already handles Ctrl-C handles SIGTERM the same way, and
Hydra's launchers let it through instead of recording one failed job and moving on). A second
signal while the first is being handled is ignored, so the cleanup is not cut short.

A sweep that is stopping also tells the jobs it launched in other processes, which its signal
may not reach (SIGTERM or SIGHUP sent to the sweep alone): :func:`request_stop` writes a file named
by an environment variable that every worker process inherits. There, :func:`check_not_stopping`
keeps a cell from starting, and :func:`stop_when_requested` interrupts a running one as the
sweep's signal would.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The file whose existence tells a sweep's worker processes that the sweep is stopping.
STOP_FILE_ENV = "ABLATE_SWEEP_STOP_FILE"


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal; ``exit_status`` is the shell's convention, 128 + the signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def as_interrupted(error: KeyboardInterrupt) -> Interrupted:
    """A ``KeyboardInterrupt`` as an :class:`Interrupted`, with the signal that caused it.

    A plain ``KeyboardInterrupt`` is Python's own Ctrl-C (raised before a handler was installed),
    or one a library raised in place of ours (Ray's ``ray.wait`` turns any exception of a signal
    handler into a ``KeyboardInterrupt``): the signal the handler received, if any, says which.
    """
    return error if isinstance(error, Interrupted) else Interrupted(_state["received"] or signal.SIGINT)


def from_signal(error: KeyboardInterrupt) -> bool:
    """Whether ``error`` stands for a signal (or a stop of the sweep), not for code that raised it.

    A plugin may ``raise KeyboardInterrupt`` itself: that is a failure of its cell, not a Ctrl-C.
    A signal reaches a cell as :class:`Interrupted` (our handler) or, through a library that
    replaces it, as a plain ``KeyboardInterrupt`` after our handler noted the signal.
    """
    return isinstance(error, Interrupted) or bool(_state["received"])


_state = {"depth": 0, "stopping": False, "received": 0, "deferred": 0, "pending": 0}


def _raise(signum: int, frame: FrameType | None) -> None:
    if _state["stopping"]:  # the first signal wins; the cleanup it started must not be cut short
        return
    if _state["deferred"]:
        _state["pending"] = _state["pending"] or signum
        return
    _state["stopping"] = True
    _state["received"] = signum
    raise Interrupted(signum)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`; the old handlers come back after.

    Only the main thread can install handlers: elsewhere (a thread pool of a launcher) this does
    nothing, and the process's own handling applies.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in HANDLED}
    for signum in HANDLED:
        signal.signal(signum, _raise)
    if _state["depth"] == 0:
        _state["received"] = 0
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:  # blocks nest (a sweep, then each of its cells): the outermost resets
            _state["stopping"] = False
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def restore_handlers() -> None:
    """Put ablate's handlers back inside an active block, after a library replaced them.

    ``ray.init`` installs its own SIGTERM handler (it exits the process at once); a sweep that
    starts Ray inside its launch calls this afterwards, so that SIGTERM still stops it cleanly.
    """
    if _state["depth"] and threading.current_thread() is threading.main_thread():
        for signum in HANDLED:
            signal.signal(signum, _raise)


@contextmanager
def deferred() -> Iterator[None]:
    """Within the block, a signal that would raise :class:`Interrupted` waits for the block's end.

    For work that a signal must not cut in two: a worker process half started would print a
    traceback of its own and be left to no one.
    """
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
        pending, _state["pending"] = _state["pending"], 0
        if pending and not _state["deferred"]:
            _raise(pending, None)


def request_stop(signum: int) -> None:
    """Tell this sweep's worker processes (see :data:`STOP_FILE_ENV`) not to start another cell."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        with open(path, "w") as handle:
            handle.write(str(int(signum)))


def requested_stop() -> int | None:
    """The signal of the sweep that launched this process if it is stopping, else None."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return None
    try:
        with open(path) as handle:
            recorded = handle.read().strip()
    except FileNotFoundError:
        return None
    return int(recorded) if recorded.isdigit() else signal.SIGTERM


def check_not_stopping() -> None:
    """Raise :class:`Interrupted` with the sweep's signal if the sweep that launched this cell stops."""
    signum = requested_stop()
    if signum is not None:
        raise Interrupted(signum)


@contextmanager
def stop_when_requested(interval: float = 0.2) -> Iterator[None]:
    """Within the block, a stop of the sweep (:func:`request_stop`) interrupts this process as the
    sweep's signal would, unless a signal reached the process first.

    A thread polls the stop file every ``interval`` seconds and sends the sweep's signal to the
    main thread (which a blocking call there gives up for), while the main thread handles that
    signal in Python: a signal left to its default action (SIGTERM would kill the process) or
    ignored waits until a cell installs its handlers. ablate's handler takes the signal once;
    another handler (Python's own for SIGINT) gets it once. Only from the main thread.
    """
    if not os.environ.get(STOP_FILE_ENV) or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    assert main is not None
    done = threading.Event()
    lock = threading.Lock()  # once the block has ended, no signal is sent into the code after it

    def watch() -> None:
        sent = False
        while not done.wait(interval):
            signum = requested_stop()
            with lock:
                if signum is None or _state["received"] or done.is_set():
                    continue
                handler = signal.getsignal(signum)
                if handler is _raise or (callable(handler) and not sent):
                    signal.pthread_kill(main, signum)
                    sent = True

    thread = threading.Thread(target=watch, daemon=True, name="ablate-stop-watch")
    thread.start()
    try:
        yield
    finally:
        with lock:
            done.set()
        thread.join()
