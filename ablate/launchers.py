"""Launching a sweep's cells so that every launcher keeps the promises of a sweep.

Hydra's launchers give up at the first problem of one job and let no cell record an interrupt:
joblib's pool SIGKILLs every worker when one dies, or when the sweep is interrupted; the Ray
launcher gets its results one by one and raises at the first dead worker, and ``ray.init``
replaces the sweep's SIGTERM handler; submitit raises at the first job that did not finish and
leaves its jobs running when the sweep stops. :func:`launch` wraps the launchers the docs list
(``docs/launchers.md``):

- Ray: the jobs are submitted with the Ray launcher's own functions and waited for together. A
  dead worker fails its cell only. On Ctrl-C or SIGTERM every task is cancelled (a
  ``KeyboardInterrupt`` in each running cell, which records it) and waited for, before a Ray
  instance the sweep started is shut down. ``object_store_memory`` is set only for an instance
  the sweep starts: Ray refuses it when connecting to a cluster.
- joblib and submitit_local: the launch runs in a thread, so a signal reaches the sweep, not the
  launcher. The sweep then tells cells that have not started not to start (a stop file, see
  :mod:`ablate.interrupts`), forwards the signal to the worker processes running its cells,
  waits for them to record it, and ends what is left of its processes. A dead joblib worker
  breaks loky's pool, which kills the other workers: the cell of the worker that died fails, and
  the cells the pool cut short or never started run in a fresh pool. A dead submitit job fails
  its cell; the sweep waits for the other jobs.
- Any other launcher is called as it is.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from ablate.interrupts import STOP_FILE_ENV, as_interrupted, check_not_stopping, request_stop, restore_handlers
from ablate.store import CLAIM_FILE, CellState, StoreError, inspect_cell, read_json
from ablate.sweep import PlannedCell, outcome

log = logging.getLogger(__name__)

#: How long a stopping sweep waits for its running cells to record the interrupt.
SETTLE_SECONDS = 60.0
#: How long a process the sweep ends with SIGTERM has before SIGKILL.
KILL_AFTER = 5.0
#: The Ray launcher's own object store size for an instance it starts (hydra-ray-launcher 1.2.2).
RAY_OBJECT_STORE_MEMORY = 78643200

_KINDS = {
    "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher": "ray",
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher": "joblib",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": "submitit_local",
}


def launcher_kind(launcher: Any) -> str:
    return _KINDS.get(f"{type(launcher).__module__}.{type(launcher).__qualname__}", "other")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_batch_size(launcher: Any, cells: int) -> int:
    """Cells handed to the launcher at once when ``hydra.sweeper.max_batch_size`` is not set.

    submitit_local starts a process for every job it is given, at once: a batch as large as the
    machine has cores keeps a large sweep from starting all its cells together.
    """
    if launcher_kind(launcher) == "submitit_local":
        return max(1, min(cells, cores()))
    return max(cells, 1)


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


def launch(launcher: Any, cells: Sequence[PlannedCell], initial_job_idx: int) -> Sequence[Any]:
    kind = launcher_kind(launcher)
    if kind == "ray":
        return _launch_ray(launcher, cells, initial_job_idx)
    if kind == "joblib":
        return _launch_joblib(launcher, cells, initial_job_idx)
    if kind == "submitit_local":
        return _launch_submitit_local(launcher, cells, initial_job_idx)
    return launcher.launch([list(cell.overrides) for cell in cells], initial_job_idx=initial_job_idx)


# --- waiting for and stopping running cells ---------------------------------------------------


def running(cells: Sequence[PlannedCell]) -> list[PlannedCell]:
    return [cell for cell in cells if outcome(cell)[0] is CellState.RUNNING]


def settle(cells: Sequence[PlannedCell], timeout: float = SETTLE_SECONDS, interval: float = 0.2) -> None:
    """Wait (at most ``timeout`` seconds) until no live worker holds one of ``cells``."""
    deadline = time.monotonic() + timeout
    while running(cells) and time.monotonic() < deadline:
        time.sleep(interval)


def _descendants() -> list[psutil.Process]:
    """The live processes this one started, directly or not.

    A zombie is not one: a job whose worker was killed leaves its controller's shell unreaped
    (submitit drops the handle when the job raises), and counting it would wait for it forever.
    Zombies that are this process's own children are reaped here.
    """
    with suppress(psutil.Error):
        live = []
        for process in psutil.Process().children(recursive=True):
            with suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    live.append(process)
                elif process.ppid() == os.getpid():
                    with suppress(ChildProcessError):
                        os.waitpid(process.pid, os.WNOHANG)
        return live
    return []


def _local_holder(cell: PlannedCell) -> int | None:
    """The pid of the process on this host that holds the cell's claim, if any."""
    try:
        holder = read_json(cell.directory / CLAIM_FILE)
    except (FileNotFoundError, StoreError):
        return None
    pid = holder.get("pid")
    return pid if isinstance(pid, int) and holder.get("host") == socket.gethostname() else None


