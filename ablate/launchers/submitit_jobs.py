"""``hydra/launcher=submitit_local``: the jobs as submitit jobs on this machine, through submitit's public API.

submitit starts a process (a job controller, which starts the job's own process) for every job
it is given, at once: at most ``n_jobs`` jobs run at a time here (the machine's cores unless set),
the next starting as one ends. Each job's result is read with ``job.results()``: a job that ends
without one (its process was killed) fails its own cell, and the others run to the end.

The controllers run behind submitit's ``setup`` commands, which make them ignore SIGINT (an
ignored signal stays ignored in the programs they start, and a cell sets its own handler): a
Ctrl-C in a terminal reaches the whole process group, and a controller would print a traceback
and SIGKILL its job a second later. On Ctrl-C, SIGTERM or SIGHUP the launch tells the running jobs
to stop through the sweep's stop file, waits for them (``SETTLE_SECONDS``), and ends what is left
of the processes it started.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn

from ablate.interrupts import as_interrupted, request_stop
from ablate.launchers.jobs import HydraJob, lost

log = logging.getLogger(__name__)

#: Run by the shell that starts each job controller (submitit's ``setup`` parameter).
IGNORE_SIGINT = "trap '' INT"
#: Seconds between looks at the running jobs.
POLL = 0.2


def run_submitted(job: HydraJob) -> JobReturn:
    """The submitted function: one job, under the id submitit gave it."""
    import submitit

    job.job_id = str(submitit.JobEnvironment().job_id)
    return job()


def run_with_submitit(jobs: Sequence[HydraJob], folder: str, parameters: dict[str, Any], n_jobs: int) -> list[JobReturn]:
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster="local")
    executor.update_parameters(**parameters, local_setup=[IGNORE_SIGINT])
    results: dict[int, JobReturn] = {}
    queue = list(range(len(jobs)))
    running: dict[int, Any] = {}
    try:
        while queue or running:
            while queue and len(running) < n_jobs:
                index = queue.pop(0)
                running[index] = executor.submit(run_submitted, jobs[index])
            time.sleep(POLL)
            for index, submitted in [(i, s) for i, s in running.items() if s.done()]:
                results[index] = _result(submitted, jobs[index])
                del running[index]
    except KeyboardInterrupt as error:
        stopped = as_interrupted(error)
        _stop(running, stopped.signum)
        raise stopped from None
    return [results[index] for index in range(len(jobs))]


def _result(submitted: Any, job: HydraJob) -> JobReturn:
    try:
        return submitted.results()[0]
    except Exception as error:  # submitit's UncompletedJobError: the job's process ended without a result
        why = f"its submitit job ended without a result ({str(error).splitlines()[0]})"
        log.warning("job #%d: %s; its cell fails", job.num, why)
        return lost(job, why)


def _stop(running: dict[int, Any], signum: int) -> None:
    """Tell the running jobs to stop, wait for them to record it, and end what is left."""
    from ablate.launchers.stopping import SETTLE_SECONDS, descendants, end_processes

    request_stop(signum)
    deadline = time.monotonic() + SETTLE_SECONDS
    while any(not submitted.done() for submitted in running.values()) and time.monotonic() < deadline:
        time.sleep(POLL)
    end_processes(descendants())
