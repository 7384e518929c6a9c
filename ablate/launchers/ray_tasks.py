"""``hydra/launcher=ray``: the jobs as Ray tasks, through Ray's public API alone.

Each job is a task (``ray.remote`` with the ``ray.remote`` options of the config), and the tasks
are waited for together (``ray.wait``), so a task that ends without a result (its worker died and
Ray's ``max_retries`` are spent) fails its own cell, and the others run to the end. On Ctrl-C,
SIGTERM or SIGHUP every task is cancelled (``ray.cancel``: a ``KeyboardInterrupt`` in a running
cell, which records it and returns; a queued one never starts) and waited for, at most
``SETTLE_SECONDS``, before a Ray instance the launch started is shut down.

``ray.init`` replaces the sweep's SIGTERM handler with one that exits at once (Ray 2.x): the
sweep puts its own back after it (:func:`ablate.interrupts.restore_handlers`). The object store
of an instance the launch starts is 75 MiB, as Hydra's Ray launcher sets it (a cell sends Ray its
config and gets back a number); connecting to a cluster, Ray refuses the setting, so it is not made.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn

from ablate.interrupts import as_interrupted, restore_handlers
from ablate.launchers.jobs import HydraJob, launches, lost

log = logging.getLogger(__name__)

#: The object store of a Ray instance the launch starts (Hydra's Ray launcher's figure).
OBJECT_STORE_MEMORY = 75 * 2**20


def run_job(job: HydraJob) -> JobReturn:
    """The Ray task: one job."""
    return job()


def run_on_ray(jobs: Sequence[HydraJob], init: dict[str, Any], remote: dict[str, Any]) -> list[JobReturn]:
    import ray

    init = dict(init)
    if init.get("address") is None:
        init.setdefault("object_store_memory", OBJECT_STORE_MEMORY)
    started_here = not ray.is_initialized()
    if started_here:
        launches.info("ray.init(%s)", ", ".join(f"{key}={value!r}" for key, value in init.items()))
        ray.init(**init)
    restore_handlers()
    try:
        task = ray.remote(**remote)(run_job) if remote else ray.remote(run_job)
        return _gather([task.remote(job) for job in jobs], jobs)
    finally:
        if started_here:
            ray.shutdown()


def _gather(refs: list[Any], jobs: Sequence[HydraJob]) -> list[JobReturn]:
    import ray

    from ablate.launchers.stopping import SETTLE_SECONDS

    results: dict[Any, JobReturn] = {}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                results[ref] = _result(ref, jobs[refs.index(ref)])
    except KeyboardInterrupt as error:
        stopped = as_interrupted(error)
        for ref in pending:
            ray.cancel(ref)
        if pending:  # each running cell records its interrupt, then its task returns
            ray.wait(pending, num_returns=len(pending), timeout=SETTLE_SECONDS)
        raise stopped from None
    return [results[ref] for ref in refs]


def _result(ref: Any, job: HydraJob) -> JobReturn:
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:  # its worker died, and Ray's retries are spent
        log.warning("job #%d: its Ray task ended without a result (%s); its cell fails", job.num, type(error).__name__)
        return lost(job, f"its Ray task ended without a result: {type(error).__name__}")
