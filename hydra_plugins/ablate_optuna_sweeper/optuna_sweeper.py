"""The plugin class Hydra discovers. It only holds the config: the work is in ``_impl.py``."""

from typing import Any, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from .config import SamplerConf


class AblateOptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: SamplerConf,
        direction: Any,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        study_name: Optional[str],
        storage: Optional[str],
        params: Optional[DictConfig],
        metric_names: Optional[list[str]],
        export_dir: Optional[str],
    ) -> None:
        from ._impl import OptunaStudySweep

        self.impl = OptunaStudySweep(
            sampler=sampler, direction=direction, n_trials=n_trials, n_jobs=n_jobs,
            max_failure_rate=max_failure_rate, study_name=study_name, storage=storage, params=params,
            metric_names=metric_names, export_dir=export_dir,
        )

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.impl.sweep(arguments)
