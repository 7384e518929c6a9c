"""The configs that make ``hydra/launcher=<name>`` select ablate's launchers
(:mod:`hydra_plugins.ablate_launchers.launchers`).

Apart from the launchers so that a worker re-registering them (:class:`ablate.launchers.jobs.HydraJob`)
imports no launcher, and the launchers' module imports this one, never the reverse: each config
names its launcher by its import path only.

No ``from __future__ import annotations``: OmegaConf reads the configs' annotations as types.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore

_LAUNCHERS = "hydra_plugins.ablate_launchers.launchers"


@dataclass
class LocalLauncherConf:
    _target_: str = f"{_LAUNCHERS}.LocalLauncher"
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
    _target_: str = f"{_LAUNCHERS}.RayLauncher"
    ray: RayConf = field(default_factory=RayConf)


@dataclass
class SubmititLocalLauncherConf:
    _target_: str = f"{_LAUNCHERS}.SubmititLocalLauncher"
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
