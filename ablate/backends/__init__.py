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


def backend_runner(name: str) -> Callable[..., Any]:
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(sorted(BACKENDS))}")
    module, function = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), function)
