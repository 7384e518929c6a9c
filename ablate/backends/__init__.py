"""Backends run one cell. Each is one :class:`Backend` object, defined beside its implementation.

The registry knows the built-ins by where their object lives (each is imported only when a cell
asks for it: verl is heavy), and an installed package adds its own through an entry point in
group ``ablate.backends`` (``name = "module:BACKEND"``). A backend's config schema extends
:class:`ablate.config.BackendConfig`; the built-ins' schemas sit in :mod:`ablate.config` so that
composing a config never imports torch, and a plugin's is offered as ``backend=<name>`` by
:func:`register_backend_options`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ablate.config import BackendConfig, ConfigError

if TYPE_CHECKING:
    from ablate.cell import Cell

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
    """One backend: its name, its config schema, how it runs a cell, and its optional preflight.

    ``run(cell, context)`` runs the cell's steps, calling ``context.log_step`` after each.
    ``preflight(cell)``, for backends that launch another program, checks the launch the cell
    would make and returns its command. The runner calls it before the cell's directory is
    written, so a launch that cannot work (verl missing, a config verl refuses) fails as a bad
    config, and ``backend.dry_run=true`` prints it.
    """

    name: str
    config: type[C]
    run: Callable[[Cell, RunContext], None]
    preflight: Callable[[Cell], str] | None = None
    #: Whether ``run`` scores the cell's counterfactual probes (docs/probes.md); a cell with probes
    #: on a backend that does not fails as a bad config rather than run without them.
    scores_probes: bool = False

    def config_of(self, cell: Cell) -> C:
        """The cell's backend settings, as this backend's own config class."""
        if not isinstance(cell.backend, self.config):
            raise TypeError(f"backend={self.name} got a {type(cell.backend).__name__}: expected {self.config.__name__}")
        return cell.backend


#: backend name -> "module:object" of its :class:`Backend`.
BACKENDS = {
    "synthetic": "ablate.backends.synthetic:BACKEND",
    "verl": "ablate.backends.verl.backend:BACKEND",
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
    backend = getattr(importlib.import_module(module), attribute)
    if not isinstance(backend, Backend) or backend.name != name:
        raise ConfigError(f"backend={name!r} at {table[name]} is {backend!r}: expected ablate.backends.Backend named {name!r}")
    return backend


def register_backend_options() -> None:
    """Offer each installed backend's config schema as an option of the ``backend`` config group."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        backend = get_backend(point.name)
        store.store(group="backend", name=backend.name, node=backend.config(name=backend.name))
