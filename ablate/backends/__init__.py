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


#: backend name -> "module:function" with signature ``dry_run(cell) -> str``: the checked launch a
#: cell would make (``backend.dry_run=true``), for backends that launch another program.
DRY_RUNS = {
    "verl": "ablate.backends.verl.backend:dry_run_command",
}


def backend_runner(name: str) -> Callable[..., Any]:
    return _load(BACKENDS, name)


def backend_dry_run(name: str) -> Callable[..., str]:
    return _load(DRY_RUNS, name)


def _load(table: dict[str, str], name: str) -> Callable[..., Any]:
    if name not in table:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(sorted(table))}")
    module, function = table[name].split(":")
    return getattr(importlib.import_module(module), function)
