"""The private Hydra functions the grid sweeper relies on, pinned to the Hydra series they were read from.

A Hydra release that renames or changes them fails here, with the name of what moved, rather than
in the middle of a sweep.
"""

import hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from hydra_plugins.ablate_grid_sweeper.hydra_private import (
    HYDRA_SERIES,
    ConfigLoaderImpl,
    apply_overrides,
    config_repository,
)


def test_the_installed_hydra_is_the_series_the_private_functions_were_read_from():
    assert hydra.__version__.rsplit(".", 1)[0] == HYDRA_SERIES, (
        f"hydra-core {hydra.__version__}: hydra_private.py was written against {HYDRA_SERIES}.x; check "
        "ConfigLoaderImpl._parse_overrides_and_create_caching_repo and _apply_overrides_to_config, then update it")


def test_the_config_repository_knows_which_key_is_a_config_group():
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    repository = config_repository(loader, "config")
    assert repository.group_exists("policy") and repository.group_exists("backend")
    assert not repository.group_exists("budget") and not repository.group_exists("policy.tau")


def test_value_overrides_are_applied_in_place_as_hydra_applies_them():
    cfg = OmegaConf.create({"a": 1, "b": {"c": 2}, "d": 3, "e": 4})
    overrides = OverridesParser.create().parse_overrides(["a=10", "b.c='x, y'", "~d", "+f=5", "++e=6"])
    apply_overrides(overrides, cfg)
    assert OmegaConf.to_container(cfg) == {"a": 10, "b": {"c": "x, y"}, "e": 6, "f": 5}
