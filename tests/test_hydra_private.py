"""What ablate takes from Hydra beyond its public API, pinned to the Hydra series it was read from.

A Hydra release that renames or changes any of it fails here, with the name of what moved, rather
than in the middle of a sweep: the private functions the grid sweeper composes jobs with
(``hydra_private.py``), the helpers that Hydra's public ``ConfigSource`` base gives its subclasses
(the sweeps source), and the grid expansion the grid sweeper repeats from Hydra's basic sweeper.
"""

import hydra
import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_config_search_path
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.config_source import ConfigSource
from hydra.types import RunMode
from omegaconf import OmegaConf

from hydra_plugins.ablate_grid_sweeper.grid_sweeper import grid_jobs
from hydra_plugins.ablate_grid_sweeper.hydra_private import (
    HYDRA_SERIES,
    ConfigLoaderImpl,
    apply_overrides,
    config_repository,
    hydra_load_sweep_config,
    share_config_store,
    value_node_kind,
)
from hydra_plugins.ablate_sweeps.sweeps_source import AblateSweepsConfigSource


def test_the_installed_hydra_is_the_series_the_private_functions_were_read_from():
    assert hydra.__version__.rsplit(".", 1)[0] == HYDRA_SERIES, (
        f"hydra-core {hydra.__version__}: hydra_private.py was written against {HYDRA_SERIES}.x; check "
        "ConfigLoaderImpl._parse_overrides_and_create_caching_repo and _apply_overrides_to_config, then update it")


def test_the_config_repository_knows_which_key_is_a_config_group():
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    repository = config_repository(loader, "config")
    assert repository.group_exists("policy") and repository.group_exists("backend")
    assert not repository.group_exists("budget") and not repository.group_exists("policy.tau")


def test_repositories_share_the_config_store_and_still_hand_out_copies_of_its_configs():
    import copy

    from hydra.core.config_store import ConfigStore

    share_config_store()  # as importing ablate.conf does
    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    first, second = config_repository(loader, "config"), config_repository(loader, "config")
    loaded = first.load_config("base_config")
    assert loaded is not None and loaded.config.store_dir == "runs"
    loaded.config.store_dir = "elsewhere"  # a composition that changes what it loaded ...
    assert second.load_config("base_config").config.store_dir == "runs"  # ... leaves the store as it was
    assert store.load("base_config.yaml").node.store_dir == "runs"


def test_value_overrides_are_applied_in_place_as_hydra_applies_them():
    cfg = OmegaConf.create({"a": 1, "b": {"c": 2}, "d": 3, "e": 4})
    overrides = OverridesParser.create().parse_overrides(["a=10", "b.c='x, y'", "~d", "+f=5", "++e=6"])
    apply_overrides(overrides, cfg)
    assert OmegaConf.to_container(cfg) == {"a": 10, "b": {"c": "x, y"}, "e": 6, "f": 5}


def test_the_config_source_helpers_the_sweeps_source_uses_are_there():
    assert ConfigSource._normalize_file_name("sweeps/smoke") == "sweeps/smoke.yaml"
    assert ConfigSource._get_header_dict("# @package _global_\na: 1\n")["package"] == "_global_"
    source = AblateSweepsConfigSource(provider="ablate-sweeps", path="ablate-sweeps://ablate.sweeps")
    assert source.available() and source.is_group("sweeps") and source.is_config("sweeps/smoke")
    assert "smoke" in source.list("sweeps", ObjectType.CONFIG) and source.list("", None) == ["sweeps"]
    loaded = source.load_config("sweeps/smoke")
    assert loaded.header["package"] == "_global_" and "hydra" in loaded.config


def test_the_grid_is_expanded_as_hydras_basic_sweeper_expands_it():
    arguments = ["policy=random,fisher", "budget=0.1,0.5", "seed=range(0,3)", "+x=1", "seed=4,5", "~y",
                 "tag='a, b'", "backend=noop"]
    overrides = OverridesParser.create().parse_overrides(arguments)
    assert grid_jobs(overrides) == BasicSweeper.split_arguments(overrides, None)[0]


def test_the_grids_values_are_the_overrides_hydra_parses_from_their_text():
    """The grid's value overrides are built from the sweep already parsed (a seed a millisecond otherwise):
    each must be what parsing its text gives, and one that may not be (quoted, escaped, a list) is parsed."""
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    parser = OverridesParser.create(config_loader=loader)
    arguments = ["seed=range(-2,3)", "budget=0.05,1e-3,0.3,inf", "policy.per_layer=true,False", "backend=noop,synthetic",
                 "tracking.project=a-b.c,x_1,+y", "objective=null", "+tag=1", "++other=2.5", "tracking.tags='a, b'",
                 "policy.tau=2", "extra=[1,2],{a: 1}", "label=a\\\\ b,'007'"]
    parsed = {}
    jobs = grid_jobs(parser.parse_overrides(arguments), parsed)
    assert len(jobs) == 5 * 4 * 2 * 2 * 3 * 2 * 2
    assert {"seed=-2", "budget=0.001", "budget=inf", "policy.per_layer=True", "tracking.project=+y", "objective=null",
            "+tag=1", "++other=2.5"} <= set(parsed)
    # Quoted, escaped, a list or a mapping: these are parsed from their text.
    assert {text for job in jobs for text in job} - set(parsed) == {
        "tracking.tags='a, b'", "extra=[1,2]", "extra={a:1}", "label='007'", "label=a\\\\\\ b"}
    for text, built in parsed.items():
        assert built == parser.parse_override(text), text


