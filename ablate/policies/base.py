"""The one interface every replay policy implements, and the registry that names them."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from ablate.budget import Quotas, check_budget, global_quotas, per_sequence_quotas
from ablate.policies.selection import Draws, segmented_top_n, top_n
from ablate.routes import Routes

#: What ``select`` accepts as ``generator``: one generator, one per sequence, or None (torch's global RNG).
Generators = torch.Generator | Sequence[torch.Generator] | None


class PolicyError(ValueError):
    """An unknown policy, an unknown policy setting, or inputs a policy cannot work with."""


class ReplayPolicy(ABC):
    """Maps (routes, budget, policy state, generator) to a replay mask ``[tokens, layers]``.

    Budget accounting is not the policy's business: :meth:`select` computes the counts with the
    shared rule (:mod:`ablate.budget`) and asks the subclass only for a ranking of the valid
    routes (:meth:`route_keys`), then keeps the top ``n`` of each group (or the top quota of each
    layer with ``per_layer=True``). That makes "same count for every policy" true by
    construction rather than by each policy's care.

    After each call, :attr:`info` holds policy-specific diagnostics of that call (for example
    ``fisher_fallback``).
    """

    name: ClassVar[str]

    def __init__(self, *, per_layer: bool = False) -> None:
        self.per_layer = bool(per_layer)
        self.info: dict[str, float] = {}

    def select(
        self, routes: Routes, budget: float | None = None, *, generator: Generators = None, per_sequence: bool = False
    ) -> Tensor:
        """``[tokens, layers]`` bool replay mask, never True on an invalid token.

        Global mode (``per_sequence=False``): exactly ``n = floor(b * N + 0.5)`` of the batch's
        ``N`` valid routes (with ``per_layer``, exact per-layer quotas), random draws from the one
        ``generator``.

        Per-sequence mode (``per_sequence=True``, needs ``routes.offsets``): exactly
        ``n_s = floor(b * N_s + 0.5)`` routes within each sequence ``s`` (with ``per_layer``,
        exact per-layer quotas within each sequence, the remainder's layers rotated by a draw
        from the sequence's generator). ``generator`` may be a list of one ``torch.Generator`` per
        sequence: every random draw about sequence ``s`` (noise keys, tie breaks, ``uniform``'s
        offsets, the quota rotation) then comes from ``generator[s]``, so **the mask of a sequence
        is bit-identical whether it is selected alone or inside any batch of other sequences**,
        for every policy (given the same policy state, e.g. the same Fisher estimate). With a
        single generator the draws of all sequences come from it in order, and a sequence's mask
        depends on the sequences before it. The whole batch is selected in one batched pass:
        one segmented top-n over all sequences.

        Same inputs and generator states give the same mask, bit for bit.
        """
        budget = check_budget(budget, self.name)
        self.info = {}
        generators = self._generators(generator, routes, per_sequence)
        empty = torch.zeros(routes.num_tokens, routes.num_layers, dtype=torch.bool, device=routes.device)
        if per_sequence:
            # Only the budget decides these shortcuts, never the batch: a sequence draws the same
            # random numbers alone and in any batch.
            if budget == 0:
                return empty
            if budget == 1:
                return routes.valid_routes().clone()
            bounds = routes.valid_offsets.tolist()
            draws = Draws(generators, bounds, routes.num_layers, routes.device)
            quotas = per_sequence_quotas(budget, routes, layer_shifts=draws.layer_shifts() if self.per_layer else None)
        else:
            quotas = global_quotas(budget, routes, per_layer=self.per_layer)
            if quotas.total == 0:
                return empty
            if quotas.total == routes.num_valid_routes:
                return routes.valid_routes().clone()
            draws = Draws(generators, quotas.bounds, routes.num_layers, routes.device)
        rows = routes.valid.nonzero().squeeze(1)
        chosen = self.choose(routes, rows, quotas, draws)
        if rows.numel() == routes.num_tokens:
            return chosen  # every token is valid: the valid rows are the mask itself
        return empty.index_copy_(0, rows, chosen)

    def _generators(self, generator: Generators, routes: Routes, per_sequence: bool) -> list[torch.Generator | None]:
        """One generator per group of :class:`~ablate.budget.Quotas`, or a clear error."""
        where = f"in policy={self.name}"
        if per_sequence and routes.offsets is None:
            raise PolicyError(
                f"per_sequence=True {where} needs sequence boundaries: build Routes(..., offsets=<[sequences + 1]>) "
                "or Routes.from_verl"
            )
        if isinstance(generator, Sequence):
            if not per_sequence:
                raise PolicyError(
                    f"generator is a {type(generator).__name__} of {len(generator)} {where}: one generator per sequence "
                    "needs per_sequence=True"
                )
            if len(generator) != routes.num_sequences:
                raise PolicyError(
                    f"generator lists {len(generator)} generators {where}: expected one per sequence, "
                    f"{routes.num_sequences} (from routes.offsets)"
                )
            for index, item in enumerate(generator):
                if not isinstance(item, torch.Generator):
                    raise PolicyError(f"generator[{index}] is a {type(item).__name__} {where}: expected a torch.Generator")
            devices = {item.device for item in generator}
            if len(devices) > 1:
                raise PolicyError(f"generators {where} are on {sorted(map(str, devices))}: expected one device")
            return list(generator)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise PolicyError(f"generator is a {type(generator).__name__} {where}: expected a torch.Generator, a list of them, or None")
        return [generator] * (routes.num_sequences if per_sequence else 1)

    def choose(self, routes: Routes, rows: Tensor, quotas: Quotas, draws: Draws) -> Tensor:
        """``[valid tokens, layers]`` bool with exactly ``quotas.counts`` True per group, from :meth:`route_keys`."""
        keys = self.route_keys(routes, rows, draws)
        if quotas.per_sequence:
            return segmented_top_n(keys, quotas, draws)
        if keys is None:
            keys = draws.uniform()
        if not quotas.per_layer:
            return top_n(keys.reshape(-1), quotas.total, draws.generator).reshape(keys.shape)
        layer_counts = quotas.counts[0].tolist()
        return torch.stack([top_n(keys[:, layer], count, draws.generator) for layer, count in enumerate(layer_counts)], dim=1)

    @abstractmethod
    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor | None:
        """``[len(rows), layers]`` float ranking of the valid routes: larger is replayed first.

        ``rows`` are the indices of the valid tokens, in order. Any randomness comes from
        ``draws`` (:meth:`Draws.uniform`, :meth:`Draws.gumbel`), which gives each sequence's
        routes their own generator's numbers. Ties are broken uniformly at random by the caller.
        Return None when every valid route is equally good: the selection is then uniformly
        random, drawn the cheapest way.
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
