"""verl's training engines behind one seam (:mod:`ablate.replay.seams`): Megatron and VeOmni, each through verl's own R3.

``backend.engine`` names one of :data:`ablate.backends.verl.config.ENGINES`, the one table of
engines; :func:`seam_class` imports its seam and :func:`arm` arranges for the hook to install
itself when verl builds that engine's R3 actor. Every name a seam replaces in verl, Megatron-core
or VeOmni is in :mod:`ablate.backends.verl.entry_points`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ablate.backends.verl.config import ENGINES
from ablate.backends.verl.engines.base import hooked_call
from ablate.replay.seams import MICRO_BATCHES_KEY, CallInfo, EngineSeam, active_hook, install, uninstall


def _module(engine: str):
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[engine].seam.partition(":")[0])


def seam_class(engine: str) -> type[EngineSeam]:
    """The seam class of ``engine`` (``megatron`` or ``veomni``)."""
    return getattr(_module(engine), ENGINES[engine].seam.partition(":")[2])


def arm(engine: str, make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` once this process builds an R3 actor of ``engine``."""
    _module(engine).arm(make_hook)


__all__ = ["MICRO_BATCHES_KEY", "CallInfo", "EngineSeam", "active_hook", "arm", "hooked_call", "install",
           "seam_class", "uninstall"]
