"""prime-rl's score gate (PR #2703) as a policy: full replay, each replayed expert kept where the trainer agrees.

The mask offers every valid route, as ``full``'s does; where the mask is applied, the trainer's
router scores decide slot by slot (:meth:`ThresholdReplay.gate`). That gate needs the scores at
the moment a route is applied, so it runs in the backend's MoE forward, never in the selection:
a backend that cannot run it refuses the policy (docs/policies.md, "Replay variants").
"""

from __future__ import annotations

import torch
from torch import Tensor

from ablate.config import GATE_RATIO, ThresholdPolicyConfig, is_gate_ratio
from ablate.policies.base import PolicyError, ReplayPolicy, register_policy
from ablate.policies.selection import Draws
from ablate.routes import Routes


@register_policy("threshold")
class ThresholdReplay(ReplayPolicy):
    """Replays every valid route, each replayed expert gated by the trainer's score for it.

    A replayed expert is kept only if the trainer's gate score for it is at least ``ratio`` times
    the trainer's weakest top-k score for the token; each rejected slot takes the trainer's own
    top-k expert that is not yet in the route, best first. ``ratio=0`` keeps every slot (full
    replay); ``ratio=1`` keeps only experts the trainer ranks in its own top-k, so no route
    differs from the native one. What it spends is what the gate lets through: the share of
    replayed slots handed back (``replay/replace_rate``) and of routes left changed
    (``replay/effective_budget``), not a budget the grid matches.
    """

    color = "#E69F00"  # Okabe-Ito orange
    marker = "P"
    Settings = ThresholdPolicyConfig
    fixed_budget = 1.0
    gates_slots = True

    def __init__(self, *, ratio: float = 0.5) -> None:
        super().__init__()
        if not is_gate_ratio(ratio):
            raise PolicyError(f"ratio={ratio!r} in policy=threshold: expected {GATE_RATIO}")
        self.ratio = float(ratio)

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor:
        raise AssertionError("unreachable: budget 1 offers every route")

    def gate(self, scores: Tensor, replayed: Tensor, native: Tensor) -> tuple[Tensor, Tensor]:
        """The experts a token's route uses, and how many replayed slots the gate handed back.

        ``scores`` ``[tokens, experts]`` are the trainer's gate scores (its router's softmax),
        ``replayed`` ``[tokens, topk]`` the replayed expert ids, ``native`` ``[tokens, topk]`` the
        trainer's own top-k, best first. Returns ``used`` ``[tokens, topk]`` (a kept expert stays in
        its slot) and ``replaced`` ``[tokens]``. Every expert of the trainer's top-k clears the bar
        (``ratio <= 1``), so the rejected ones are foreign to it and the refills never repeat a kept one.
        """
        bar = self.ratio * scores.gather(-1, native).amin(-1, keepdim=True)
        kept = scores.gather(-1, replayed) >= bar
        taken = ((native[:, :, None] == replayed[:, None, :]) & kept[:, None, :]).any(-1)
        # The native experts not kept, in the trainer's order: the j-th rejected slot takes the j-th.
        spare = native.gather(-1, taken.to(torch.uint8).argsort(dim=-1, stable=True))
        rank = ((~kept).cumsum(-1) - 1).clamp(min=0)
        return torch.where(kept, replayed, spare.gather(-1, rank)), (~kept).sum(-1)
