"""Exact top-n selection and seeded randomness, shared by the budgeted policies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ablate.budget import Quotas
from ablate.routes import sequence_chunks


def permutation(size: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    if generator is None:
        return torch.randperm(size, device=device)
    return torch.randperm(size, generator=generator, device=generator.device).to(device)


def gumbel(uniform: Tensor) -> Tensor:
    """Standard Gumbel noise from U[0, 1) noise (in place)."""
    return uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_().log_().neg_()


class Draws:
    """Every random draw of one ``select`` call, group by group.

    A group is a run of valid tokens with its own generator: the whole batch in the global mode,
    one sequence in the per-sequence mode (``Quotas.bounds``). Each method draws, for each group in
    order, from that group's generator on the generator's own device, then moves the concatenation
    to the routes' device once: a mask is bit-identical for a given seed whichever device the
    routes live on, and a CPU generator can drive CUDA routes. So every random number about a
    sequence's routes (noise keys, tie breaks, ``uniform``'s offsets, the rotation of its layer
    quotas) comes from that sequence's generator, and is the same whichever other sequences
    share the batch.

    A policy's :meth:`~ablate.policies.ReplayPolicy.route_keys` draws its noise through
    :meth:`uniform` or :meth:`gumbel`, never from a generator of its own.
    """

    def __init__(self, generators: Sequence[torch.Generator | None], bounds: list[int], num_layers: int, device: torch.device):
        if len(generators) != len(bounds) - 1:
            raise ValueError(f"{len(generators)} generators for {len(bounds) - 1} groups: expected one per group")
        self.generators = list(generators)
        self.bounds = bounds
        self.sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        self.num_layers = num_layers
        self.device = device

    @property
    def generator(self) -> torch.Generator | None:
        """The generator of the global mode (one group)."""
        if len(self.generators) != 1:
            raise ValueError(f"{len(self.generators)} groups have a generator each: there is no single generator")
        return self.generators[0]

    def _each(self, draw: Callable[[torch.Generator | None, int, torch.device], Tensor], first: int = 0, last: int | None = None) -> Tensor:
        """``draw(generator, group, device)`` for groups ``first..last-1`` in order, concatenated."""
        parts = []
        for group in range(first, len(self.generators) if last is None else last):
            generator = self.generators[group]
            parts.append(draw(generator, group, self.device if generator is None else generator.device))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device)

    def uniform(self) -> Tensor:
        """``[valid tokens, layers]`` U[0, 1) float32 noise, one number per valid route."""
        return self._each(lambda g, group, device: torch.rand((self.sizes[group], self.num_layers), generator=g, device=device))

    def gumbel(self) -> Tensor:
        """``[valid tokens, layers]`` standard Gumbel noise, one number per valid route."""
        return gumbel(self.uniform())

    def uniform64(self, *shape: int) -> Tensor:
        """``[groups, *shape]`` U[0, 1) float64 noise: ``shape`` numbers per group."""
        return self._each(lambda g, group, device: torch.rand((1, *shape), generator=g, device=device, dtype=torch.float64))

    def layer_shifts(self) -> Tensor:
        """``[groups]`` int64 in ``[0, layers)``: the rotation of each group's layer quotas."""
        return self._each(lambda g, group, device: torch.randint(self.num_layers, (1,), generator=g, device=device))

    def route_orders(self, first: int, last: int) -> Tensor:
        """A random order of the valid routes of groups ``first..last-1``, each group shuffled alone.

        Flat indices into those groups' ``[tokens, layers]`` routes, counted from the first
        group's first route; group ``g``'s routes stay in its own index range.
        """

        def shuffle(g: torch.Generator | None, group: int, device: torch.device) -> Tensor:
            order = torch.randperm(self.sizes[group] * self.num_layers, generator=g, device=device)
            return order.add_((self.bounds[group] - self.bounds[first]) * self.num_layers)

        return self._each(shuffle, first, last)


