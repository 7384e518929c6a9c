"""Exact top-n selection and seeded randomness, shared by the budgeted policies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ablate.budget import Quotas
from ablate.routes import group_chunks, token_chunks


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

    def _each(self, draw: Callable[[torch.Generator | None, int, torch.device], Tensor], *,
              on_host: bool = False) -> Tensor:
        """``draw(generator, group, device)`` for every group in order, concatenated on the routes' device
        (``on_host``: where the generators drew, for a caller that plans on the host with them)."""
        parts = []
        for group, generator in enumerate(self.generators):
            parts.append(draw(generator, group, self.device if generator is None else generator.device))
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined if on_host else joined.to(self.device)

    def uniform(self) -> Tensor:
        """``[valid tokens, layers]`` U[0, 1) float32 noise, one number per valid route."""
        return self._each(lambda g, group, device: torch.rand((self.sizes[group], self.num_layers), generator=g, device=device))

    def gumbel(self) -> Tensor:
        """``[valid tokens, layers]`` standard Gumbel noise, one number per valid route."""
        return gumbel(self.uniform())

    def uniform64(self, *shape: int) -> Tensor:
        """``[groups, *shape]`` U[0, 1) float64 noise: ``shape`` numbers per group."""
        return self._each(lambda g, group, device: torch.rand((1, *shape), generator=g, device=device, dtype=torch.float64))

    def layer_shifts(self, *, on_host: bool = False) -> Tensor:
        """``[groups]`` int64 in ``[0, layers)``: the rotation of each group's layer quotas."""
        return self._each(lambda g, group, device: torch.randint(self.num_layers, (1,), generator=g, device=device),
                          on_host=on_host)

    def tie_breaks(self) -> Tensor:
        """``[valid tokens, layers]`` int32 of 31 random bits, one per valid route."""
        return self._each(
            lambda g, group, device: torch.empty((self.sizes[group], self.num_layers), dtype=torch.int32, device=device)
            .random_(generator=g)
        )


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


#: Larger than any packed key of :func:`packed_keys`: fills the rows of :func:`segmented_top_n`.
_ABOVE_ALL = torch.iinfo(torch.int64).max


def packed_keys(keys: Tensor | None, tie_breaks: Tensor) -> Tensor:
    """int64 keys ``>= 0`` that order like ``keys``, equal keys ordered by the 31 ``tie_breaks`` bits.

    The IEEE bit pattern of a float32, with the magnitude bits flipped for negatives, orders like
    the float (NaN ranks below ``-inf`` and ``-0.0`` equals ``0.0``, as in :func:`top_n`); it takes
    the high 32 bits, the tie break the low 31. ``keys=None`` (no preference) ranks by the tie
    breaks alone. The largest value, that of ``+inf``, stays below :data:`_ABOVE_ALL`.
    """
    if keys is None:
        return tie_breaks.long()
    # In place on each fresh temporary: a new full-size tensor per step costs more than its arithmetic.
    keys = torch.nan_to_num(keys.float(), nan=-torch.inf).add_(0.0)  # + 0.0 turns -0.0 into 0.0
    bits = keys.view(torch.int32)
    ordered = (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)
    return ordered.long().add_(2**31).bitwise_left_shift_(31).bitwise_or_(tie_breaks)


def segmented_top_n(keys: Tensor | None, quotas: Quotas, draws: Draws) -> Tensor:
    """``[valid tokens, layers]`` mask with exactly ``quotas.counts`` of the largest keys per group.

    ``keys`` are ``[valid tokens, layers]`` (None: every route equally good); a group is a sequence
    (``counts[s]``) or one layer of a sequence (``counts[s, l]``). Every route gets 31 random bits
    from its sequence's generator (:meth:`Draws.tie_breaks`) that order equal keys, so ties are
    broken uniformly at random, and, were two routes equal in key and bits too, by position.

    Groups are laid out as the rows of a matrix, a chunk of groups of similar size at a time, and
    one ``topk`` per row finds each group's threshold: row ``g`` holds its own keys, then
    ``k - counts[g]`` entries above everything, then entries below everything, so the ``k``-th
    largest of the row (the same ``k`` for every row) is the ``counts[g]``-th largest key of the
    group. The threshold is a value, and a group's row holds only its own keys whatever else
    shares the chunk: a sequence gets the same routes in any batch.
    """
    tokens, layers = sum(draws.sizes), draws.num_layers
    device = draws.device
    routes = tokens * layers
    # One slot past the routes: padding reads a key below everything from it and writes to it.
    packed = torch.full((routes + 1,), -1, dtype=torch.int64, device=device)
    tie_breaks = draws.tie_breaks()
    for rows in token_chunks(tokens, layers * 8):  # a chunk of temporaries at a time
        packed[rows.start * layers : rows.stop * layers] = packed_keys(
            None if keys is None else keys[rows], tie_breaks[rows]
        ).reshape(-1)
    del tie_breaks
    chosen = torch.zeros(routes + 1, dtype=torch.bool, device=device)
    # The layout of the groups is planned on the host (their sizes and counts are known there, or read
    # once): only the rows' contents and the thresholds are the device's work.
    counts = quotas.host_counts.reshape(-1).astype(np.int64)
    sequence_start = np.asarray(quotas.bounds[:-1], dtype=np.int64)
    sequence_size = np.asarray(draws.sizes, dtype=np.int64)
    if quotas.per_layer:  # group (s, l): valid tokens of s at layer l, every layers-th route
        start = (sequence_start[:, None] * layers + np.arange(layers)).reshape(-1)
        size = sequence_size.repeat(layers)
        stride = layers
    else:  # group s: all routes of s, contiguous
        start, size, stride = sequence_start * layers, sequence_size * layers, 1
    for chunk in group_chunks(size.tolist()):
        n, group_size = counts[chunk, None], size[chunk, None]
        k = int(n.max())
        if k == 0:
            continue
        lifted = group_size + (k - n)
        width = int(lifted.max())
        n, group_size, lifted, first = (torch.from_numpy(a).to(device) for a in (n, group_size, lifted, start[chunk, None]))
        column = torch.arange(width, device=device)
        real = column < group_size
        index = torch.where(real, first + column * stride, routes)
        rows = packed[index]
        rows.masked_fill_(~real & (column < lifted), _ABOVE_ALL)
        threshold = rows.topk(k, dim=1, sorted=False).values.min(1, keepdim=True).values
        pick = (rows >= threshold) & real
        # Equal packed keys at a threshold (surplus > 0): keep the first by position. Without a
        # surplus this changes nothing; it runs anyway, so that no count is read back to decide.
        surplus = pick.sum(1, keepdim=True) - n
        tied = pick & (rows == threshold)
        pick &= ~tied | (tied.cumsum(1) <= tied.sum(1, keepdim=True) - surplus)
        chosen.index_put_((index,), pick)  # padding writes only to the spare slot
    return chosen[:routes].reshape(tokens, layers)