def test_the_kind_of_a_value_node_is_what_types_a_value_set_there():
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    cfg = loader.load_configuration("config", overrides=["policy=fisher"], run_mode=RunMode.RUN)
    seed, budget = value_node_kind(cfg, "seed"), value_node_kind(cfg, "budget")
    assert seed is not None and budget is not None and seed != budget  # an int, and a float that takes None
    assert value_node_kind(cfg.policy, "tau") == value_node_kind(cfg.policy, "tau")
    assert value_node_kind(cfg, "backend") is None and value_node_kind(cfg, "nothing") is None


def test_the_apps_config_texts_and_overrides_are_parsed_once_and_handed_out_as_copies(tmp_path):
    import ablate.conf  # noqa: F401  (its import turns both on)
    from hydra._internal.core_plugins.importlib_resources_config_source import ImportlibResourcesConfigSource

    source = ImportlibResourcesConfigSource(provider="ablate", path="pkg://ablate.conf")
    first, second = source.load_config("config.yaml"), source.load_config("config.yaml")
    assert first.config is not second.config and first.header == second.header
    # Compared unresolved: the run directory's ${now:...} resolves to the time of each comparison.
    assert OmegaConf.to_container(first.config) == OmegaConf.to_container(second.config)
    first.config.store_dir = "elsewhere"  # a composition that changes what it loaded ...
    first.config.hydra.callbacks.writable_store._target_ = "elsewhere"
    first.config.defaults.append("more")
    third = source.load_config("config.yaml").config  # ... changes no later load
    assert third.store_dir == "runs" and third.hydra.callbacks.writable_store._target_ != "elsewhere"
    assert "more" not in third.defaults
    edited = tmp_path / "edited.yaml"
    edited.write_text("a: 1\n")
    assert OmegaConf.load(edited).a == 1 and OmegaConf.load(str(edited)).a == 1
    edited.write_text("a: 2\n")
    assert OmegaConf.load(edited).a == 2  # the text is read each time: an edited file is parsed again

    parser = OverridesParser.create()
    once, again = parser.parse_override("tracking.tags=[a,b]"), parser.parse_override("tracking.tags=[a,b]")
    assert once == again and once is not again
    assert OverridesParser.create(config_loader=object()).parse_overrides(["x=1"])[0].config_loader is not None
    assert parser.parse_override("x=1").config_loader is None  # the loader set on a copy stays on that copy


@pytest.mark.parametrize("master", [[], ["sweeps=smoke", "hydra.sweeper.progress_interval=0.5", "hydra/launcher=joblib"]])
def test_a_job_composed_from_its_group_choice_is_the_job_hydra_composes(master, monkeypatch):
    """Every field of a job's config, Hydra's own records included, as Hydra's own load_sweep_config gives it."""
    import ablate.conf  # noqa: F401  (turns it on)

    monkeypatch.setenv("ABLATE_COPIED", "v")
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://ablate.conf"))
    top = loader.load_configuration("config", overrides=[*master, "hydra.job.env_copy=[ABLATE_COPIED]"],
                                    run_mode=RunMode.MULTIRUN)
    jobs = [["policy=random", "budget=0.1", "seed=3", "store_dir='/s (é,)'", "tracking.mode=disabled"],
            ["policy=random", "budget=0.5", "seed=4", "store_dir='/s (é,)'", "tracking.mode=disabled"],
            ["seed=5", "policy=fisher", "policy.tau=1.5", "backend=noop", "+extra=1", "~objective"],
            ["policy=fisher", "tracking.tags=[a,b]", "++analysis.margins={kl_k3_mean: 0.1}", "hydra.job.chdir=true"],
            ["backend=synthetic", "backend.steps=7", "tracking.label='backend.router_noise=0.2'", "seed=6"],
            ["policy=none", "budget=null", "seed=1", "hydra.verbose=true"],
            ["policy=none", "budget=null", "seed=2", "hydra.verbose=true"]]
    for job in jobs:
        fast = loader.load_sweep_config(top, job)
        hydra = hydra_load_sweep_config(loader, top, job)
        assert OmegaConf.to_container(fast) == OmegaConf.to_container(hydra), job
        assert OmegaConf.is_struct(fast) and not OmegaConf.is_readonly(fast.hydra)
        assert fast.hydra.job.env_set.ABLATE_COPIED == "v" and fast.hydra.overrides.task == [
            o for o in job if not o.startswith("hydra.")]
    with pytest.raises(Exception, match="budget"):  # a value Hydra refuses, refused alike
        loader.load_sweep_config(top, ["policy=random", "budget=abc"])
