"""Budget accounting shared by every policy (DESIGN.md section 2).

A policy never decides how many routes it replays: this module does, so that every policy
replays exactly the same number of routes for the same batch and budget. That equality is what
lets an ablation attribute a difference between policies to the *selection* alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ablate.routes import Routes

#: Policies whose budget is fixed by definition, with that budget.
FIXED_BUDGETS = {"none": 0.0, "full": 1.0}


class BudgetError(ValueError):
    """A budget that is not a fraction in [0, 1], or that contradicts its policy."""


def check_budget(budget: float | None, policy: str | None = None) -> float:
    """The budget as a float in [0, 1], or a clear error.

    ``none`` and ``full`` have a budget by definition (0 and 1): ``None`` resolves to it, the same
    value is accepted, any other value is a caller bug and raises.
    """
    where = f" in policy={policy}" if policy else ""
    if policy in FIXED_BUDGETS:
        fixed = FIXED_BUDGETS[policy]
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
    value = float(budget)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise BudgetError(f"budget={budget!r}{where}: expected a fraction in [0, 1]")
    return value


def count_for(budget: float, num_routes: int) -> int:
    """``n = floor(b * N + 0.5)``: round half up, the same integer for every policy."""
    return min(num_routes, math.floor(check_budget(budget) * num_routes + 0.5))


def replay_count(budget: float, routes: Routes | int, *, per_layer: bool = False) -> int:
    """Number of routes replayed at ``budget`` over the valid routes of ``routes``.

    ``routes`` may also be the number of valid routes ``N`` itself. With ``per_layer=True`` the
    count is split into exact per-layer quotas (:func:`layer_quotas`); since every layer has the
    same valid tokens, the quotas always add up to the same ``n``, so both modes replay equally
    many routes and can be compared.
    """
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
    base, remainder = divmod(n, num_layers)
    quotas = torch.full((num_layers,), base, dtype=torch.long, device=device)
    if remainder:
        extra = ((torch.arange(remainder, dtype=torch.float64) + 0.5) * num_layers / remainder).floor().long()
        quotas[extra.to(device)] += 1
    return quotas
