"""ablate's launchers, on Hydra's public ``Launcher`` interface.

In ablate's app, ``hydra/launcher=local`` (and ``joblib``, its other name), ``ray`` and
``submitit_local`` select these launchers (:mod:`ablate.launchers.configs`); the work is in
:mod:`ablate.launchers`, one module per library, imported when a launch starts. Each keeps the
promises of a sweep (``docs/launchers.md``): a signal ends the running cells as interrupted, a dead
worker fails its own cell only. Their settings are those of Hydra's launchers of the same names,
which ablate's app no longer selects; joblib's own settings, other than ``n_jobs``, do not apply.
"""

from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from ablate.launchers import jobs
from ablate.launchers.configs import (  # noqa: F401 (the configs and their registration, as Hydra finds them here)
    CONFIGS, LocalLauncherConf, RayConf, RayLauncherConf, SubmititLocalLauncherConf, register_configs)


class LocalLauncher(jobs.AblateLauncher):
    """Local worker processes, each running one job at a time (:mod:`ablate.launchers.pool`)."""

    def __init__(self, n_jobs: int = -1) -> None:
        from ablate.launchers.pool import Pool, pool_size

        super().__init__()
        self.pool = Pool(pool_size(n_jobs))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return self.pool.run(self.jobs(job_overrides, initial_job_idx))


class RayLauncher(jobs.AblateLauncher):
    """Ray tasks, on an instance it starts or on a cluster (:mod:`ablate.launchers.ray_tasks`)."""

    def __init__(self, ray: DictConfig) -> None:
        super().__init__()
        self.ray = ray

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ablate.launchers.ray_tasks import run_on_ray

        settings = OmegaConf.to_container(self.ray, resolve=True)
        assert isinstance(settings, dict)
        return run_on_ray(self.jobs(job_overrides, initial_job_idx), settings.get("init") or {},
                          settings.get("remote") or {})


class SubmititLocalLauncher(jobs.AblateLauncher):
    """submitit jobs on this machine, ``n_jobs`` at a time (:mod:`ablate.launchers.submitit_jobs`)."""

    def __init__(self, submitit_folder: str, n_jobs: Optional[int] = None, **parameters: Any) -> None:
        super().__init__()
        if n_jobs is not None and n_jobs < 1:
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs}: expected a number of cells at once >= 1, or null for "
                             "one per core")
        self.folder, self.n_jobs = submitit_folder, n_jobs or jobs.cores()
        self.parameters = parameters

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ablate.launchers.submitit_jobs import run_with_submitit

        return run_with_submitit(self.jobs(job_overrides, initial_job_idx), self.folder, self.parameters, self.n_jobs)
