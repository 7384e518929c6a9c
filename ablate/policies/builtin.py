"""The six policies of docs/design.md section 3."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from ablate.budget import Quotas
from ablate.config import TEMPERATURE, BudgetedPolicyConfig, FisherPolicyConfig, is_temperature
from ablate.fisher import FisherError, route_scores
from ablate.policies.base import PolicyError, ReplayPolicy, register_policy
from ablate.policies.selection import Draws
from ablate.routes import Routes


@register_policy("none")
class NoReplay(ReplayPolicy):
    """Replays nothing: the training router routes every token natively (budget 0)."""

    color = "#000000"  # Okabe-Ito black
    marker = "o"
    fixed_budget = 0.0

    def __init__(self) -> None:
        super().__init__()

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor:
        raise AssertionError("unreachable: budget 0 selects no route")


@register_policy("full")
class FullReplay(ReplayPolicy):
    """R3: replays every valid route (budget 1)."""

    color = "#CC79A7"  # Okabe-Ito reddish purple
    marker = "o"
    fixed_budget = 1.0

    def __init__(self) -> None:
        super().__init__()

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor:
        raise AssertionError("unreachable: budget 1 selects every route")


@register_policy("random")
class RandomReplay(ReplayPolicy):
    """n routes uniformly at random without replacement: the budget-only control."""

    color = "#0072B2"  # Okabe-Ito blue
    marker = "o"
    Settings = BudgetedPolicyConfig

    def __init__(self, *, per_layer: bool = False) -> None:
        super().__init__(per_layer=per_layer)

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> None:
        return None  # no preference: the tie breaks decide, uniformly at random


@register_policy("uniform")
class UniformReplay(ReplayPolicy):
    """n routes spread evenly over layers, sequences and positions: the low-noise control.

    Always per layer: each layer gets its exact quota (:func:`ablate.budget.layer_quotas`). Within a
    layer the quota is stratified by sequence (``Routes.offsets``), in two stages:

    1. *Sequences.* In the per-sequence mode each sequence has its own quotas. In the global mode
       layer ``l``'s quota ``q`` is allocated to sequences by systematic sampling over their valid
       tokens: sequence ``s`` gets ``floor`` or ``ceil`` of ``q * V_s / V``, with a random start per
       layer deciding which sequences round up.
    2. *Positions.* A sequence with ``c`` routes to replay in layer ``l`` among its ``V_s`` valid
       tokens replays valid positions ``floor((i * V_s + w) / c)`` for ``i < c``, with an offset
       ``w`` drawn uniformly from ``[0, V_s)`` independently for every (sequence, layer).

    Every valid route of a layer is thus replayed with probability exactly ``q / V`` (``n_s / N_s``
    in the per-sequence mode, whose layer quotas rotate); positions within a sequence are evenly
    spaced, and because the offsets are independent per sequence and layer, no position is
    favoured: the spacing never carries over from one sequence to the next, so it cannot lock onto
    the sequence length (which systematic sampling over the flattened batch does). Integer
    arithmetic keeps the positions exact on every device.

    Routes without ``offsets`` have no sequences to stratify on: each layer's quota is then a
    simple random sample of its valid tokens (the top quota of uniform random keys). Pass
    ``offsets`` (``Routes.from_verl`` does) to get the stratified control.
    """

    color = "#56B4E9"  # Okabe-Ito sky blue
    marker = "s"

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def choose(self, routes: Routes, rows: Tensor, quotas: Quotas, draws: Draws) -> Tensor:
        layers = routes.num_layers
        if quotas.per_sequence:
            cells = quotas.counts
            bounds = routes.valid_offsets
            offsets = draws.uniform64(layers)
        elif routes.valid_offsets is None:
            return super().choose(routes, rows, quotas, draws)
        else:
            bounds = routes.valid_offsets
            starts = draws.uniform64(layers)[0]
            offsets = draws.uniform64(bounds.shape[0] - 1, layers)[0]
            cells = allocate_to_sequences(quotas.counts[0], bounds, starts)
        return spread_in_sequences(cells, bounds, offsets, rows.numel(), int(quotas.host_counts.sum()))

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> None:
        return None  # without sequence boundaries: a simple random sample per layer


def allocate_to_sequences(layer_quotas: Tensor, bounds: Tensor, starts: Tensor) -> Tensor:
    """``[sequences, layers]``: each layer's quota split over sequences by systematic sampling.

    In units of ``1 / q`` token, valid token ``t`` covers ``[t * q, (t + 1) * q)`` and the sample
    points are ``j * V + w`` for ``j < q`` with ``w = floor(start * V)``: each token is hit with
    probability ``q / V`` exactly, and sequence ``s`` (valid tokens ``bounds[s]:bounds[s + 1]``)
    receives the points in its range, ``floor`` or ``ceil`` of ``q * V_s / V``.
    """
    total = int(bounds[-1])
    q = layer_quotas.to(bounds.device)
    w = _offset_below(starts.to(bounds.device), torch.tensor(total, device=bounds.device))
    # Points below token boundary C: j * V + w < C * q, i.e. ceil((C * q - w) / V), clamped to [0, q].
    below = (bounds[:, None] * q[None, :] - w[None, :] + total - 1).div(total, rounding_mode="floor")
    below = torch.minimum(below.clamp(min=0), q[None, :])
    return below.diff(dim=0)


def spread_in_sequences(cells: Tensor, bounds: Tensor, offsets: Tensor, valid_tokens: int, total: int) -> Tensor:
    """``[valid tokens, layers]`` mask replaying ``cells[s, l]`` evenly spaced positions of sequence ``s``
    (``total`` of them, known on the host).

    The positions are ``floor((i * V_s + w) / c)`` for ``i < c = cells[s, l]``, with
    ``w = floor(offsets[s, l] * V_s)``: spaced by ``V_s / c >= 1``, so distinct, and each valid
    token of the sequence is replayed with probability ``c / V_s``.
    """
    layers = cells.shape[1]
    device = bounds.device
    counts = cells.to(device).reshape(-1)
    sizes = bounds.diff()
    cell = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=total)
    i = torch.arange(cell.shape[0], device=device) - (torch.cumsum(counts, 0) - counts)[cell]
    sequence, layer = cell.div(layers, rounding_mode="floor"), cell % layers
    size = sizes[sequence]
    w = _offset_below(offsets.to(device).reshape(-1), sizes.repeat_interleave(layers))[cell]
    position = (i * size + w).div(counts[cell], rounding_mode="floor")
    chosen = torch.zeros(valid_tokens, layers, dtype=torch.bool, device=device)
    chosen[bounds[sequence] + position, layer] = True
    return chosen


def _offset_below(uniform: Tensor, size: Tensor) -> Tensor:
    """``floor(u * size)`` as int64 in ``[0, size)`` (0 for empty sizes): a uniform integer offset."""
    return torch.minimum((uniform * size).floor().long(), (size - 1).clamp(min=0))


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
    estimate's scale.

    Without a usable estimate the policy degrades to ``random`` and reports
    ``info["fisher_fallback"] = 1``: before the tracker's first step, and whenever the estimate
    holds a non-finite entry or no positive one (all routes would tie, which is random selection
    under another name).

    ``scores`` (a fixed ``[layers, experts]`` estimate) is checked when the policy is built:
    finite, non-negative, rank 2. Its ``[layers, experts]`` must match the routes; that, and a
    tracker's shape, is checked at :meth:`select`, where the routes are known.
    """

    color = "#D55E00"  # Okabe-Ito vermillion
    marker = "^"
    Settings = FisherPolicyConfig
    reads_fisher = True

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
        if not is_temperature(tau):
            raise PolicyError(f"tau={tau!r} in policy=fisher: expected {TEMPERATURE}")
        if fisher is not None and not (hasattr(fisher, "has_estimate") and callable(getattr(fisher, "scores", None))):
            raise PolicyError(
                f"fisher={type(fisher).__name__} in policy=fisher: expected a Fisher source with has_estimate and "
                "scores() (an ablate.FisherTracker)"
            )
        self.tau = float(tau)
        self.fisher = fisher
        self.fixed_scores = None if scores is None else _checked_scores(scores)
        #: The last estimate read and whether it was usable (a tracker's is the same tensor for a step).
        self._usable: tuple[Tensor, int, bool] | None = None

    def current_scores(self) -> Tensor | None:
        """The ``[layers, experts]`` estimate this call ranks by, or None when there is no usable one."""
        if self.fixed_scores is not None:
            estimate = self.fixed_scores
        elif self.fisher is not None and self.fisher.has_estimate:
            estimate = self.fisher.scores()
        else:
            return None
        known = self._usable
        if known is None or known[0] is not estimate or known[1] != estimate._version:
            values = estimate.detach().cpu().numpy()  # [layers, experts]: read once per estimate, not per selection
            usable = bool(np.isfinite(values).all() and (values > 0).any())
            known = self._usable = (estimate, estimate._version, usable)
        return estimate if known[2] else None

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor | None:
        estimate = self.current_scores()
        self.info["fisher_fallback"] = float(estimate is None)
        if estimate is None:
            return None  # random selection
        try:
            score = route_scores(estimate, routes)[rows]
        except FisherError as error:  # an estimate of another model: the policy's input is wrong
            raise PolicyError(f"policy={self.name}: {error}") from None
        if self.tau == 0:
            return score
        return score.clamp(min=0).log() / self.tau + draws.gumbel()


