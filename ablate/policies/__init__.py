"""Replay policies: one interface, a registry, and the six built-in selections."""

from ablate.policies.base import PolicyError, ReplayPolicy, available_policies, get_policy, register_policy
from ablate.policies.selection import Draws
from ablate.policies.builtin import (
    FisherReplay,
    FullReplay,
    MismatchReplay,
    NoReplay,
    RandomReplay,
    UniformReplay,
    route_scores,
)
from ablate.policies.spec import PolicySpec

__all__ = [
    "Draws",
    "FisherReplay",
    "FullReplay",
    "MismatchReplay",
    "NoReplay",
    "PolicyError",
    "PolicySpec",
    "RandomReplay",
    "ReplayPolicy",
    "UniformReplay",
    "available_policies",
    "get_policy",
    "register_policy",
    "route_scores",
]
