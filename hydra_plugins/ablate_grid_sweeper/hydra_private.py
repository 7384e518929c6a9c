"""The private parts of Hydra 1.3 (and OmegaConf 2.3) that ablate's app relies on: those the grid
sweeper composes and types its jobs with, and what ablate's app changes in how Hydra copies its
config store and parses config files and overrides (each once per process).

Hydra has no public API for the two halves of composing one job: the config repository that
knows which override chooses a config group, and the function that applies the other overrides
to a composed config. :class:`~hydra_plugins.ablate_grid_sweeper.grid_sweeper.JobComposer`
needs both to compose a grid of many values and few group choices once per group choice.
Nor for an override's parsed value and its text, from which the grid sweeper builds each job's
value without parsing it again (:func:`element_override`). OmegaConf has none for the kind of
node a key holds, which decides how a value set there is typed (:func:`value_node_kind`). They
live here alone, so that a Hydra release that moves them breaks one module, and the test pinned
to :data:`HYDRA_SERIES` (tests/test_hydra_private.py) says which.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import weakref
from typing import Any

import yaml

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra._internal.config_repository import IConfigRepository
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from omegaconf import DictConfig, ListConfig, OmegaConf, ValueNode, open_dict

#: The Hydra release series these functions were read from (pyproject.toml pins hydra-core <1.4).
HYDRA_SERIES = "1.3"

__all__ = ["HYDRA_SERIES", "ConfigLoaderImpl", "apply_overrides", "compose_jobs_per_group_choice", "config_repository",
           "element_override", "element_text", "hydra_load_sweep_config", "parse_config_texts_once",
           "parse_overrides_once", "parsed_element", "share_config_store", "value_node_kind"]


def config_repository(loader: ConfigLoaderImpl, config_name: str | None) -> IConfigRepository:
    """The repository of the app's configs, as Hydra builds it to compose a job."""
    _, repository = loader._parse_overrides_and_create_caching_repo(config_name, [])
    return repository


def apply_overrides(overrides: list[Override], cfg: DictConfig) -> None:
    """Apply value overrides (``a=1``, ``+b=2``, ``~c``, ``++d=3``) to ``cfg`` in place, as Hydra does."""
    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def parsed_element(override: Override) -> Any:
    """The value of a plain override as parsed, quotes kept (``Override.value()`` drops them)."""
    return override._value


def element_text(element: Any) -> str:
    """A parsed value as the text of an override (``'a, b'``, ``[1,2]``, ``0.001``), as Hydra's basic
    sweeper writes it."""
    return Override._get_value_element_as_str(element)


#: The text of a string value that Hydra writes back as it is (no quotes, escapes or interpolation).
_PLAIN_TEXT = re.compile(r"[A-Za-z0-9_.+\-]+")


def element_override(override: Override, element: Any, text: str) -> Override | None:
    """The override ``text`` (one value of ``override``: ``seed=3``) as parsing it would give it, or None
    where that is not certain (a list, a mapping, a quoted or escaped string: those are parsed)."""
    plain = element is None or isinstance(element, (bool, int, float)) or (
        type(element) is str and _PLAIN_TEXT.fullmatch(element) is not None)
    if not plain:
        return None
    # No config loader, as OverridesParser.parse_override leaves it: a plain value needs none.
    return Override(type=override.type, key_or_group=override.key_or_group, value_type=ValueType.ELEMENT,
                    _value=element, package=override.package, input_line=text)


def value_node_kind(parent: DictConfig, key: str) -> tuple[object, ...] | None:
    """What decides how OmegaConf types a value set at ``parent[key]``: the node's class, declared
    type and whether it takes None, and whether it or its parent is read-only; None where ``key``
    holds no value node (absent, a mapping or a list) or one left missing (``???``)."""
    node = parent._get_node(key, validate_access=False, validate_key=False)
    if not isinstance(node, ValueNode) or node._is_missing():
        return None
    return (type(node), node._metadata.ref_type, node._metadata.optional, node._get_flag("readonly"),
            parent._get_flag("readonly"))


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


def hydra_load_sweep_config(loader: ConfigLoaderImpl, master_config: DictConfig,
                            sweep_overrides: list[str]) -> DictConfig:
    """Hydra's own composition of a sweep's job, whether :func:`compose_jobs_per_group_choice` is on or not."""
    load = ConfigLoaderImpl.load_sweep_config
    return getattr(load, "hydras", load)(loader, master_config, sweep_overrides)


