"""The private parts of Hydra 1.3 (and OmegaConf 2.3) that ablate's app relies on: those the grid
sweeper composes and types its jobs with, and one change to how Hydra copies its config store.

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

import re
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.config_repository import IConfigRepository
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import Override, ValueType
from omegaconf import DictConfig, ValueNode

#: The Hydra release series these functions were read from (pyproject.toml pins hydra-core <1.4).
HYDRA_SERIES = "1.3"

__all__ = ["HYDRA_SERIES", "ConfigLoaderImpl", "apply_overrides", "config_repository", "element_override",
           "element_text", "parsed_element", "share_config_store", "value_node_kind"]


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
