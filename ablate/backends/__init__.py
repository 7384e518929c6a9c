"""Backends run one cell. Each is one :class:`Backend` object, defined beside its implementation.

A backend's object holds its name, its config class (extending :class:`BackendConfig`), how it
runs a cell, its optional preflight and what it supports. The object lives in a module that
imports no heavy library (the built-ins' are ``noop.py``, ``synthetic_config.py`` and
``verl/config.py``): composing a config registers every backend's schema, and ``--help`` must not
wait for torch. A backend whose run needs torch or verl names it with :func:`deferred`, imported
when a cell runs.

The registry knows the built-ins by where their object lives, and an installed package adds its
own through an entry point in group ``ablate.backends`` (``name = "module:BACKEND"``).
:func:`register_backend_schemas`, the one place backends are registered with Hydra, stores each
backend's config class as the schema ``base_<name>`` that ``conf/backend/*.yaml`` extend, and
offers a backend without a YAML file in ``ablate.conf`` as ``backend=<name>``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ablate.config import BackendConfig, ConfigError, Estimator

if TYPE_CHECKING:
    from ablate.cell import Cell

__all__ = ["Backend", "BackendConfig", "RunContext", "backend_names", "deferred", "get_backend",
           "register_backend_schemas"]

C = TypeVar("C", bound=BackendConfig)

#: The entry-point group through which an installed package adds backends: ``name = "module:OBJECT"``.
ENTRY_POINT_GROUP = "ablate.backends"


@dataclass(frozen=True)
class RunContext:
    """What the runner gives a backend for one cell."""

    #: The cell's directory in the run store: where a backend keeps its own files.
    directory: Path
    #: ``log_step(step, record, native=None)``: one step's schema record (and backend-native metrics).
    log_step: Callable[..., None]
    log: logging.Logger


@dataclass(frozen=True)
class Backend(Generic[C]):
    """One backend: its name, its config schema, how it runs a cell, its preflight, what it supports.

    ``run(cell, context)`` runs the cell's steps, calling ``context.log_step`` after each.
    ``preflight(cell)``, for backends that launch another program, checks the launch the cell
    would make and returns its command. The runner calls it before the cell's directory is
    written, so a launch that cannot work (verl missing, a config verl refuses) fails as a bad
    config, and ``backend.dry_run=true`` prints it. A cell asking for what the backend does not
    support (probes, another Fisher estimator) fails as a bad config before anything is written.
    """

    name: str
    config: type[C]
    run: Callable[[Cell, RunContext], None]
    preflight: Callable[[Cell], str] | None = None
    #: Whether it scores counterfactual probes (docs/probes.md).
    scores_probes: bool = False
    #: The Fisher estimators (``policy.fisher.estimator``) it measures.
    fisher_estimators: tuple[str, ...] = tuple(estimator.value for estimator in Estimator)
    #: The ``replay.source`` values it runs: ``rollout`` (R3), ``train`` (R2).
    replay_sources: tuple[str, ...] = ("rollout",)
    #: Whether it replays the rollout's gate weights (``replay.weights=rollout``).
    replays_gate_weights: bool = False
    #: Whether it applies a policy's slot gate where it applies the mask (``ReplayPolicy.gates_slots``).
    gates_slots: bool = False
    #: Why it does not, in words that finish "its gate needs the trainer's router scores where each
    #: route is applied, which ...".
    gate_refusal: str = "this backend does not see"

    def config_of(self, cell: Cell) -> C:
        """The cell's backend settings, as this backend's own config class."""
        if not isinstance(cell.backend, self.config):
            raise TypeError(f"backend={self.name} got a {type(cell.backend).__name__}: expected {self.config.__name__}")
        return cell.backend


def deferred(target: str) -> Callable[..., Any]:
    """The function ``"module:function"``, its module imported at the first call, not before."""
    module, attribute = target.split(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attribute)(*args, **kwargs)

    call.__qualname__ = call.__name__ = target
    return call


#: backend name -> "module:object" of its :class:`Backend`.
BACKENDS = {
    "synthetic": "ablate.backends.synthetic_config:BACKEND",
    "verl": "ablate.backends.verl.config:BACKEND",
    "noop": "ablate.backends.noop:BACKEND",
}
_entry_points_loaded = False


def _installed() -> dict[str, str]:
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            BACKENDS.setdefault(point.name, point.value)
    return BACKENDS


def backend_names() -> list[str]:
    """Every backend a cell can name: the built-ins and those of installed packages."""
    return sorted(_installed())


def get_backend(name: str) -> Backend[Any]:
    """The backend ``name``: a built-in, or one an installed package names by entry point."""
    table = _installed()
    if name not in table:
        raise ConfigError(f"backend={name!r}: expected one of {', '.join(sorted(table))} (a backend of your own is "
                          f"found through an entry point in group {ENTRY_POINT_GROUP})")
    module, attribute = table[name].split(":")
    try:
        backend = getattr(importlib.import_module(module), attribute)
    except Exception as error:  # a broken install: its entry point names code that does not load
        raise ConfigError(f"backend={name!r} at {table[name]} cannot be loaded: {type(error).__name__}: {error} "
                          f"(an entry point in group {ENTRY_POINT_GROUP}; reinstall or remove its package)") from None
    if not isinstance(backend, Backend) or backend.name != name:
        raise ConfigError(f"backend={name!r} at {table[name]} is {backend!r}: expected ablate.backends.Backend named {name!r}")
    return backend


def register_backend_schemas() -> None:
    """Register every backend's config class with Hydra (idempotent): the one place this is done.

    Each is stored at the root as ``base_<name>``, the schema that ``conf/backend/<name>*.yaml``
    (and a user's own backend YAML under ``--config-dir``) extend with ``/base_<name>@_here_``.
    A backend without a ``conf/backend/<name>.yaml`` in ``ablate.conf`` (a plugin's) is also
    offered as the ``backend=<name>`` option; storing one beside a file of the same name would
    make Hydra merge the two, with a deprecation warning.
    """
    from importlib import resources

    from hydra.core.config_store import ConfigStore

    shipped = resources.files("ablate.conf").joinpath("backend")
    store = ConfigStore.instance()
    for name in backend_names():
        backend = get_backend(name)
        store.store(name=f"base_{name}", node=backend.config)
        if not shipped.joinpath(f"{name}.yaml").is_file():
            store.store(group="backend", name=name, node=backend.config(name=name))
