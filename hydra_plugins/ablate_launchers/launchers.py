"""ablate's launchers, on Hydra's public ``Launcher`` interface, and the configs that select them.

In ablate's app, ``hydra/launcher=local`` (and ``joblib``, its other name), ``ray`` and
``submitit_local`` select these launchers (:func:`register_configs`); the work is in
:mod:`ablate.launchers`, one module per library, imported when a launch starts. Each keeps the
promises of a sweep (``docs/launchers.md``): a signal ends the running cells as interrupted, a dead
worker fails its own cell only. Their settings are those of Hydra's launchers of the same names,
which ablate's app no longer selects; joblib's own settings, other than ``n_jobs``, do not apply.

No ``from __future__ import annotations``: OmegaConf reads the configs' annotations as types.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from ablate.launchers import jobs

_HERE = "hydra_plugins.ablate_launchers.launchers"


@dataclass
class LocalLauncherConf:
    _target_: str = f"{_HERE}.LocalLauncher"
    #: Worker processes: a number, or -1 for one per core (-2: all but one, ...), as joblib reads it.
    n_jobs: int = -1


@dataclass
class RayConf:
    #: ``ray.init``'s arguments: ``address: null`` starts a local instance, ``auto`` or ``host:port`` joins a cluster.
    init: Dict[str, Any] = field(default_factory=lambda: {"address": None})
    #: Each cell's task options (``ray.remote``): ``num_cpus``, ``max_retries``, ...
    remote: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RayLauncherConf:
    _target_: str = f"{_HERE}.RayLauncher"
    ray: RayConf = field(default_factory=RayConf)


@dataclass
class SubmititLocalLauncherConf:
    _target_: str = f"{_HERE}.SubmititLocalLauncher"
    #: Cells running at once (null: one per core); submitit itself starts every job it is given at once.
    n_jobs: Optional[int] = None
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    #: A job's time limit, in minutes.
    timeout_min: int = 60
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    tasks_per_node: int = 1
    mem_gb: Optional[int] = None
    nodes: int = 1
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False


#: The ``hydra/launcher`` options ablate's app selects: its own launchers under Hydra's names.
CONFIGS = {"local": LocalLauncherConf, "joblib": LocalLauncherConf, "ray": RayLauncherConf,
           "submitit_local": SubmititLocalLauncherConf}


def register_configs() -> None:
    """Make ``hydra/launcher=<name>`` select ablate's launchers (:data:`CONFIGS`).

    Called once Hydra has scanned its plugins (from ablate's search-path plugin), so these
    entries replace those that Hydra's own joblib, Ray and submitit plugins registered under the
    same names, whichever of them is installed.
    """
    for name, node in CONFIGS.items():
        ConfigStore.instance().store(group="hydra/launcher", name=name, node=node, provider="ablate")


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
