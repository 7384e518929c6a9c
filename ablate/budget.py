"""Budget accounting shared by every policy (docs/design.md section 2).

A policy never decides how many routes it replays: this module does, so that every policy
replays exactly the same number of routes for the same batch and budget. That equality is what
lets an ablation attribute a difference between policies to the *selection* alone.

Two modes count the same rule ``n = floor(b * N + 0.5)`` over different groups of routes:

- global: over the ``N`` valid routes of the whole batch;
- per sequence: over the ``N_s`` valid routes of each sequence ``s`` (``Routes.offsets``), so
  each sequence replays ``n_s = floor(b * N_s + 0.5)`` routes whatever batch it sits in. verl
  batches the same sequences differently in its old-log-prob and update passes; counting per
  sequence keeps every pass on identical routes.

``per_layer`` further splits each group's count into exact per-layer quotas (:func:`layer_quotas`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ablate.routes import Routes

def budget_label(budget: float) -> str:
    """A budget as text that tells every two distinct budgets apart: ``0.25``, ``1``, ``0.999999999``.

    Six significant digits (``:g``) where they read back as the same number, so common budgets
    keep their short names; otherwise the shortest text that does (``repr``), so that 0.999999999,
    0.9999999999999999 and 1 never share a cell name or a table row.
    """
    short = f"{budget:g}"
    return short if float(short) == budget else repr(float(budget))


class BudgetError(ValueError):
    """A budget that is not a fraction in [0, 1], or that contradicts its policy."""


def check_budget(budget: float | None, policy: str | None = None, *, fixed: float | None = None) -> float:
    """The budget as a float in [0, 1], or a clear error.

    A policy with a budget by definition (``fixed``: ``none`` has 0, ``full`` 1, see
    ``ReplayPolicy.fixed_budget``): ``None`` resolves to it, the same value is accepted, any other
    value is a caller bug and raises. ``policy`` only names the policy in the message.
    """
    where = f" in policy={policy}" if policy else ""
    if fixed is not None:
        if budget is None:
            return fixed
        value = _as_fraction(budget, where)
        if value != fixed:
            raise BudgetError(
                f"budget={budget!r}{where}: policy {policy!r} replays {'nothing' if fixed == 0 else 'every route'} "
                f"by definition, so its budget is {fixed:g}; omit the budget or pass {fixed:g}"
            )
        return fixed
    if budget is None:
        raise BudgetError(f"budget=None{where}: expected a fraction in [0, 1], e.g. budget=0.25")
    return _as_fraction(budget, where)


def _as_fraction(budget: object, where: str) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise BudgetError(f"budget={budget!r}{where}: expected a fraction in [0, 1], got a {type(budget).__name__}")
    value = float(budget) + 0.0  # budget=-0.0 is budget=0: one cell, one identity
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise BudgetError(f"budget={budget!r}{where}: expected a fraction in [0, 1]")
    return value


def count_for(budget: float, num_routes: int) -> int:
    """``n = floor(b * N + 0.5)``: round half up, the same integer for every policy.

    ``budget`` is a settled one (:meth:`ablate.policies.ReplayPolicy.resolve_budget`).
    """
    return min(num_routes, math.floor(budget * num_routes + 0.5))


def sequence_counts(budget: float, valid_tokens: Tensor, num_layers: int) -> Tensor:
    """``[sequences]`` counts ``n_s = floor(b * N_s + 0.5)`` with ``N_s = valid_tokens[s] * num_layers``.

    Computed in float64, the arithmetic of :func:`count_for`, so ``n_s`` equals
    ``count_for(budget, N_s)`` exactly for every sequence.
    """
    routes = valid_tokens.to(torch.float64) * num_layers
    return torch.minimum(torch.floor(budget * routes + 0.5), routes).long()


def replay_count(budget: float, routes: Routes | int, *, per_layer: bool = False, per_sequence: bool = False) -> int:
    """Number of routes replayed at ``budget`` over the valid routes of ``routes``.

    ``routes`` may also be the number of valid routes ``N`` itself. With ``per_layer=True`` the
    count is split into exact per-layer quotas (:func:`layer_quotas`); since every layer has the
    same valid tokens, the quotas always add up to the same ``n``, so both modes replay equally
    many routes and can be compared. With ``per_sequence=True`` it is the sum of the
    per-sequence counts ``n_s`` (which may differ from the global ``n`` by rounding).
    """
    budget = _as_fraction(budget, "")  # a budget of no policy: only the range to check
    if per_sequence:
        if isinstance(routes, int) or routes.valid_offsets is None:
            raise BudgetError("per_sequence=True counts within sequences: expected Routes with offsets")
        return int(sequence_counts(budget, routes.valid_offsets.diff(), routes.num_layers).sum())
    num_routes = routes if isinstance(routes, int) else routes.num_valid_routes
    n = count_for(budget, num_routes)
    if per_layer and not isinstance(routes, int):
        return int(layer_quotas(n, routes.num_layers, routes.num_valid_tokens).sum())
    return n


def layer_quotas(n: int, num_layers: int, valid_tokens: int, device: torch.device | str = "cpu") -> Tensor:
    """Split ``n`` routes into per-layer quotas, exactly and deterministically.

    Every layer gets ``n // L``; the remainder ``r = n % L`` goes one each to the layers at
    ``floor((i + 0.5) * L / r)`` for ``i = 0..r-1``, i.e. spread evenly over depth rather than
    piled on the first layers, so no part of the network is systematically favoured.
    """
    if not 0 <= n <= num_layers * valid_tokens:
        raise BudgetError(f"n={n} routes: expected between 0 and layers * valid tokens = {num_layers * valid_tokens}")
    counts = torch.tensor([n], dtype=torch.long, device=device)
    return sequence_layer_quotas(counts, num_layers, torch.zeros_like(counts))[0]


def sequence_layer_quotas(counts: Tensor, num_layers: int, shifts: Tensor) -> Tensor:
    """``[sequences, layers]`` quotas: :func:`layer_quotas` of each ``counts[s]``, rotated by ``shifts[s]``.

    Sequence ``s``'s remainder goes to layers ``(floor((i + 0.5) * L / r) + shifts[s]) mod L``.
    In the per-sequence mode the shifts are drawn from each sequence's generator: remainders are
    a large share of a short sequence's quota, and a fixed rule would hand the same layers the
    extra route in every sequence, favouring them over the whole run.
    """
    base, remainder = counts // num_layers, counts % num_layers
    quotas = base[:, None].repeat(1, num_layers)
    # The output's size given: on a GPU, repeat_interleave would read it from the device otherwise.
    sequence = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), remainder,
                                       output_size=int(remainder.sum().tolist()))
    first = torch.cumsum(remainder, 0) - remainder
    i = torch.arange(sequence.shape[0], device=counts.device) - first[sequence]
    # floor((i + 0.5) * L / r) in integers: exact, and the same on every device.
    layer = ((2 * i + 1) * num_layers // (2 * remainder[sequence]) + shifts[sequence]) % num_layers
    return quotas.index_put_((sequence, layer), torch.ones_like(layer), accumulate=True)


@dataclass(frozen=True)
class Quotas:
    """How many routes one ``select`` call replays, and within which groups of valid routes.

    Attributes:
        counts: ``[groups]``, or ``[groups, layers]`` with per-layer quotas. A group is the whole
            batch in the global mode (one group) or one sequence in the per-sequence mode.
        bounds: ``groups + 1`` boundaries of each group among the valid tokens
            (``valid.nonzero()``): group ``g`` owns valid tokens ``bounds[g]:bounds[g + 1]``.
        per_sequence: whether the groups are the batch's sequences.
    """

    counts: Tensor
    bounds: list[int]
    per_sequence: bool

    @property
    def per_layer(self) -> bool:
        return self.counts.dim() == 2

    @property
    def host_counts(self) -> np.ndarray:
        """:attr:`counts` on the host (read from the device once, where they are on one)."""
        return self.counts.cpu().numpy()

    @property
    def total(self) -> int:
        return int(self.host_counts.sum())


def global_quotas(budget: float, routes: Routes, *, per_layer: bool) -> Quotas:
    """One group: the ``n`` of :func:`count_for`, split by :func:`layer_quotas` with ``per_layer``."""
    n = count_for(budget, routes.num_valid_routes)
    valid_tokens = routes.num_valid_tokens
    if per_layer:
        counts = layer_quotas(n, routes.num_layers, valid_tokens, device=routes.device)[None]
    else:
        counts = torch.tensor([n], device=routes.device)
    return Quotas(counts=counts, bounds=[0, valid_tokens], per_sequence=False)


def per_sequence_quotas(budget: float, routes: Routes, *, layer_shifts: Tensor | None) -> Quotas:
    """One group per sequence: ``n_s`` of :func:`sequence_counts`, split per layer when ``layer_shifts`` is given.

    Where the host knows each sequence's valid tokens (``routes.host``) the counts are computed on
    the host, in the same float64 arithmetic: planning the selection then reads nothing of the device.
    """
    if routes.valid_offsets is None:
        raise BudgetError("per-sequence budgets need sequence boundaries: build Routes(..., offsets=<[sequences + 1]>)")
    bounds = routes.valid_bounds
    valid_tokens = torch.tensor(bounds).diff() if routes.host is not None else routes.valid_offsets.diff()
    counts = sequence_counts(budget, valid_tokens, routes.num_layers)
    if layer_shifts is not None:
        counts = sequence_layer_quotas(counts, routes.num_layers, layer_shifts.to(counts.device))
    return Quotas(counts=counts, bounds=bounds, per_sequence=True)
