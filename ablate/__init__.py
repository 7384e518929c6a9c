"""ablate: routing-replay ablations for Mixture-of-Experts RL.

Does replaying the inference engine's routes help, and is it the *budget* (how many routes are
replayed) or the *selection* (which ones) that helps?

The public names below load on first use (PEP 562): ``python -m ablate --help`` and tab
completion import this package, and should not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "BudgetError": "ablate.budget",
    "check_budget": "ablate.budget",
    "layer_quotas": "ablate.budget",
    "replay_count": "ablate.budget",
    "FisherTracker": "ablate.fisher",
    "PolicyError": "ablate.policies",
    "ReplayPolicy": "ablate.policies",
    "available_policies": "ablate.policies",
    "get_policy": "ablate.policies",
    "register_policy": "ablate.policies",
    "Routes": "ablate.routes",
    "RoutesError": "ablate.routes",
}

__all__ = [
    "BudgetError", "FisherTracker", "PolicyError", "ReplayPolicy", "Routes", "RoutesError", "available_policies",
    "check_budget", "get_policy", "layer_quotas", "register_policy", "replay_count",
]

if TYPE_CHECKING:
    from ablate.budget import BudgetError, check_budget, layer_quotas, replay_count
    from ablate.fisher import FisherTracker
    from ablate.policies import PolicyError, ReplayPolicy, available_policies, get_policy, register_policy
    from ablate.routes import Routes, RoutesError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ablate' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
