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
        """Run the study; Ctrl-C, SIGTERM or SIGHUP ends it with one line and the conventional exit
        status, and so does a study whose trials failed past ``max_failure_rate`` (exit status 1).

        The trial that was running is recorded as interrupted in the run store and stays RUNNING
        in the study, so the next run of the same command relaunches it under its number.
        """
        import sys

        from ablate.interrupts import as_interrupted, signals_interrupt

        from ._impl import StudyFailed
        from ._journal import JournalDamaged

        try:
            with signals_interrupt():
                self.impl.sweep(arguments)
        except JournalDamaged as error:
            print(f"ablate: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except StudyFailed as error:  # the failed trials are in the study and the run store: one line says why
            print(f"ablate: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except KeyboardInterrupt as error:
            stopped = as_interrupted(error)
            print(f"ablate: study interrupted by {stopped.signal_name}; run the same command again to resume it "
                  "(the interrupted trial is relaunched under its number)", file=sys.stderr, flush=True)
            raise SystemExit(stopped.exit_status) from None
