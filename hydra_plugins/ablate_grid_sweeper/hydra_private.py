"""The private parts of Hydra 1.3 that ablate's app relies on: those the grid sweeper composes
its jobs with, and one change to how Hydra copies its config store.

Hydra has no public API for the two halves of composing one job: the config repository that
knows which override chooses a config group, and the function that applies the other overrides
to a composed config. :class:`~hydra_plugins.ablate_grid_sweeper.grid_sweeper.JobComposer`
needs both to compose a grid of many values and few group choices once per group choice.
They live here alone, so that a Hydra release that moves them breaks one module, and the test
pinned to :data:`HYDRA_SERIES` (tests/test_hydra_private.py) says which.
"""

from __future__ import annotations

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import IConfigRepository
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

#: The Hydra release series these functions were read from (pyproject.toml pins hydra-core <1.4).
HYDRA_SERIES = "1.3"

__all__ = ["HYDRA_SERIES", "ConfigLoaderImpl", "apply_overrides", "config_repository", "share_config_store"]


def config_repository(loader: ConfigLoaderImpl, config_name: str | None) -> IConfigRepository:
    """The repository of the app's configs, as Hydra builds it to compose a job."""
    _, repository = loader._parse_overrides_and_create_caching_repo(config_name, [])
    return repository


def apply_overrides(overrides: list[Override], cfg: DictConfig) -> None:
    """Apply value overrides (``a=1``, ``+b=2``, ``~c``, ``++d=3``) to ``cfg`` in place, as Hydra does."""
    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def share_config_store() -> None:
    """Let Hydra's config repositories share the process's config store instead of deep-copying it.

    Hydra 1.3 builds a caching repository for every job it composes and for every config group
    ``--help`` lists (about 60), and deep-copies the repository each time, the structured configs'
    source with it, and with that the whole :class:`ConfigStore` singleton (every schema and
    launcher config: 7 ms, half of ``--help``). The copy protects nothing: the repository's
    copy is made so that its search path can change, the store is not part of that, and
    ``ConfigStore.load`` hands out a copy of each node it loads. Called by the app's configs
    (``ablate.conf``) only, so other Hydra apps in the environment keep Hydra's behaviour.
    """
    ConfigStore.__deepcopy__ = _the_same_store  # type: ignore[attr-defined]


def _the_same_store(store: ConfigStore, memo: dict) -> ConfigStore:
    return store