def compose_jobs_per_group_choice() -> None:
    """Let Hydra compose a sweep's jobs once per choice of config groups, and each job from that.

    A launcher composes every job of a sweep before it runs it (``load_sweep_config``, in the
    sweep's process or in a worker): for ablate's app about 60 ms a job, more than half of what a
    bare Hydra app spends per job, in which the job's own values (``seed=3``, ``budget=0.1``) are
    a few dictionary updates. Hydra composes in two phases (the defaults list, from the config
    groups the overrides choose; then the other overrides applied to the composed config: see
    ``Overrides`` in Hydra's ``defaults_list``), so the first phase is done once per choice of
    groups and Hydra overrides, and each job is a copy of it with its values applied and the
    job's own records filled in as Hydra fills them (the overrides lists, ``override_dirname``, the
    working directory, the copied environment). A job with a sweep override or a package-qualified
    value is composed by Hydra whole. Called by the app's configs (``ablate.conf``) only;
    ``tests/test_hydra_private.py`` holds every field of the result to Hydra's own.
    """
    hydras = ConfigLoaderImpl.load_sweep_config
    if getattr(hydras, "hydras", None) is not None:
        return
    #: Per config loader: the repository of each set of Hydra overrides, the composition of each choice.
    known: weakref.WeakKeyDictionary[ConfigLoaderImpl, dict[tuple[str, ...], Any]] = weakref.WeakKeyDictionary()

    def load_sweep_config(loader: ConfigLoaderImpl, master_config: DictConfig,
                          sweep_overrides: list[str]) -> DictConfig:
        own = OverridesParser.create().parse_overrides(list(sweep_overrides))
        if any(o.is_sweep_override() or (o.package is not None and not o.is_hydra_override()) for o in own):
            return hydras(loader, master_config, sweep_overrides)
        cache = known.setdefault(loader, {})
        name = str(master_config.hydra.job.config_name)
        sweeps = [str(o) for o in master_config.hydra.overrides.hydra]
        configured = [*sweeps, *(str(o.input_line) for o in own if o.is_hydra_override())]
        searched = ("repository", name, *configured)  # a Hydra override may change the search path, hence the groups
        if searched not in cache:
            cache[searched] = loader._parse_overrides_and_create_caching_repo(name, configured)[1]
        groups = cache[searched]
        chooses = [o.is_hydra_override() or (groups.group_exists(o.key_or_group) and not isinstance(o.value(), dict))
                   for o in own]
        choice = [str(o.input_line) for o, chosen in zip(own, chooses) if chosen]
        key = ("composition", name, *sweeps, "|", *choice)
        if key not in cache:
            cache[key] = hydras(loader, master_config, choice)
        cfg = copy.deepcopy(cache[key])
        ConfigLoaderImpl._apply_overrides_to_config([o for o, chosen in zip(own, chooses) if not chosen], cfg)
        app = [o for o in own if not o.is_hydra_override()]
        cfg.hydra.overrides.task = [o.input_line for o in app]
        with open_dict(cfg.hydra):
            for variable in cfg.hydra.job.env_copy:
                cfg.hydra.job.env_set[variable] = os.environ[variable]
        cfg.hydra.runtime.cwd = os.getcwd()
        dirname = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(overrides=app, kv_sep=dirname.kv_sep,
                                                               item_sep=dirname.item_sep,
                                                               exclude_keys=dirname.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    load_sweep_config.hydras = hydras  # type: ignore[attr-defined]
    ConfigLoaderImpl.load_sweep_config = load_sweep_config  # type: ignore[method-assign]


def parse_overrides_once() -> None:
    """Let Hydra parse each distinct override once per process; each parse hands out a copy.

    Hydra's override grammar is an ANTLR parser written in Python: about a millisecond an
    override. Every job of a sweep is composed from its overrides and the sweep's own (ablate's
    jobs carry half a dozen: the store, the sweep, tracking, a label), each parsed again, in the
    sweep's process and in every worker. A parsed override is not changed by the composition that
    uses it, except for the config loader :meth:`OverridesParser.parse_overrides` sets on it, which
    goes on the copy. Called by the app's configs (``ablate.conf``) only.
    """
    parse = OverridesParser.parse_rule
    if getattr(parse, "parses_once", False):
        return
    parsed: dict[str, Override] = {}

    def parse_rule(parser: OverridesParser, text: str, rule_name: str) -> Any:
        if rule_name != "override":
            return parse(parser, text, rule_name)
        if text not in parsed:
            parsed[text] = parse(parser, text, rule_name)
        return copy.copy(parsed[text])

    parse_rule.parses_once = True  # type: ignore[attr-defined]
    OverridesParser.parse_rule = parse_rule  # type: ignore[method-assign]


def parse_config_texts_once() -> None:
    """Let OmegaConf parse each distinct config text once per process.

    Hydra composes every job of a sweep afresh (in the sweep's process, or in a worker), and every
    composition reads and parses each YAML file it uses again: for ablate's app about 20 ms of a
    job (the main config and the two logging configs are most of it), where a bare Hydra app's job
    costs about 100. ``OmegaConf.load`` is YAML's parse, then ``OmegaConf.create`` of what it
    parsed; the parse is kept by text (the text is still read each time, so an edited file is
    parsed again) and each load creates its config from it as before. Hydra's config sources are
    re-created by its plugin scan, so the function they call is the one place to do this. Called by
    the app's configs (``ablate.conf``) only.
    """
    if getattr(OmegaConf.load, "parses_once", False):
        return
    from omegaconf._utils import get_yaml_loader

    parsed: dict[Any, Any] = {}

    def load_once(file_: Any) -> DictConfig | ListConfig:
        if isinstance(file_, (str, pathlib.Path)):
            with open(os.path.abspath(file_), encoding="utf-8") as opened:
                text = opened.read()
        elif getattr(file_, "read", None):
            text = file_.read()
        else:
            raise TypeError("Unexpected file type")
        if text not in parsed:
            parsed[text] = yaml.load(text, Loader=get_yaml_loader())
        found = parsed[text]
        if found is not None and not isinstance(found, (list, dict, str)):
            raise OSError(f"Invalid loaded object type: {type(found).__name__}")
        return OmegaConf.create() if found is None else OmegaConf.create(found)

    load_once.parses_once = True  # type: ignore[attr-defined]
    OmegaConf.load = staticmethod(load_once)  # type: ignore[method-assign]
