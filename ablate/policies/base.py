"""The one interface every replay policy implements, and the registry that names them."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from ablate.budget import check_budget, count_for, layer_quotas
from ablate.policies.selection import top_n
from ablate.routes import Routes


class PolicyError(ValueError):
    """An unknown policy, an unknown policy setting, or inputs a policy cannot work with."""


class ReplayPolicy(ABC):
    """Maps (routes, budget, policy state, generator) to a replay mask ``[tokens, layers]``.

    Budget accounting is not the policy's business: :meth:`select` computes the count with the
    shared rule and asks the subclass only for a ranking of the valid routes (:meth:`route_keys`),
    then keeps the top ``n`` (or the top quota of each layer with ``per_layer=True``). That makes
    "same count for every policy" true by construction rather than by each policy's care.

    After each call, :attr:`info` holds policy-specific diagnostics of that call (for example
    ``fisher_fallback``).
    """

    name: ClassVar[str]

    def __init__(self, *, per_layer: bool = False) -> None:
        self.per_layer = bool(per_layer)
        self.info: dict[str, float] = {}

    def select(self, routes: Routes, budget: float | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        budget = check_budget(budget, self.name)
        self.info = {}
        n = count_for(budget, routes.num_valid_routes)
        if n == 0:
            return torch.zeros(routes.num_tokens, routes.num_layers, dtype=torch.bool, device=routes.device)
        if n == routes.num_valid_routes:
            return routes.valid_routes().clone()
        rows = routes.valid.nonzero().squeeze(1)
        chosen = self.choose(routes, rows, n, generator)
        if rows.numel() == routes.num_tokens:
            return chosen  # every token is valid: the valid rows are the mask itself
        mask = torch.zeros(routes.num_tokens, routes.num_layers, dtype=torch.bool, device=routes.device)
        return mask.index_copy_(0, rows, chosen)

    def choose(self, routes: Routes, rows: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
        """``[valid tokens, layers]`` bool with exactly ``n`` True, from :meth:`route_keys`."""
        keys = self.route_keys(routes, rows, generator)
        if not self.per_layer:
            return top_n(keys.reshape(-1), n, generator).reshape(keys.shape)
        quotas = layer_quotas(n, routes.num_layers, rows.numel()).tolist()
        return torch.stack([top_n(keys[:, layer], quota, generator) for layer, quota in enumerate(quotas)], dim=1)

    @abstractmethod
    def route_keys(self, routes: Routes, rows: Tensor, generator: torch.Generator | None) -> Tensor:
        """``[len(rows), layers]`` float ranking of the valid routes: larger is replayed first.

        ``rows`` are the indices of the valid tokens. Ties are broken uniformly at random.
        """

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "info")
        return f"{type(self).__name__}({settings})"


_REGISTRY: dict[str, type[ReplayPolicy]] = {}
P = TypeVar("P", bound=type[ReplayPolicy])


def register_policy(name: str):
    """Class decorator that makes a policy available to :func:`get_policy` under ``name``."""

    def decorate(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ReplayPolicy)):
            raise PolicyError(f"register_policy({name!r}) decorates {cls!r}: expected a ReplayPolicy subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise PolicyError(f"policy name {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **settings: Any) -> ReplayPolicy:
    """The registered policy ``name`` built with its own ``settings``; clear errors otherwise."""
    if name not in _REGISTRY:
        raise PolicyError(f"unknown policy {name!r}: expected one of {', '.join(available_policies())}")
    cls = _REGISTRY[name]
    accepted = [
        p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise PolicyError(
            f"policy={name} got unknown setting(s) {', '.join(unknown)}: expected "
            f"{', '.join(accepted) if accepted else 'no settings'}"
        )
    return cls(**settings)
