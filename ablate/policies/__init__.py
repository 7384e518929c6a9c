"""Replay policies: one interface, a registry (fed by entry points), six built-in selections, prime-rl's score gate."""

from ablate.policies.base import (
    ENTRY_POINT_GROUP,
    BudgetViolation,
    PolicyError,
    PolicyLook,
    ReplayPolicy,
    available_policies,
    fixed_budget_of,
    fixed_budget_policies,
    get_policy,
    load_plugins,
    policy_class,
    policy_look,
    register_policy,
    register_policy_options,
    replay_mask,
)
from ablate.policies.builtin import (
    FisherReplay,
    FullReplay,
    MismatchReplay,
    NoReplay,
    RandomReplay,
    UniformReplay,
)
from ablate.policies.selection import Draws
from ablate.policies.threshold import ThresholdReplay
from ablate.policies.spec import PolicySpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "BudgetViolation",
    "Draws",
    "FisherReplay",
    "FullReplay",
    "MismatchReplay",
    "NoReplay",
    "PolicyError",
    "PolicyLook",
    "PolicySpec",
    "RandomReplay",
    "ReplayPolicy",
    "ThresholdReplay",
    "UniformReplay",
    "available_policies",
    "fixed_budget_of",
    "fixed_budget_policies",
    "get_policy",
    "load_plugins",
    "policy_class",
    "policy_look",
    "register_policy",
    "register_policy_options",
    "replay_mask",
]
