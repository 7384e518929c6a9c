"""ablate: routing-replay ablations for Mixture-of-Experts RL.

Does replaying the inference engine's routes help, and is it the *budget* (how many routes are
replayed) or the *selection* (which ones) that helps?
"""

from ablate.budget import BudgetError, check_budget, layer_quotas, replay_count
from ablate.fisher import FisherTracker
from ablate.policies import PolicyError, ReplayPolicy, available_policies, get_policy, register_policy
from ablate.routes import Routes, RoutesError

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "FisherTracker",
    "PolicyError",
    "ReplayPolicy",
    "Routes",
    "RoutesError",
    "available_policies",
    "check_budget",
    "get_policy",
    "layer_quotas",
    "register_policy",
    "replay_count",
]
