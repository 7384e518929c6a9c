"""One Optuna study driven through Hydra's launcher with ask-and-tell.

Each trial is an ordinary job of the app with the suggested values plus ``trial=<number>`` as
overrides, so a trial is a cell like any other: same run store, same W&B group.

Resuming: the study lives in persistent storage and is loaded if it exists (:mod:`._study`).
``n_trials`` is the size the study should reach, whoever runs it: trials of earlier runs count,
and so do those another sweeper of the same study asks for at the same time (:mod:`._drivers`).
A trial left RUNNING by a driver that died is relaunched under its own number with its own
parameters: the cell is read back from the run store if it completed before the crash, and rerun
otherwise, so no trial is lost or duplicated; a trial another live sweeper drives is left to it.

The work is split by concern: :mod:`._study` (storage, resume, sampler), :mod:`._trials` (the
loop of ask, launch and tell), :mod:`._batch` (the launch of one batch) and :mod:`._report`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from hydra.core.plugins import Plugins
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from optuna.trial import TrialState

from ablate.overrides import quoted_override
from ablate.store import store_root

from ._batch import BatchLauncher
from ._drivers import abandoned
from ._report import FINISHED, describe_space, report
from ._search_space import parse_search_space
from ._study import StudyStorage, directions_of, metric_names_for, open_study
from ._trials import TRIAL_KEY, StudyFailed, TrialLoop
from .config import SamplerConf

__all__ = ["OptunaStudySweep", "StudyFailed"]

log = logging.getLogger(__name__)


class OptunaStudySweep:
    def __init__(self, sampler: SamplerConf, direction: Any, n_trials: int, n_jobs: int, max_failure_rate: float,
                 study_name: Optional[str], storage: Optional[str], params: Optional[DictConfig],
                 metric_names: Optional[list[str]], export_dir: Optional[str]) -> None:
        self.sampler = sampler
        self.directions = directions_of(direction)
        if n_trials < 0:
            raise ValueError(f"hydra.sweeper.n_trials={n_trials}: expected a number of trials >= 0")
        if n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_jobs={n_jobs}: expected at least 1 trial per batch")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"hydra.sweeper.max_failure_rate={max_failure_rate}: expected a fraction in [0, 1]")
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.study_name = study_name
        self.storage = StudyStorage(storage)
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.metric_names = list(metric_names) if metric_names is not None else None
        self.export_dir = export_dir
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        from ablate.launchers.stopping import stop_file
        from ablate.sweep import make_sweep_directory
        from hydra_plugins.ablate_grid_sweeper.grid_sweeper import JobComposer

        assert self.config is not None and self.hydra_context is not None
        space = parse_search_space([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        if any(o.split("=", 1)[0].lstrip("+~") == TRIAL_KEY for o in space.fixed) or TRIAL_KEY in space.distributions:
            raise ValueError(f"{TRIAL_KEY}=...: the sweeper sets the trial number of every trial; do not override it")
        study = open_study(self.study_name, self.storage, self.directions, self.sampler,
                           metric_names_for(self.metric_names, self.config.get("objective")))
        previous = study.get_trials(deepcopy=False)
        running = [t for t in previous if t.state == TrialState.RUNNING]
        interrupted = [t for t in running if abandoned(t)]
        finished = sum(t.state in FINISHED for t in previous)
        to_ask = max(0, self.n_trials - len(previous))
        others = len(running) - len(interrupted)
        elsewhere = f"{others} running in another sweeper, " if others else ""
        log.info(
            "Study %r in %s: %d trials finished, %d interrupted (relaunched), %s%d to ask for (n_trials=%d). "
            "Search space:\n%s",
            study.study_name, self.storage, finished, len(interrupted), elsewhere, to_ask, self.n_trials,
            describe_space(space.distributions),
        )
        # Every worker writes to the same store, wherever its working directory is (Ray, SLURM).
        # Quoted: Hydra parses it again, and a path may hold any character ("p (copy)", "é", ",").
        store = quoted_override("store_dir", str(store_root(str(self.config.store_dir))))
        compose = JobComposer(self.config, self.hydra_context.config_loader)
        loop = TrialLoop(study, self.directions, self.n_trials, self.n_jobs, self.max_failure_rate,
                         BatchLauncher(self.launcher, compose), self.storage.journal)
        with stop_file(make_sweep_directory(self.config)):  # named for every worker: a stopping study's queued trials do not start
            loop.run(space, interrupted, to_ask, store)
        export_dir = store_root(self.export_dir) if self.export_dir is not None else None
        report(study, self.directions, export_dir, self.storage.journal)
