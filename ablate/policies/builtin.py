"""The six policies of DESIGN.md section 3."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ablate.budget import layer_quotas
from ablate.policies.base import PolicyError, ReplayPolicy, register_policy
from ablate.policies.selection import gumbel_noise, uniform_noise
from ablate.routes import Routes, token_chunks


@register_policy("none")
class NoReplay(ReplayPolicy):
    """Replays nothing: the training router routes every token natively (budget 0)."""

    def __init__(self) -> None:
        super().__init__()

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        raise AssertionError("unreachable: budget 0 selects no route")


@register_policy("full")
class FullReplay(ReplayPolicy):
    """R3: replays every valid route (budget 1)."""

    def __init__(self) -> None:
        super().__init__()

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        raise AssertionError("unreachable: budget 1 selects every route")


@register_policy("random")
class RandomReplay(ReplayPolicy):
    """n routes uniformly at random without replacement: the budget-only control."""

    def __init__(self, *, per_layer: bool = False) -> None:
        super().__init__(per_layer=per_layer)

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        return uniform_noise((rows.numel(), routes.num_layers), generator, routes.device)


@register_policy("uniform")
class UniformReplay(ReplayPolicy):
    """n routes spread evenly: an equal quota per layer, evenly spaced over the valid tokens.

    Systematic sampling: in layer l with quota q over V valid tokens, replay the tokens at
    ``floor((u_l + i) * V / q)`` for ``i < q``, with a seeded offset ``u_l ~ U[0, 1)`` per layer
    (independent offsets, so layers do not all replay the same tokens). It is always per layer.
    """

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def choose(self, routes: Routes, rows: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
        valid_tokens, layers = rows.numel(), routes.num_layers
        quotas = layer_quotas(n, layers, valid_tokens, device=routes.device)
        offsets = uniform_noise((layers,), generator, routes.device).double()
        slots = torch.arange(int(quotas.max()), device=routes.device, dtype=torch.float64)
        spacing = valid_tokens / quotas.clamp(min=1).double()
        positions = ((offsets[:, None] + slots[None, :]) * spacing[:, None]).floor().long()
        used = slots[None, :] < quotas[:, None]
        layer_ids = torch.arange(layers, device=routes.device)[:, None].expand_as(positions)
        chosen = torch.zeros(valid_tokens, layers, dtype=torch.bool, device=routes.device)
        chosen[positions[used], layer_ids[used]] = True
        return chosen

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        raise AssertionError("unreachable: uniform overrides choose()")


class FisherSource(Protocol):
    """What the fisher policy reads from a tracker (see :class:`ablate.fisher.FisherTracker`)."""

    @property
    def has_estimate(self) -> bool: ...

    def scores(self) -> Tensor: ...


@register_policy("fisher")
class FisherReplay(ReplayPolicy):
    """n routes with the highest Fisher score ``s(t, l) = sum_{e in rollout route} F[l, e]``.

    ``tau`` is a temperature: 0 takes the top n deterministically (ties at random); ``tau > 0``
    samples without replacement with probability proportional to ``s ** (1 / tau)`` by
    Gumbel-top-n on ``log(s) / tau``, so ``tau = 1`` samples proportionally to the Fisher score
    and ``tau -> inf`` becomes ``random``. Working on ``log s`` makes ``tau`` independent of the
    estimate's scale. Without an estimate (none given yet, or an empty tracker) the policy
    degrades to ``random`` and reports ``info["fisher_fallback"] = 1``.
    """

    def __init__(
        self,
        *,
        scores: Tensor | None = None,
        fisher: FisherSource | None = None,
        tau: float = 0.0,
        per_layer: bool = False,
    ) -> None:
        super().__init__(per_layer=per_layer)
        if scores is not None and fisher is not None:
            raise PolicyError("policy=fisher got both scores= and fisher=: expected one source of the Fisher estimate")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau) or tau < 0:
            raise PolicyError(f"tau={tau!r} in policy=fisher: expected a temperature >= 0")
        self.tau = float(tau)
        self.fisher = fisher
        self.fixed_scores = scores

    def current_scores(self) -> Tensor | None:
        """The ``[layers, experts]`` estimate this call ranks by, or None when none exists yet."""
        if self.fixed_scores is not None:
            return self.fixed_scores
        if self.fisher is not None and self.fisher.has_estimate:
            return self.fisher.scores()
        return None

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        estimate = self.current_scores()
        self.info["fisher_fallback"] = float(estimate is None)
        if estimate is None:
            return uniform_noise((rows.numel(), routes.num_layers), generator, routes.device)
        score = route_scores(estimate, routes)[rows]
        if self.tau == 0:
            return score
        return score.clamp(min=0).log() / self.tau + gumbel_noise(tuple(score.shape), generator, routes.device)


def route_scores(estimate: Tensor, routes: Routes) -> Tensor:
    """``[tokens, layers]`` Fisher score of each rollout route: ``sum_{e in route} F[l, e]``."""
    expected = (routes.num_layers, routes.num_experts)
    if tuple(estimate.shape) != expected:
        raise PolicyError(f"Fisher estimate has shape {tuple(estimate.shape)}: expected [layers, experts]={expected}")
    table = estimate.to(device=routes.device, dtype=torch.float32).reshape(-1, 1)
    # One bag of k (layer, expert) rows per route: embedding_bag sums the k scores in one fused
    # gather, over chunks of tokens, instead of k full-size int64 index tensors and gathers.
    layer_base = (torch.arange(routes.num_layers, device=routes.device, dtype=torch.int32) * routes.num_experts)[:, None]
    # Invalid tokens score 0 and their ids are never read: padding may hold any value.
    score = torch.zeros(routes.num_tokens, routes.num_layers, device=routes.device)
    for rows in token_chunks(routes.valid, routes.num_layers * routes.topk):
        bags = (routes.rollout[rows].to(torch.int32) + layer_base).reshape(-1, routes.topk)
        score[rows] = F.embedding_bag(bags, table, mode="sum").reshape(-1, routes.num_layers)
    return score


@register_policy("mismatch")
class MismatchReplay(ReplayPolicy):
    """Mismatched routes first, largest disagreement first; the rest of the budget at random.

    Disagreement is the number of rollout experts the native route lacks, ``k - |A and B|``.
    Needs native routes (from the old-log-prob pass): an oracle-like upper bound for "replay
    where it matters".
    """

    def __init__(self, *, per_layer: bool = False) -> None:
        super().__init__(per_layer=per_layer)

    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        if routes.native is None:
            raise PolicyError("policy=mismatch needs native routes: build Routes(..., native=<[tokens, layers, topk]>)")
        return (routes.topk - routes.native_overlap[rows]).float()
