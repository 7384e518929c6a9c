"""The sweeper's config, registered as ``hydra/sweeper=ablate_optuna``.

Defaults that point into the app config (``${sweep}``, ``${store_dir}``) keep the study beside the
run store it fills: ``<store_dir>/<sweep>/optuna.journal``, stable across restarts, whereas
Hydra's own sweep directory is timestamped and new on every start.

No ``from __future__ import annotations`` in this module or ``optuna_sweeper.py``: Hydra's plugin
scan executes them outside ``sys.modules``, where dataclasses cannot resolve string annotations.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


class SamplerName(str, Enum):
    tpe = "tpe"
    random = "random"
    cmaes = "cmaes"  # needs the `cmaes` package; searches float and int parameters only
    nsgaii = "nsgaii"


@dataclass
class SamplerConf:
    name: SamplerName = SamplerName.tpe
    #: Seed of a fresh study. A resumed study reseeds with ``seed + <trials it already has>`` so
    #: that it does not replay the first run's suggestions.
    seed: Optional[int] = None


@dataclass
class AblateOptunaSweeperConf:
    _target_: str = "hydra_plugins.ablate_optuna_sweeper.optuna_sweeper.AblateOptunaSweeper"
    sampler: SamplerConf = field(default_factory=SamplerConf)
    #: ``maximize`` or ``minimize``, or a list of them for a multi-objective study (the task then
    #: returns one value per direction). ``Any``: OmegaConf 2.3 has no Union[str, list].
    direction: Any = "maximize"
    #: Trials the study should hold when the sweep ends: complete and failed trials of earlier
    #: runs of the same study count, so rerunning with a larger ``n_trials`` extends it.
    n_trials: int = 20
    #: Trials asked for and launched together, one batch at a time, through the configured launcher.
    n_jobs: int = 1
    #: The study stops with an error once more than ``max_failure_rate * n_trials`` trials failed.
    max_failure_rate: float = 0.0
    study_name: Optional[str] = "${sweep}"
    #: A journal file (any path; no database needed), an RDB URL (``sqlite:///study.db``), or
    #: null for an in-memory study that cannot resume.
    storage: Optional[str] = "${store_dir}/${sweep}/optuna.journal"
    #: Search space in Hydra's sweep syntax, ``{key: "interval(0.05, 0.5)"}``; plain values are
    #: passed unchanged to every trial. Sweep overrides on the command line are added to it.
    params: Optional[dict[str, str]] = None
    #: Objective names for the exported table and the dashboard; null: the app's ``objective``.
    metric_names: Optional[list[str]] = None
    #: Where ``optuna_trials.csv``/``.parquet`` and ``optuna_best.json`` go; null: not exported.
    export_dir: Optional[str] = "${store_dir}/${sweep}"


ConfigStore.instance().store(
    group="hydra/sweeper", name="ablate_optuna", node=AblateOptunaSweeperConf, provider="ablate_optuna_sweeper"
)