def top_n(keys: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """Boolean mask of the ``n`` largest entries of a 1-D ``keys``, exactly ``n`` of them.

    Ties at the threshold are broken uniformly at random with ``generator``, so a policy whose
    scores are coarse (a one-hot Fisher estimate, integer disagreement counts) still replays
    exactly its budget without favouring low token indices. NaN keys rank below everything.
    Runs in linear time (``kthvalue``) instead of sorting.
    """
    size = keys.numel()
    if n <= 0:
        return torch.zeros(size, dtype=torch.bool, device=keys.device)
    if n >= size:
        return torch.ones(size, dtype=torch.bool, device=keys.device)
    keys = torch.nan_to_num(keys.float(), nan=-torch.inf)
    threshold = torch.kthvalue(keys, size - n + 1).values
    chosen = keys > threshold
    missing = n - int(chosen.sum())
    tied = (keys == threshold).nonzero().squeeze(1)
    if missing == tied.numel():
        chosen[tied] = True
    else:
        chosen[tied[permutation(tied.numel(), generator, keys.device)[:missing]]] = True
    return chosen


def descending_sort_keys(keys: Tensor) -> Tensor:
    """int64 in ``[0, 2^32)`` whose ascending order is the descending order of float32 ``keys``.

    The IEEE bit pattern of a float, with the magnitude bits flipped for negatives, orders like
    the float; NaN ranks below ``-inf`` and ``-0.0`` equals ``0.0``, as in :func:`top_n`.
    """
    keys = torch.nan_to_num(keys.float(), nan=-torch.inf) + 0.0  # + 0.0 turns -0.0 into 0.0
    bits = keys.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (~ordered).long() + 2**31


def segmented_top_n(keys: Tensor, quotas: Quotas, draws: Draws) -> Tensor:
    """``[valid tokens, layers]`` mask with exactly ``quotas.counts`` of the largest keys per group.

    ``keys`` are ``[valid tokens, layers]``; a group is a sequence (``counts[s]``) or one layer of a
    sequence (``counts[s, l]``). Each sequence's routes are first shuffled with its own generator
    (:meth:`Draws.route_orders`), then one stable sort orders all of them by (group, key): equal
    keys keep their shuffled order, so ties are broken uniformly at random, and what a sequence
    gets depends only on its own keys and draws. Whole sequences are sorted a chunk at a time, so
    memory stays a fraction of the routes whatever the batch.
    """
    tokens, layers = keys.shape
    device = keys.device
    sort_keys = descending_sort_keys(keys).reshape(-1)
    chosen = torch.zeros(tokens * layers, dtype=torch.bool, device=device)
    sizes = torch.tensor(draws.sizes, device=device)
    # Counting a route as eight expert ids gives chunks of 2^20 routes (the routes of the other
    # kernels' chunk at top-8), whose handful of int64 sort temporaries stay at tens of MiB.
    for first, last in sequence_chunks(quotas.bounds, layers * 8):
        start, end = quotas.bounds[first] * layers, quotas.bounds[last] * layers
        order = draws.route_orders(first, last)
        token_group = torch.repeat_interleave(torch.arange(last - first, device=device), sizes[first:last])
        if quotas.per_layer:
            group = (token_group[:, None] * layers + torch.arange(layers, device=device)).reshape(-1)
            group_sizes = sizes[first:last, None].expand(-1, layers).reshape(-1)
        else:
            group = token_group.repeat_interleave(layers)
            group_sizes = sizes[first:last] * layers
        del token_group
        ranked, position = torch.sort((group[order] << 32) | sort_keys[start:end][order], stable=True)
        del group
        ranked_group = ranked >> 32
        del ranked
        group_start = torch.cumsum(group_sizes, 0) - group_sizes
        rank = torch.arange(end - start, device=device) - group_start[ranked_group]
        keep = rank < quotas.counts[first:last].reshape(-1)[ranked_group]
        chosen[start + order[position[keep]]] = True
    return chosen.reshape(tokens, layers)