def stop_local_cells(cells: Sequence[PlannedCell], signum: int) -> None:
    """Stop the cells this sweep's own worker processes run, and wait for them to record it.

    Unstarted cells are told not to start first, so that a worker freed by an interrupted cell
    does not take the next one. Only descendants of this process are signalled: a claim names a
    pid, and a pid of another host or another sweep is not ours to stop.
    """
    request_stop(signum)
    ours = {process.pid for process in _descendants()}
    for cell in running(cells):
        pid = _local_holder(cell)
        if pid in ours:
            with suppress(ProcessLookupError):
                os.kill(pid, signum)
    settle(cells)


def end_descendants() -> None:
    """SIGTERM every process this one started, SIGKILL those still alive after ``KILL_AFTER``."""
    processes = _descendants()
    for process in processes:
        with suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=KILL_AFTER)
    for process in alive:
        with suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=KILL_AFTER)


def _run_in_thread(run: Callable[[], Sequence[Any]], cells: Sequence[PlannedCell],
                   until_children_exit: bool) -> tuple[Sequence[Any] | None, BaseException | None]:
    """Run a launch in a thread and wait for it in the main thread, which receives the signals.

    Returns the launch's results, or the error it raised. ``until_children_exit``: the launch's
    jobs are this process's children, which may outlive a launch that raised (submitit raises at
    the first job that did not finish): wait for them too. On Ctrl-C or SIGTERM, the running
    cells are stopped (:func:`stop_local_cells`), then the launch and its processes get
    ``SETTLE_SECONDS`` to end before they are ended, and the interrupt is raised.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["returns"] = run()
        except BaseException as error:  # reported to the main thread, which decides
            box["error"] = error

    def busy() -> bool:
        return thread.is_alive() or (until_children_exit and bool(_descendants()))

    thread = threading.Thread(target=target, daemon=True, name="ablate-launch")
    thread.start()
    try:
        while busy():
            time.sleep(0.2)
    except KeyboardInterrupt as error:
        stopped = as_interrupted(error)
        stop_local_cells(cells, stopped.signum)
        deadline = time.monotonic() + SETTLE_SECONDS
        while busy() and time.monotonic() < deadline:
            time.sleep(0.2)
        if busy():
            end_descendants()
            thread.join(KILL_AFTER)
        raise stopped from None
    return box.get("returns"), box.get("error")


# --- joblib -------------------------------------------------------------------------------


class _FirstDeaths:
    """Which cells' workers died on their own when loky found its pool broken.

    loky reports "A worker unexpectedly terminated" (through ``multiprocessing.util.debug``) when
    it finds a dead worker, before it kills the others: the cells whose worker is dead at that
    moment are the ones of the worker that died; the others were cut short by the pool. The
    report is read by wrapping that function while the pool runs (a logger would be copied into
    every worker loky starts).
    """

    def __init__(self, cells: Sequence[PlannedCell]) -> None:
        self.cells = cells
        self.died: set[Path] = set()
        self._debug = multiprocessing.util.debug

    def __enter__(self) -> "_FirstDeaths":
        multiprocessing.util.debug = self._read
        return self

    def __exit__(self, *exc: object) -> None:
        multiprocessing.util.debug = self._debug

    def _read(self, message: object, *args: object) -> None:
        if str(message).startswith("A worker unexpectedly terminated"):
            self.died.update(cell.directory for cell in self.cells
                             if inspect_cell(cell.directory).state is CellState.UNFINISHED)
        self._debug(message, *args)


class StoppedCell:
    """What a joblib job returns when its cell was interrupted (and recorded so) or told not to start."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


class ReturnInterrupts:
    """A launcher's task function whose interrupt ends the job, not the pool.

    joblib aborts a ``Parallel`` call at the first job that raises, and kills every worker: a
    worker still recording its own interrupt (Ctrl-C reaches every process of the group) would be
    killed mid-write and its cell left ``running``. The cell has recorded the interrupt before it
    re-raised it, and the sweep stops itself: the job returns instead.
    """

    def __init__(self, task: Callable[..., Any]) -> None:
        self.task = task

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            check_not_stopping()  # a queued job of a stopping sweep ends at once
            return self.task(*args, **kwargs)
        except KeyboardInterrupt as error:
            return StoppedCell(as_interrupted(error).signum)


