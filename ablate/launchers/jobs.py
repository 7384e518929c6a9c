"""One job of a launch, and the base of ablate's launchers, on Hydra's public launcher API.

A Hydra launcher runs each job with the recipe of Hydra's own launcher plugins (``hydra.core``:
``setup_globals``, the ``Singleton`` state, ``load_sweep_config``, ``HydraConfig``, ``run_job``).
:class:`HydraJob` is that recipe as a picklable object, so the same job runs in a pool worker, a
Ray task or a submitit job. It adds what a sweep's promises need (``docs/launchers.md``):

- a cell whose worker is interrupted, or that is told not to start because the sweep stops, ends
  the job with a :class:`StoppedCell`, not an exception: the sweep reads the cell's fate from the
  run store, and a pool must not treat one stopped job as the failure of all of them;
- while it runs, a stop of the sweep reaches the job through the sweep's stop file
  (:func:`ablate.interrupts.stop_when_requested`), where the sweep's signal does not.

A job that ended without returning (its worker died) is reported as :func:`lost`.

This module is imported when Hydra scans its plugins (``hydra_plugins/ablate_launchers``): it
imports nothing beyond Hydra at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

#: The launcher's line per job ("#3 : policy=fisher ..."): the app's Hydra logging sends it to the sweep's launches.log.
launches = logging.getLogger("ablate.launchers.jobs")


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class StoppedCell:
    """What a job returns when its cell was interrupted (and recorded so) or told not to start."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


class WorkerLost(RuntimeError):
    """The process running a job ended before it returned: killed, or crashed."""


@dataclass
class HydraJob:
    hydra_context: HydraContext
    config: DictConfig
    task_function: TaskFunction
    singleton_state: dict[Any, Any]
    overrides: list[str]
    num: int
    job_id: str

    def __call__(self) -> JobReturn:
        from ablate.interrupts import as_interrupted, check_not_stopping, stop_when_requested

        try:
            with stop_when_requested():
                check_not_stopping()  # a queued job of a stopping sweep ends at once
                setup_globals()
                Singleton.set_state(self.singleton_state)
                # set_state scans Hydra's plugins again, and Hydra's launcher plugins store their configs
                # under the names ablate's launchers took (submitit_local's has no n_jobs): take them back.
                from ablate.launchers.configs import register_configs

                register_configs()
                sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(self.overrides))
                with open_dict(sweep_config):
                    sweep_config.hydra.job.id = self.job_id
                    sweep_config.hydra.job.num = self.num
                HydraConfig.instance().set_config(sweep_config)
                return run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                               job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        except KeyboardInterrupt as error:
            return JobReturn(overrides=list(self.overrides), status=JobStatus.COMPLETED,
                             _return_value=StoppedCell(as_interrupted(error).signum))


def lost(job: HydraJob, why: str) -> JobReturn:
    """The return of a job whose process ended without a result (the run store says what became of its cell)."""
    return JobReturn(overrides=list(job.overrides), status=JobStatus.FAILED, _return_value=WorkerLost(why))


def without_result(returned: JobReturn | None) -> bool:
    """Whether a job ended without its cell's result (stopped, or its worker lost): the run store has it."""
    if returned is None:
        return True
    if returned.status is JobStatus.FAILED:
        try:
            returned.return_value
        except WorkerLost:
            return True
        except Exception:
            return False
    return isinstance(returned.return_value, StoppedCell)


class AblateLauncher(Launcher):
    """A Hydra launcher that keeps a sweep's promises; subclasses run the jobs :meth:`jobs` makes."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def jobs(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[HydraJob]:
        """The launch's jobs, as Hydra's launchers prepare them: logging set up, the sweep folder made."""
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        launches.info("%s is launching %d jobs, sweep output dir: %s", type(self).__name__, len(job_overrides), sweep_dir)
        state = Singleton.get_state()
        jobs = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            launches.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
            jobs.append(HydraJob(self.hydra_context, self.config, self.task_function, state, list(overrides), num,
                                 f"{self.config.hydra.job.name}_{num}"))
        return jobs
