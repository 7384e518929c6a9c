"""verl's training engines behind one seam (:mod:`.base`): Megatron and VeOmni, each through verl's own R3.

``backend.engine`` names one of :data:`ENGINES`; :func:`seam_for` builds its seam and :func:`arm`
arranges for the hook to install itself when verl builds that engine's R3 actor. Every name a
seam replaces in verl, Megatron-core or VeOmni is in :mod:`ablate.backends.verl.entry_points`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ablate.backends.verl.engines.base import (
    MICRO_BATCHES_KEY,
    CallInfo,
    EngineSeam,
    active_hook,
    hooked_call,
    install,
    uninstall,
)

#: ``backend.engine`` -> the module holding its seam class and its ``arm``.
ENGINES = {"megatron": ("ablate.backends.verl.engines.megatron", "MegatronSeam"),
           "veomni": ("ablate.backends.verl.engines.veomni", "VeOmniSeam")}


def _module(engine: str):
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[engine][0])


def seam_for(engine: str, hook) -> EngineSeam:
    """A new seam for ``engine`` (``megatron`` or ``veomni``) that reaches ``hook``."""
    return getattr(_module(engine), ENGINES[engine][1])(hook)


def arm(engine: str, make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` once this process builds an R3 actor of ``engine``."""
    _module(engine).arm(make_hook)


__all__ = ["ENGINES", "MICRO_BATCHES_KEY", "CallInfo", "EngineSeam", "active_hook", "arm", "hooked_call", "install",
           "seam_for", "uninstall"]