def _checked_scores(scores: object) -> Tensor:
    """A fixed Fisher estimate, or an error naming what is wrong with it."""
    if not isinstance(scores, Tensor):
        raise PolicyError(f"scores is a {type(scores).__name__} in policy=fisher: expected a torch.Tensor [layers, experts]")
    if scores.dim() != 2 or 0 in scores.shape:
        raise PolicyError(f"scores has shape {tuple(scores.shape)} in policy=fisher: expected [layers, experts]")
    if scores.dtype == torch.bool or scores.dtype.is_complex:
        raise PolicyError(f"scores has dtype {scores.dtype} in policy=fisher: expected real Fisher scores")
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        layer, expert = (~finite).nonzero()[0].tolist()
        raise PolicyError(
            f"scores[{layer}, {expert}]={float(scores[layer, expert])} in policy=fisher: expected finite Fisher scores"
        )
    if bool((scores < 0).any()):
        layer, expert = (scores < 0).nonzero()[0].tolist()
        raise PolicyError(
            f"scores[{layer}, {expert}]={float(scores[layer, expert])} in policy=fisher: expected non-negative Fisher "
            "scores (expected squared gradients)"
        )
    return scores


@register_policy("mismatch")
class MismatchReplay(ReplayPolicy):
    """Mismatched routes first, largest disagreement first; the rest of the budget at random.

    Disagreement is the number of rollout experts the native route lacks, ``k - |A and B|``.
    Needs native routes (from the old-log-prob pass): an oracle-like upper bound for "replay
    where it matters".
    """

    color = "#009E73"  # Okabe-Ito bluish green
    marker = "D"
    Settings = BudgetedPolicyConfig
    needs_native_routes = True

    def __init__(self, *, per_layer: bool = False) -> None:
        super().__init__(per_layer=per_layer)

    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor:
        if routes.native is None:
            raise PolicyError("policy=mismatch needs native routes: build Routes(..., native=<[tokens, layers, topk]>)")
        return (routes.topk - routes.native_overlap[rows]).float()
