"""Backends run one cell. Each is imported only when a cell asks for it (verl is heavy)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: backend name -> "module:function" with signature ``run(cell, log_step) -> None``.
BACKENDS = {
    "synthetic": "ablate.backends.synthetic:run_cell_steps",
    "verl": "ablate.backends.verl.backend:run_cell_steps",
    "noop": "ablate.backends.noop:run_cell_steps",
}


#: Backends that score counterfactual probes (docs/probes.md); a cell with probes on another fails
#: as a bad config rather than run without them.
PROBE_BACKENDS = ("synthetic",)


#: backend name -> "module:function" with signature ``preflight(cell) -> str``, for backends that
#: launch another program: checks the launch the cell would make and returns its command. The
#: runner calls it before the cell's directory is written, so a launch that cannot work (verl
#: missing, a config verl refuses) fails as a bad config, and ``backend.dry_run=true`` prints it.
PREFLIGHTS = {
    "verl": "ablate.backends.verl.backend:dry_run_command",
}


def backend_runner(name: str) -> Callable[..., Any]:
    return _load(BACKENDS, name)


def backend_preflight(name: str) -> Callable[..., str] | None:
    """The backend's preflight check, or ``None`` when it has none (it runs in process)."""
    return _load(PREFLIGHTS, name) if name in PREFLIGHTS else None


def _load(table: dict[str, str], name: str) -> Callable[..., Any]:
    if name not in table:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(sorted(table))}")
    module, function = table[name].split(":")
    return getattr(importlib.import_module(module), function)
