"""The study: where it is stored, how it is opened or resumed, its sampler and its metric names.

A study lives in a journal file (any path; no database), an RDB URL, or memory (``storage``
null: it cannot be resumed). It is loaded if it exists, and must have been created with the same
directions. Its sampler is chosen once it is open: a resumed study's sampler is seeded with
``seed + <trials it already has>``, so that it does not replay the first run's suggestions.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna
from omegaconf import ListConfig
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages.journal import JournalFileBackend

from ablate.store import store_root

from ._journal import repair_journal
from .config import SamplerConf, SamplerName

log = logging.getLogger(__name__)

DIRECTIONS = ("minimize", "maximize")


def directions_of(direction: Any) -> list[str]:
    """``hydra.sweeper.direction`` as a list of ``minimize``/``maximize``, one per objective."""
    raw = list(direction) if isinstance(direction, (list, tuple, ListConfig)) else [direction]
    directions = [str(getattr(d, "value", d)).lower() for d in raw]
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"hydra.sweeper.direction={direction}: expected maximize, minimize or a list of them")
    return directions


class StudyStorage:
    """``hydra.sweeper.storage``: a journal path, an RDB URL (``sqlite:///study.db``), or None (memory)."""

    def __init__(self, storage: Optional[str]) -> None:
        self.storage = storage

    @property
    def journal(self) -> Optional[Path]:
        if self.storage is None or "://" in self.storage:
            return None
        return store_root(self.storage)

    def __str__(self) -> str:
        return str(self.journal) if self.journal is not None else (self.storage or "memory")

    def open(self) -> Optional[str | BaseStorage]:
        if self.storage is None:
            log.warning("hydra.sweeper.storage=null: the study lives in memory and cannot be resumed")
            return None
        if self.journal is None:
            return self.storage
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        repair_journal(self.journal)
        return JournalStorage(JournalFileBackend(str(self.journal)))


def open_study(name: Optional[str], storage: StudyStorage, directions: list[str], sampler: SamplerConf,
               metric_names: Optional[list[str]]) -> optuna.Study:
    """The study, created or resumed, with its sampler and (if they fit its directions) its metric names."""
    # The sampler is chosen once the study is open: its seed depends on the trials it holds.
    study = optuna.create_study(study_name=name, storage=storage.open(), directions=list(directions),
                                load_if_exists=True, sampler=optuna.samplers.RandomSampler())
    found = [d.name.lower() for d in study.directions]
    if found != directions:
        raise ValueError(f"hydra.sweeper.direction={directions}: study {study.study_name!r} in {storage} was created "
                         f"with {found}; use another study_name or storage")
    study.sampler = make_sampler(sampler, len(directions), len(study.get_trials(deepcopy=False)))
    if metric_names is not None and len(metric_names) != len(directions):
        log.warning("metric names %s do not match directions %s: not set", metric_names, directions)
    elif metric_names is not None and study.metric_names != metric_names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(metric_names)
    return study


def make_sampler(sampler: SamplerConf, objectives: int, existing_trials: int) -> optuna.samplers.BaseSampler:
    name = SamplerName(getattr(sampler.name, "value", sampler.name))
    seed = None if sampler.seed is None else sampler.seed + existing_trials
    if name == SamplerName.tpe:
        return optuna.samplers.TPESampler(seed=seed)
    if name == SamplerName.random:
        return optuna.samplers.RandomSampler(seed=seed)
    if name == SamplerName.nsgaii:
        return optuna.samplers.NSGAIISampler(seed=seed)
    if objectives > 1:
        raise ValueError("hydra.sweeper.sampler.name=cmaes: CMA-ES optimises one objective; use tpe or nsgaii")
    try:
        import cmaes  # noqa: F401  (Optuna imports it lazily, only when the first trial is asked)
    except ImportError:
        raise ValueError("hydra.sweeper.sampler.name=cmaes needs the cmaes package: pip install cmaes") from None
    return optuna.samplers.CmaEsSampler(seed=seed)


def metric_names_for(metric_names: Optional[list[str]], objective: Any) -> Optional[list[str]]:
    """``hydra.sweeper.metric_names``, or else the app's ``objective`` (a name or a list of names)."""
    if metric_names is not None:
        return list(metric_names)
    if isinstance(objective, str):
        return [objective]
    if isinstance(objective, ListConfig):
        return [str(name) for name in objective]
    return None
