"""``margin``: replay the routes whose native router is closest to a tie.

A route flips between the rollout engine and the trainer when their numerics differ by more
than the gap between the router's k-th and (k+1)-th score: the smaller that *margin*, the more
likely a mismatch. ``margin`` replays the n routes with the smallest native margin, a predictor of
mismatch that needs no oracle (``mismatch`` compares against the rollout routes themselves).

It needs native routes, so it declares ``needs_native_routes``: every backend then runs the pass
that records them (and their margins, ``Routes.native_margin``) before the mask is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ablate.config import BudgetedPolicyConfig
from ablate.policies import Draws, PolicyError, ReplayPolicy
from ablate.routes import Routes


@dataclass
class MarginSettings(BudgetedPolicyConfig):
    """``policy=margin``'s settings: ``per_layer`` (exact per-layer quotas), nothing else."""

    name: str = "margin"


class MarginReplay(ReplayPolicy):
    """The n routes with the smallest native margin (k-th minus (k+1)-th router score); ties at random."""

    Settings = MarginSettings
    needs_native_routes = True

    def __init__(self, *, per_layer: bool = False) -> None:
        super().__init__(per_layer=per_layer)

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor:
        if routes.native_margin is None:
            raise PolicyError("policy=margin needs native router margins: build Routes(..., native_margin=<[tokens, layers]>)")
        return -routes.native_margin[rows].float()  # larger key is replayed first: smallest margin first
