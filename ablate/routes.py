"""One batch of routing decisions, validated once so every policy and metric can trust it.

Layout (docs/design.md section 2): a *route* is one (token, MoE layer) decision, the set of top-k
experts chosen for that token at that layer. Tokens are flattened: a verl batch
``[batch, seq, layers, topk]`` becomes ``[batch * seq, layers, topk]`` with a valid-token mask,
and optional sequence boundaries ``offsets`` (verl's jagged layout) say which tokens form one
sequence, for per-sequence budgets and for the ``uniform`` policy's stratification.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

_INTEGER_DTYPES = (torch.int16, torch.int32, torch.int64, torch.uint8, torch.int8)


class RoutesError(ValueError):
    """A routing batch that does not satisfy the Routes contract."""


#: What :class:`Routes` caches of its rollout and valid tokens alone (``ablate.fisher.route_scores``
#: keeps its scores under ``_route_scores``): :meth:`Routes.with_native` carries them over.
_NATIVE_FREE_CACHES = ("valid_offsets", "_route_scores")


@dataclass(frozen=True)
class HostLayout:
    """What the host already knows of a batch's layout: its sequences' boundaries and valid tokens.

    A caller that has read them from the device once (the replay hook, once per micro-batch) hands
    them to :class:`Routes`, whose checks and counts then read the host's copy instead of the
    device: on a GPU every such read would wait for the device's queue of kernels.
    """

    #: ``[sequences + 1]`` token boundaries, as ``Routes.offsets`` holds them.
    offsets: tuple[int, ...]
    #: Valid tokens of each sequence.
    valid_counts: tuple[int, ...]

    @property
    def valid_bounds(self) -> list[int]:
        """``[sequences + 1]`` boundaries among the valid tokens (``Routes.valid_offsets`` on the host)."""
        bounds = [0]
        for count in self.valid_counts:
            bounds.append(bounds[-1] + count)
        return bounds


@dataclass(frozen=True, eq=False)
class Routes:
    """Routing decisions of one batch.

    Attributes:
        rollout: ``[tokens, layers, topk]`` integer expert ids recorded by the inference engine.
        valid: ``[tokens]`` bool; False for padding (and for tokens a backend chooses not to count).
        num_experts: experts per MoE layer; every id on a valid token lies in ``[0, num_experts)``.
        native: optional ``[tokens, layers, topk]`` ids the training router picks by itself.
        router_logits: optional ``[tokens, layers, num_experts]`` training router logits.
        offsets: optional ``[sequences + 1]`` int64 cumulative token boundaries, verl's jagged
            layout: sequence ``s`` is tokens ``offsets[s]:offsets[s + 1]``. It starts at 0, never
            decreases and ends at ``tokens``. Needed by ``select(..., per_sequence=True)``; the
            ``uniform`` policy uses it to spread its quota over sequences and positions.
        ids_checked: the caller has already checked that every id on a valid token is in range
            and distinct within its route (the verl hook checks each route it receives for being
            recorded; native routes are a router's own top-k), so that pass over the ids is not
            repeated. Every other check still runs.
        native_margin: optional ``[tokens, layers]`` float, the training router's k-th largest
            score minus its (k+1)-th, recorded with ``native`` (``inf`` where every expert is in
            the top-k). A small margin is a near-tie: where rollout and training numerics flip
            the route most easily.
        host: optional :class:`HostLayout` of ``offsets`` and ``valid`` that the caller read
            already: the checks and counts that would read the device read it instead, so that
            building routes and selecting from them makes a GPU wait for nothing.

    ``valid`` must be a bool tensor or an integer tensor of 0s and 1s: a float mask (0.3, NaN)
    has no single meaning, so it is rejected rather than cast. Ids on invalid tokens are never
    read (verl fills padding with zeros, which would otherwise look like duplicate experts), so
    they are not validated either.
    """

    rollout: Tensor
    valid: Tensor
    num_experts: int
    native: Tensor | None = None
    router_logits: Tensor | None = None
    offsets: Tensor | None = None
    ids_checked: bool = False
    native_margin: Tensor | None = None
    host: HostLayout | None = None

    def __post_init__(self) -> None:
        _check_route_tensor("rollout", self.rollout)
        tokens, layers, topk = self.rollout.shape
        object.__setattr__(self, "valid", _checked_valid("valid", self.valid, (tokens,), f"matching rollout {tuple(self.rollout.shape)}"))
        if isinstance(self.num_experts, bool) or int(self.num_experts) != self.num_experts:
            raise RoutesError(f"num_experts={self.num_experts!r}: expected a positive integer")
        object.__setattr__(self, "num_experts", int(self.num_experts))
        if self.num_experts < 1:
            raise RoutesError(f"num_experts={self.num_experts}: expected a positive integer")
        if topk > self.num_experts:
            raise RoutesError(f"topk={topk} > num_experts={self.num_experts}: a route cannot pick more experts than exist")
        if topk < 1 or layers < 1:
            raise RoutesError(f"rollout has shape {tuple(self.rollout.shape)}: expected at least one layer and topk >= 1")
        if not (sum(self.host.valid_counts) > 0 if self.host is not None else bool(self.valid.any())):
            raise RoutesError(f"the batch has no valid token (valid is all False over {tokens} tokens)")
        if not self.ids_checked:
            _check_ids("rollout", self.rollout, self.valid, self.num_experts)
        if self.native is not None:
            _check_route_tensor("native", self.native)
            if self.native.shape != self.rollout.shape:
                raise RoutesError(
                    f"native has shape {tuple(self.native.shape)}: expected the rollout shape {tuple(self.rollout.shape)}"
                )
            if not self.ids_checked:
                _check_ids("native", self.native, self.valid, self.num_experts)
        if self.router_logits is not None:
            expected = (tokens, layers, self.num_experts)
            if tuple(self.router_logits.shape) != expected:
                raise RoutesError(
                    f"router_logits has shape {tuple(self.router_logits.shape)}: expected [tokens, layers, num_experts]={expected}"
                )
        if self.native_margin is not None and (tuple(self.native_margin.shape) != (tokens, layers)
                                               or not self.native_margin.dtype.is_floating_point):
            raise RoutesError(f"native_margin has shape {tuple(self.native_margin.shape)} and dtype "
                              f"{self.native_margin.dtype}: expected float [tokens, layers]=[{tokens}, {layers}]")
        if self.host is not None and (self.offsets is None or len(self.host.offsets) != self.offsets.shape[0]
                                      or len(self.host.valid_counts) != self.offsets.shape[0] - 1):
            raise RoutesError("host holds a layout of other sequences than offsets: expected the host's copy of them")
        if self.offsets is not None:
            object.__setattr__(self, "offsets", _checked_offsets(self.offsets, tokens, self.host))
        for name in ("valid", "native", "router_logits", "offsets", "native_margin"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != self.rollout.device:
                raise RoutesError(f"{name} is on {tensor.device} but rollout is on {self.rollout.device}: keep one device")

    @property
    def num_tokens(self) -> int:
        return self.rollout.shape[0]

    @property
    def num_layers(self) -> int:
        return self.rollout.shape[1]

    @property
    def topk(self) -> int:
        return self.rollout.shape[2]

    @property
    def device(self) -> torch.device:
        return self.rollout.device

    @property
    def num_valid_tokens(self) -> int:
        return sum(self.host.valid_counts) if self.host is not None else int(self.valid.sum())

    @property
    def num_valid_routes(self) -> int:
        """``N`` of docs/design.md section 2: valid tokens times MoE layers."""
        return self.num_valid_tokens * self.num_layers

    @property
    def num_sequences(self) -> int | None:
        """Number of sequences given by ``offsets``; None without sequence boundaries."""
        return None if self.offsets is None else self.offsets.shape[0] - 1

    @cached_property
    def valid_offsets(self) -> Tensor | None:
        """``[sequences + 1]`` boundaries of each sequence among the *valid* tokens (None without offsets).

        Sequence ``s`` owns valid tokens ``valid_offsets[s]:valid_offsets[s + 1]`` of
        ``valid.nonzero()``, i.e. ``valid_offsets.diff()`` counts each sequence's valid tokens.
        """
        if self.offsets is None:
            return None
        if self.host is not None:
            return torch.tensor(self.host.valid_bounds, device=self.device)
        before = torch.cat([self.valid.new_zeros(1, dtype=torch.int64), self.valid.cumsum(0)])
        return before[self.offsets]

    @property
    def valid_bounds(self) -> list[int] | None:
        """:attr:`valid_offsets` as a list (from the host's copy where there is one)."""
        if self.host is not None:
            return self.host.valid_bounds
        return None if self.valid_offsets is None else self.valid_offsets.tolist()

    @cached_property
    def valid_rows(self) -> Tensor:
        """``[valid tokens]`` int64 indices of the valid tokens, in order (``valid.nonzero()``)."""
        if self.host is not None:  # the count is known: no wait for the device
            return torch.nonzero_static(self.valid, size=self.num_valid_tokens).squeeze(1)
        return self.valid.nonzero().squeeze(1)

    @cached_property
    def native_differences(self) -> RouteDifferences | None:
        """The routes whose native route differs from the rollout's, with their overlap (None without native).

        Computed once per batch: the ``mismatch`` policy and the diagnostics both need it, and it
        is the most expensive pass over the routes. Routes are immutable, so the cache is safe.
        """
        return None if self.native is None else route_differences(self.rollout, self.native)

    @cached_property
    def native_overlap(self) -> Tensor | None:
        """``[tokens, layers]`` experts shared by rollout and native routes (None without native)."""
        differences = self.native_differences
        return None if differences is None else differences.dense(self.num_tokens, self.num_layers, self.topk)

    def with_native(self, native: Tensor | None) -> Routes:
        """These routes with ``native`` routes in place of their own (their ids checked by the caller;
        None: none), keeping what was computed of the rollout alone (the valid offsets, the Fisher
        route scores)."""
        routes = dataclasses.replace(self, native=native, native_margin=None, ids_checked=True)
        self.__dict__.setdefault("_route_scores", {})  # one holder: what the new routes score, these keep
        kept = {key: value for key, value in self.__dict__.items() if key in _NATIVE_FREE_CACHES}
        routes.__dict__.update(kept)
        return routes

    def valid_routes(self) -> Tensor:
        """``[tokens, layers]`` bool: True on every route of a valid token."""
        return self.valid[:, None].expand(self.num_tokens, self.num_layers)

    @classmethod
    def from_verl(
        cls,
        routed_experts: Tensor,
        mask: Tensor,
        num_experts: int | None = None,
        native: Tensor | None = None,
    ) -> Routes:
        """Build routes from verl's layout; each row of the batch is one sequence (``offsets``).

        Args:
            routed_experts: ``[batch, seq, layers, topk]`` (verl's batch key ``routed_experts``,
                int16, left-padded).
            mask: ``[batch, seq]`` attention or response mask, bool or 0/1 integers; 1 marks a
                valid token.
            num_experts: experts per layer. When omitted it is inferred as ``max id + 1`` over valid
                tokens, which cannot catch out-of-range ids: pass it whenever it is known.
            native: optional native routes in the same ``[batch, seq, layers, topk]`` layout.
        """
        if routed_experts.dim() != 4:
            raise RoutesError(
                f"routed_experts has shape {tuple(routed_experts.shape)}: expected [batch, seq, layers, topk]"
            )
        batch, seq, layers, topk = routed_experts.shape
        if tuple(mask.shape) != (batch, seq):
            raise RoutesError(f"mask has shape {tuple(mask.shape)}: expected [batch, seq]=[{batch}, {seq}]")
        valid = _checked_valid("mask", mask, (batch, seq), "matching routed_experts").reshape(-1)
        rollout = routed_experts.reshape(batch * seq, layers, topk)
        if num_experts is None:
            if not bool(valid.any()):
                raise RoutesError(f"the batch has no valid token (mask is all zero over {batch * seq} tokens)")
            num_experts = int(rollout[valid].max()) + 1
        flat_native = None if native is None else native.reshape(batch * seq, layers, topk)
        offsets = torch.arange(0, batch * seq + 1, max(seq, 1), device=rollout.device)
        return cls(rollout=rollout, valid=valid, num_experts=num_experts, native=flat_native, offsets=offsets)

    def to_verl(self, batch: int, seq: int, dtype: torch.dtype = torch.int16) -> Tensor:
        """Back to ``[batch, seq, layers, topk]``; invalid tokens hold zeros, as verl pads them."""
        if batch * seq != self.num_tokens:
            raise RoutesError(f"batch * seq = {batch} * {seq} = {batch * seq}: expected the {self.num_tokens} tokens of these routes")
        out = torch.where(self.valid[:, None, None], self.rollout, torch.zeros_like(self.rollout))
        return out.to(dtype).reshape(batch, seq, self.num_layers, self.topk)


def native_margin(scores: Tensor, native: Tensor) -> Tensor:
    """``[...]`` a router's k-th largest score minus its (k+1)-th, from its scores ``[..., experts]``
    and its top-k ``native`` ``[..., k]`` (``inf`` where every expert is in the top-k)."""
    kth = scores.gather(-1, native).min(-1).values
    rest = scores.scatter(-1, native, float("-inf")).max(-1).values
    return kth - rest


def _check_route_tensor(name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise RoutesError(f"{name} is a {type(tensor).__name__}: expected a torch.Tensor [tokens, layers, topk]")
    if tensor.dim() != 3:
        raise RoutesError(f"{name} has shape {tuple(tensor.shape)}: expected rank 3 [tokens, layers, topk]")
    if tensor.dtype not in _INTEGER_DTYPES:
        raise RoutesError(f"{name} has dtype {tensor.dtype}: expected an integer dtype (int16 or wider)")


def _checked_valid(name: str, valid: object, shape: tuple[int, ...], context: str) -> Tensor:
    """``valid`` as a bool tensor, or an error: only bools and the integers 0 and 1 have one meaning."""
    if not isinstance(valid, Tensor):
        raise RoutesError(f"{name} is a {type(valid).__name__}: expected a torch.Tensor of bool or 0/1 integers")
    if tuple(valid.shape) != shape:
        raise RoutesError(f"{name} has shape {tuple(valid.shape)}: expected {list(shape)} {context}")
    if valid.dtype == torch.bool:
        return valid
    if valid.dtype.is_floating_point or valid.dtype.is_complex:
        raise RoutesError(
            f"{name} has dtype {valid.dtype}: expected bool or 0/1 integers (a float mask such as 0.3 or NaN "
            f"has no single meaning; convert it explicitly, e.g. {name} > 0)"
        )
    bad = (valid != 0) & (valid != 1)
    if bool(bad.any()):
        index = tuple(bad.nonzero()[0].tolist())
        raise RoutesError(f"{name} holds {int(valid[index])} at {list(index)}: expected bool or 0/1 integers")
    return valid.bool()


def _checked_offsets(offsets: object, tokens: int, host: HostLayout | None = None) -> Tensor:
    """Sequence boundaries as int64, or an error naming the first broken rule (read from ``host`` where given)."""
    if not isinstance(offsets, Tensor):
        raise RoutesError(f"offsets is a {type(offsets).__name__}: expected a torch.Tensor [sequences + 1] of int64")
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise RoutesError(f"offsets has shape {tuple(offsets.shape)}: expected [sequences + 1] with at least one sequence")
    if offsets.dtype not in _INTEGER_DTYPES:
        raise RoutesError(f"offsets has dtype {offsets.dtype}: expected integer token boundaries (int64)")
    offsets = offsets.long()
    bounds = list(host.offsets) if host is not None else offsets.tolist()  # one read of the device at most
    first, last = bounds[0], bounds[-1]
    if first != 0 or last != tokens:
        raise RoutesError(f"offsets run from {first} to {last}: expected cumulative boundaries from 0 to tokens={tokens}")
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end < start:
            raise RoutesError(f"offsets decrease at sequence {s}: offsets[{s}]={start} > offsets[{s + 1}]={end}; "
                              "expected non-decreasing cumulative boundaries")
    return offsets


def _check_ids(name: str, ids: Tensor, valid: Tensor, num_experts: int) -> None:
    """Range and uniqueness of expert ids on valid tokens, chunk by chunk, never [T, L, K, K]."""
    topk = ids.shape[-1]
    for rows in token_chunks(valid, ids.shape[1] * topk):
        chunk = ids[rows]
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= num_experts:
            bad = low if low < 0 else high
            row, layer, _ = (chunk == bad).nonzero()[0].tolist()
            raise RoutesError(
                f"{name} holds expert id {bad} at token {_token_of(rows, row)}, layer {layer}: "
                f"expected ids in [0, {num_experts})"
            )
        for k in range(1, topk):
            clash = (chunk[..., k : k + 1] == chunk[..., :k]).any(-1)
            if bool(clash.any()):
                row, layer = clash.nonzero()[0].tolist()
                raise RoutesError(
                    f"{name} picks expert {int(chunk[row, layer, k])} twice at token {_token_of(rows, row)}, "
                    f"layer {layer}: expected distinct experts within one route"
                )


def _token_of(rows: slice | Tensor, row: int) -> int:
    return rows.start + row if isinstance(rows, slice) else int(rows[row])


#: Expert ids per chunk of the route kernels. 2^23 int16 ids are 16 MiB: a chunk's temporaries
#: are reused from the allocator instead of paging in full-size ones, peak extra memory stays a
#: small fraction of the routes tensor, and each op is still large enough that thread
#: synchronisation is negligible (smaller chunks suffer badly on an oversubscribed CPU).
_CHUNK_IDS = 1 << 23


def token_chunks(valid: Tensor | int, ids_per_token: int) -> list[slice] | list[Tensor]:
    """Row selectors that split tokens into chunks of about ``_CHUNK_IDS`` expert ids.

    ``valid`` is either a token count (every token, as slices) or a ``[tokens]`` bool mask (its
    True tokens only: slices when all are True, index tensors otherwise). Chunks are in token order.
    """
    step = max(1, _CHUNK_IDS // max(1, ids_per_token))
    if isinstance(valid, int):
        return [slice(start, min(start + step, valid)) for start in range(0, valid, step)]
    if bool(valid.all()):
        return token_chunks(valid.shape[0], ids_per_token)
    rows = valid.nonzero().squeeze(1)
    return list(rows.split(step))


@dataclass(frozen=True)
class RouteDifferences:
    """The routes of two route tensors ``[tokens, layers, topk]`` that are not the same ids slot for slot.

    Sparse because most routes agree: ``index`` holds the flat route indices ``token * layers +
    layer`` of the others, ascending, and ``overlap`` their overlap (:func:`overlap_count`); every
    route not listed shares all ``topk`` experts. Counting mismatches reads only these.
    """

    index: Tensor
    overlap: Tensor

    def dense(self, tokens: int, layers: int, topk: int) -> Tensor:
        """``[tokens, layers]`` int32 overlap of every route."""
        shared = torch.full((tokens * layers,), topk, dtype=torch.int32, device=self.index.device)
        shared[self.index] = self.overlap
        return shared.reshape(tokens, layers)


def overlap_count(a: Tensor, b: Tensor) -> Tensor:
    """``[tokens, layers]`` number of experts two route tensors ``[tokens, layers, topk]`` share.

    Precisely: the number of slots of ``a`` whose expert appears anywhere in the route of ``b``.
    Computed a chunk of tokens at a time, so memory stays a fraction of the routes themselves.
    """
    tokens, layers, topk = a.shape
    return route_differences(a, b).dense(tokens, layers, topk)


def route_differences(a: Tensor, b: Tensor) -> RouteDifferences:
    """The routes where ``a`` and ``b`` differ slot for slot, and their overlap, a chunk of tokens at a time."""
    tokens, layers, topk = a.shape
    # int32 indices where they fit: half the memory when most routes differ.
    index_type = torch.int32 if tokens * layers <= torch.iinfo(torch.int32).max else torch.int64
    indices, overlaps = [], []
    for rows in token_chunks(tokens, layers * topk):
        index, overlap = _differences_chunk(a[rows], b[rows])
        indices.append((index + rows.start * layers).to(index_type))
        overlaps.append(overlap)
    if len(indices) == 1:
        return RouteDifferences(indices[0], overlaps[0])
    return RouteDifferences(torch.cat(indices), torch.cat(overlaps))


def _differences_chunk(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    # Most routes agree, and two routers that rank experts by score list a shared route in the
    # same order: one cheap positional comparison settles those (overlap = topk), and only the
    # rest pay the all-pairs slot comparison. Exact either way: a route that agrees as a set but
    # not in order just takes the slow path.
    topk = a.shape[-1]
    differ = (~_equal_in_order(a, b)).reshape(-1).nonzero().squeeze(1)
    if differ.numel() * 2 > a.shape[0] * a.shape[1]:  # mostly different: gathering would cost more than it saves
        return differ, _slot_overlap(a, b).reshape(-1)[differ]
    # One row per route: index_select of whole routes, instead of indexing by (token, layer) pairs.
    return differ, _slot_overlap(a.reshape(-1, topk).index_select(0, differ), b.reshape(-1, topk).index_select(0, differ))


def _equal_in_order(a: Tensor, b: Tensor) -> Tensor:
    """``a.shape[:-1]`` bool: the two routes hold the same ids slot for slot."""
    route_bytes = a.shape[-1] * a.element_size()
    # Viewing as int64 needs the routes' last dim dense and every other stride (size-1 dims too,
    # which is_contiguous() overlooks) and the offset a whole number of 8-byte words.
    aligned = all(x.stride(-1) == 1 and all(step * x.element_size() % 8 == 0 for step in x.stride()[:-1])
                  and x.storage_offset() * x.element_size() % 8 == 0 for x in (a, b))
    if a.dtype == b.dtype and route_bytes % 8 == 0 and aligned:
        # Compare whole routes as int64 words (top-8 int16 ids are two words): a few long passes
        # instead of topk-long runs.
        words_a = a.view(torch.int64).reshape(a.shape[:-1] + (route_bytes // 8,))
        words_b = b.view(torch.int64).reshape(words_a.shape)
        same = words_a[..., 0] == words_b[..., 0]
        for word in range(1, words_a.shape[-1]):  # an & per word beats .all(-1) over a short last dim
            same &= words_a[..., word] == words_b[..., word]
        return same
    return (a == b).all(-1)


def _slot_overlap(a: Tensor, b: Tensor) -> Tensor:
    """``a.shape[:-1]`` int32: slots of ``a`` whose id appears anywhere in ``b``'s route."""
    # Slot-major copies, so that each comparison is one long contiguous pass over the routes:
    # k passes of "every slot of a equals slot j of b", instead of a [..., K, K] broadcast whose
    # innermost runs are only k long.
    slots_a = a.movedim(-1, 0).contiguous()
    slots_b = b.movedim(-1, 0).contiguous()
    found = slots_a == slots_b[0]
    hit = torch.empty_like(found)
    for slot in range(1, slots_b.shape[0]):
        torch.eq(slots_a, slots_b[slot], out=hit)
        found |= hit
    return found.sum(0, dtype=torch.int32)


def group_chunks(sizes: list[int]) -> list[list[int]]:
    """Groups of entries (by their ``sizes``) in chunks of similar size, for kernels that pad them into rows.

    Largest first; a chunk takes groups at least half as large as its first, so padding at most
    doubles the entries, and holds about ``_CHUNK_IDS / 8`` entries (an int64 entry of a row and
    its index weigh as much as eight int16 expert ids). A group larger than that is a chunk alone.
    """
    limit = max(1, _CHUNK_IDS // 8)
    chunks: list[list[int]] = []
    for group in sorted(range(len(sizes)), key=lambda g: -sizes[g]):
        if chunks:
            first = sizes[chunks[-1][0]]
            if (len(chunks[-1]) + 1) * first <= limit and 2 * sizes[group] >= first:
                chunks[-1].append(group)
                continue
        chunks.append([group])
    return chunks