def _launch_joblib(launcher: Any, cells: Sequence[PlannedCell], initial_job_idx: int) -> Sequence[Any]:
    from joblib.externals.loky.process_executor import TerminatedWorkerError

    remaining = list(cells)
    task = launcher.task_function
    while True:
        with _FirstDeaths(remaining) as deaths:
            batch = [list(cell.overrides) for cell in remaining]
            launcher.task_function = ReturnInterrupts(task)
            try:
                returns, error = _run_in_thread(lambda: launcher.launch(batch, initial_job_idx=initial_job_idx),
                                                remaining, until_children_exit=False)
            finally:
                launcher.task_function = task
        if not isinstance(error, TerminatedWorkerError):
            if error is not None:
                raise error
            return returns or []
        # Cut short by the broken pool (their worker was alive when it broke) or never started.
        rerun = [cell for cell in remaining if cell.directory not in deaths.died
                 and (inspect_cell(cell.directory).state is CellState.UNFINISHED or outcome(cell)[0] is CellState.NEW)]
        if not deaths.died:  # loky did not say which worker died: rerun only what never started
            rerun = [cell for cell in rerun if outcome(cell)[0] is CellState.NEW]
        log.warning("a joblib worker died (%s); its cell fails, %d cells run again in a fresh pool",
                    ", ".join(sorted(path.name for path in deaths.died)) or "cell unknown", len(rerun))
        if not rerun:
            return []
        remaining = rerun


# --- submitit_local -------------------------------------------------------------------------


def _launch_submitit_local(launcher: Any, cells: Sequence[PlannedCell], initial_job_idx: int) -> Sequence[Any]:
    # The job controllers ignore SIGINT (an ignored signal stays ignored in the programs they
    # start): Ctrl-C in a terminal reaches the whole process group, and a controller would
    # print a traceback and SIGKILL its cell a second later. The sweep stops the cells itself.
    params = dict(launcher.params)
    launcher.params = {**params, "setup": ["trap '' INT", *(params.get("setup") or [])]}
    batch = [list(cell.overrides) for cell in cells]
    try:
        returns, error = _run_in_thread(lambda: launcher.launch(batch, initial_job_idx=initial_job_idx), cells,
                                        until_children_exit=True)
    finally:
        launcher.params = params
    if error is not None:
        from submitit.core.utils import UncompletedJobError

        if not isinstance(error, UncompletedJobError):
            raise error
        log.warning("a submitit job ended without a result; its cell fails (%s)", str(error).splitlines()[0])
        return []
    return returns or []


# --- Ray --------------------------------------------------------------------------------------


def _launch_ray(launcher: Any, cells: Sequence[PlannedCell], initial_job_idx: int) -> Sequence[Any]:
    import ray
    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log, setup_globals
    from hydra_plugins.hydra_ray_launcher._launcher_util import launch_job_on_ray, start_ray
    from omegaconf import open_dict

    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    init = launcher.ray_cfg.init
    if init.get("address") is None:
        init.setdefault("object_store_memory", RAY_OBJECT_STORE_MEMORY)
    started_here = not ray.is_initialized()
    start_ray(init)
    restore_handlers()
    try:
        refs = []
        for offset, cell in enumerate(cells):
            sweep_config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(cell.overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"job_id_for_{initial_job_idx + offset}"
                sweep_config.hydra.job.num = initial_job_idx + offset
            refs.append(launch_job_on_ray(launcher.hydra_context, launcher.ray_cfg.remote, sweep_config,
                                          launcher.task_function, Singleton.get_state()))
        return _wait_for_ray(refs, cells)
    finally:
        if started_here:
            ray.shutdown()


def _wait_for_ray(refs: list[Any], cells: Sequence[PlannedCell]) -> list[Any]:
    import ray
    from hydra.core.utils import JobReturn, JobStatus

    results: dict[Any, Any] = {}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayError as error:  # a dead worker: the store says the cell failed
                    log.warning("a Ray task ended without a result; its cell fails (%s)", type(error).__name__)
                    results[ref] = JobReturn(status=JobStatus.FAILED, _return_value=error)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref)  # a KeyboardInterrupt in a running cell, which records it; a queued one never starts
        settle(cells)
        raise
    return [results[ref] for ref in refs]
