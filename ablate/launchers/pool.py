"""``hydra/launcher=local`` (and ``joblib``): local worker processes, each known by the job it holds.

joblib's pool (loky) breaks as a whole when one of its workers dies: it kills the other workers
and names the dead one only in a debug message. Here each worker is a process of its own
(multiprocessing's ``spawn``), sent one job at a time over a pipe of its own, so:

- a worker that dies fails the job it held, and that job only: the other workers go on, and a
  fresh worker takes the next job;
- on Ctrl-C, SIGTERM or SIGHUP the pool hands out no more jobs and asks the running ones to stop
  through the sweep's stop file (a signal sent to the sweep alone reaches no worker); each records
  its cell as interrupted and returns, and the pool waits for them (``SETTLE_SECONDS``) before it
  ends its workers and raises the interrupt.

Workers outlive a launch: the next batch of the sweep (an Optuna study launches one batch per
``n_jobs`` trials) reuses them, as joblib reuses its pool. They end with the sweep's process.

A worker ignores SIGINT and SIGHUP (a Ctrl-C, a closed terminal) but in a cell, whose handlers
record them: the pool ends its workers itself, and a worker that died of a Ctrl-C between the end
of its job and its reply would lose the reply. It starts with them blocked until it ignores them,
so one that comes while it starts leaves no traceback; the pool defers a signal of its own while
it starts a worker (:func:`ablate.interrupts.deferred`). Jobs and results travel
pickled with cloudpickle, as with joblib, Ray and submitit: a Hydra app's task function cannot be
pickled by its name.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from hydra.core.utils import JobReturn, JobStatus

from ablate.interrupts import HANDLED, as_interrupted, deferred, request_stop
from ablate.launchers.jobs import HydraJob, cores, lost

log = logging.getLogger(__name__)


def pool_size(n_jobs: int) -> int:
    """Workers for ``n_jobs`` as joblib reads it: a count, or -1 for every core, -2 for all but one, ..."""
    if n_jobs == 0:
        raise ValueError(f"hydra.launcher.n_jobs={n_jobs!r}: expected a number of workers (or -1 for every core)")
    return n_jobs if n_jobs > 0 else max(1, cores() + 1 + n_jobs)


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection
    job: int | None = None  # the index of the job it runs


class Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.ends_at_exit = False

    def run(self, jobs: Sequence[HydraJob]) -> list[JobReturn]:
        """Run ``jobs`` on at most ``size`` workers; their returns, in order."""
        results: dict[int, JobReturn] = {}
        queue = deque(range(len(jobs)))
        try:
            while queue or self._busy():
                self._hand_out(queue, jobs)
                self._collect(jobs, results, timeout=1.0)
        except KeyboardInterrupt as error:
            from ablate.launchers.stopping import SETTLE_SECONDS

            stopped = as_interrupted(error)
            request_stop(stopped.signum)
            deadline = time.monotonic() + SETTLE_SECONDS
            while self._busy() and time.monotonic() < deadline:
                self._collect(jobs, results, timeout=max(0.0, deadline - time.monotonic()))
            self.close()
            raise stopped from None
        except BaseException:
            self.close()
            raise
        return [results[index] for index in range(len(jobs))]

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self.workers if worker.job is not None]

    def _hand_out(self, queue: deque[int], jobs: Sequence[HydraJob]) -> None:
        import cloudpickle

        for worker in [w for w in self.workers if w.job is None and not w.process.is_alive()]:
            self._drop(worker)  # it was ended between jobs (killed): it held no job
        while queue:
            idle = [w for w in self.workers if w.job is None]
            if not idle and len(self.workers) >= self.size:
                return
            worker = idle[0] if idle else self._start()
            try:
                worker.connection.send_bytes(cloudpickle.dumps(jobs[queue[0]]))
            except OSError:  # it ended before it got the job: the next worker takes it
                self._drop(worker)
                continue
            worker.job = queue.popleft()

    def _start(self) -> _Worker:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=serve, args=(theirs,), name="ablate-worker")
        with deferred():
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)  # the worker starts with this mask
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            worker = _Worker(process, ours)
            self.workers.append(worker)
            theirs.close()
        if not self.ends_at_exit:  # before multiprocessing's own exit handler, which would wait for idle workers
            atexit.register(self.close)
            self.ends_at_exit = True
        return worker

    def _collect(self, jobs: Sequence[HydraJob], results: dict[int, JobReturn], timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for a busy worker to return or end; take what came."""
        busy = self._busy()
        if not busy:
            return
        wait([w.connection for w in busy] + [w.process.sentinel for w in busy], timeout)
        for worker in busy:
            assert worker.job is not None
            if worker.connection.poll():
                try:
                    results[worker.job] = pickle.loads(worker.connection.recv_bytes())
                    worker.job = None
                    continue
                except (EOFError, OSError):
                    pass  # it ended before its reply was whole
            if not worker.process.is_alive():
                why = f"its worker (pid {worker.process.pid}) ended with {_exit_text(worker.process.exitcode)}"
                log.warning("job #%d: %s; its cell fails, the other workers go on", jobs[worker.job].num, why)
                results[worker.job] = lost(jobs[worker.job], why)
                self._drop(worker)

    def _drop(self, worker: _Worker) -> None:
        worker.connection.close()
        worker.process.join(0)
        self.workers.remove(worker)

    def close(self) -> None:
        """End the workers: an idle one is told to stop; one still on its job (past the settling time)
        is ended, with every process it started."""
        from ablate.launchers.stopping import KILL_AFTER, end_processes, process_tree

        for worker in self.workers:
            if worker.job is None:
                try:
                    worker.connection.send_bytes(b"")
                except OSError:
                    pass  # it has ended already
        end_processes([process for worker in self._busy() for process in process_tree(worker.process.pid)])
        deadline = time.monotonic() + KILL_AFTER
        for worker in self.workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.connection.close()
        self.workers.clear()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"exit status {code}"


def serve(connection: Connection) -> None:
    """A worker: run the jobs the pool sends, one at a time, until it sends an empty message."""
    import cloudpickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
    try:
        while True:
            message = connection.recv_bytes()
            if not message:
                return
            job = pickle.loads(message)
            returned = job()
            try:
                reply = cloudpickle.dumps(returned)
            except Exception as error:  # the task returned what cannot travel back
                reply = cloudpickle.dumps(JobReturn(overrides=job.overrides, status=JobStatus.FAILED,
                                                    _return_value=RuntimeError(f"its return cannot be pickled: {error}")))
            connection.send_bytes(reply)
    except (EOFError, OSError):
        return  # the sweep is gone
