"""Which routes of one micro-batch are replayable, and which of them the session replays.

An engine hands a micro-batch as jagged routes ``[tokens, route layers, topk]`` (sequences back
to back, ``offsets`` between them) and its own per-token replay mask (verl's R3 mask). Three things
make such a batch differ from a clean :class:`ablate.routes.Routes`, and verl's plain R3 accepts
all of them:

- the route tensor may cover every transformer layer, dense ones included (DeepSeek-V3 and
  Moonlight have leading dense layers; verl then maps routers by their global layer number).
  Dense columns are not routes: only MoE columns are kept.
- tokens the rollout engine never routed hold zeros: multi-turn gaps, and the placeholder verl
  appends for the final token of each sequence. Their routes are not recorded, so they cannot be
  replayed: they are counted apart and their tokens are not valid for the budget. A route is
  recorded when its top-k ids are distinct and in range (with top-1 a zero cannot be told from
  expert 0; verl's R3 mask already leaves the final token native).
- every sequence gets its own exact quota and its own stream, keyed by its content
  (:meth:`ablate.replay.ReplaySession.select` with ``sequences``), in one batched selection over
  the micro-batch: a sequence's mask does not depend on the sequences beside it, so the
  old-log-prob pass and every update pass replay the same routes whatever the micro-batching, on
  every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ablate.replay.host_reads import to_host
from ablate.routes import HostLayout, Routes

if TYPE_CHECKING:
    from ablate.replay.session import ProbeRun, ReplaySession


def recorded_routes(routes: Tensor, num_experts: int) -> Tensor:
    """``[tokens, layers]`` bool: the route holds ``topk`` distinct ids in ``[0, num_experts)``.

    This is the one check of the micro-batch's ids: :class:`Routes` built from the recorded
    routes skip their own (``ids_checked``). It works on a slot-major copy (``[topk, tokens,
    layers]``), so every comparison is one long contiguous pass: the range from each route's
    smallest and largest id, then every pair of slots for duplicates, on uint8 copies of the ids
    when ``num_experts <= 256`` (four times fewer bytes than the int16 ids; wrapping an
    out-of-range id cannot hide a duplicate, and that route is rejected by the range anyway).
    Nothing is read back: the routes' device decides every route.
    """
    topk = routes.shape[-1]
    slots = routes.movedim(-1, 0).contiguous()
    low, high = slots.amin(0), slots.amax(0)
    bad = (low < 0) | (high >= num_experts)
    ids = slots.to(torch.uint8) if num_experts <= 256 else slots
    same = torch.empty_like(bad)
    for first in range(topk):
        for second in range(first + 1, topk):
            torch.eq(ids[first], ids[second], out=same)
            bad |= same
    return ~bad


def sequence_keys(first_layer: np.ndarray, bounds: list[int]) -> list[bytes]:
    """A content key per sequence, from its routes at the first MoE layer (``[tokens, topk]`` int16, on the host).

    The key names the sequence's random stream and finds its native routes in a later pass. One
    layer identifies a sequence (two different sequences with the same first-layer routes at
    every position do not occur) at 1/layers of the cost of hashing all routes.
    """
    return [hashlib.blake2b(first_layer[start:end].tobytes(), digest_size=16).digest()
            for start, end in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class MicroBatchPlan:
    """What the host knows of one micro-batch after its one read of the device (:func:`plan_micro_batch`).

    Attributes:
        valid: ``[tokens]`` the tokens the engine replays whose routes were all recorded (device).
        unrecorded: the micro-batch's MoE routes that were not recorded (a device scalar).
        offsets: ``[sequences + 1]`` sequence boundaries (device), and ``host``, their valid tokens
            per sequence, on the host.
        keys: one content key per sequence.
    """

    valid: Tensor
    unrecorded: Tensor
    offsets: Tensor
    host: HostLayout
    keys: list[bytes]


def plan_micro_batch(routes: Tensor, r3_mask: Tensor, offsets: Tensor, num_experts: int) -> MicroBatchPlan:
    """The recorded-route check of a micro-batch of MoE routes ``[tokens, layers, topk]``, and one read of it.

    ``r3_mask`` is the engine's per-token replay mask and ``offsets`` the sequence boundaries. The
    host reads, in one transfer, the boundaries, the valid tokens of each sequence and the first
    layer's routes (the sequences' content keys): all it needs to plan the selection.
    """
    recorded = recorded_routes(routes, num_experts)
    # A count per token, not .all(1): a reduction over a short last dimension runs element by element.
    valid = r3_mask.to(routes.device).bool() & (recorded.sum(1) == recorded.shape[1])
    offsets = offsets.to(routes.device, torch.long)
    sequences = offsets.shape[0] - 1
    read = to_host(torch.cat([offsets, _counts_between(valid, offsets), routes[:, 0].reshape(-1).long()])).numpy()
    bounds, counts = read[:sequences + 1].tolist(), read[sequences + 1:2 * sequences + 1].tolist()
    keys = sequence_keys(read[2 * sequences + 1:].astype(np.int16).reshape(-1, routes.shape[-1]), bounds)
    return MicroBatchPlan(valid, (~recorded).sum(), offsets, HostLayout(tuple(bounds), tuple(counts)), keys)


def _counts_between(flags: Tensor, offsets: Tensor) -> Tensor:
    """``[sequences]`` int64: the True ``flags`` of each sequence."""
    before = torch.cat([flags.new_zeros(1, dtype=torch.long), flags.cumsum(0)])
    return before[offsets[1:]] - before[offsets[:-1]]


@dataclass
class MicroBatchSelection:
    """The hook's choice for one micro-batch.

    Attributes:
        routes: ``[tokens, MoE layers, topk]`` rollout routes.
        plan: what the host knows of it (:class:`MicroBatchPlan`).
        mask: ``[tokens, MoE layers]`` replay mask, never True on an invalid token.
        batch: the routes the policy selected from (None when no token was selectable), with
            what it computed of them (the ``fisher`` policy's route scores) for the counters.
    """

    routes: Tensor
    plan: MicroBatchPlan
    mask: Tensor
    batch: Routes | None = None

    @property
    def valid(self) -> Tensor:
        return self.plan.valid

    @property
    def keys(self) -> list[bytes]:
        return self.plan.keys

    @property
    def unrecorded(self) -> Tensor:
        return self.plan.unrecorded


def select_micro_batch(
    session: ReplaySession | None,
    routes: Tensor,
    r3_mask: Tensor,
    offsets: Tensor,
    num_experts: int,
    *,
    plan: MicroBatchPlan | None = None,
    native: Tensor | None = None,
    has_native: Tensor | None = None,
    native_margin: Tensor | None = None,
    probe: ProbeRun | None = None,
    layer: int | None = None,
) -> MicroBatchSelection:
    """Select the replayed routes of one micro-batch of MoE routes ``[tokens, layers, topk]``.

    ``r3_mask`` is the engine's per-token replay mask and ``offsets`` the sequence boundaries
    (their :class:`MicroBatchPlan` is made when not given). ``session`` selects the cell's mask, or
    ``probe``'s; without a session (a pass that replays nothing) the mask is empty. ``native``
    (``[tokens, layers, topk]``) and ``native_margin`` (``[tokens, layers]``) are needed by
    policies that ``needs_native_routes``; tokens where ``has_native`` is False are not selected
    (their native routes are not known), and their valid tokens per sequence are read once more. ``layer``: the routes
    are that one MoE layer's (:meth:`ReplaySession.select`).
    """
    plan = plan_micro_batch(routes, r3_mask, offsets, num_experts) if plan is None else plan
    mask = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    if session is None:
        return MicroBatchSelection(routes, plan, mask)
    selectable, host = plan.valid, plan.host
    if has_native is not None:
        selectable = selectable & has_native
        host = HostLayout(host.offsets, tuple(to_host(_counts_between(selectable, plan.offsets)).tolist()))
    batch = None
    if sum(host.valid_counts):
        batch = Routes(rollout=routes, valid=selectable, num_experts=num_experts, native=native, offsets=plan.offsets,
                       ids_checked=True, native_margin=native_margin, host=host)
        mask = session.select(batch, sequences=plan.keys, probe=probe, layer=layer)
    return MicroBatchSelection(routes, plan, mask, batch)


def counted_routes(selection: MicroBatchSelection, native: Tensor, num_experts: int) -> tuple[Routes | None, Tensor]:
    """The micro-batch's valid routes with the native ids its routers reported, for the session's counts,
    and how many of its valid routes no router reported (a device scalar).

    ``native`` is the micro-batch's assembled ``[tokens, MoE layers, topk]`` native ids (-1 where
    no router reported one). The routes are None when the micro-batch has no valid route.
    """
    plan = selection.plan
    unobserved = ((native[..., 0] < 0) & plan.valid[:, None]).sum()  # a router writes a route's ids together
    if not sum(plan.host.valid_counts):
        return None, unobserved
    # The routes the policy selected from, when they are the same tokens (with the Fisher route scores
    # the ``fisher`` policy computed of them); their rollout ids were checked by recorded_routes and the
    # native ids are the routers' own top-k.
    if selection.batch is not None and selection.batch.valid is plan.valid:
        routes = selection.batch
    else:
        routes = Routes(rollout=selection.routes, valid=plan.valid, num_experts=num_experts, offsets=plan.offsets,
                        ids_checked=True, host=plan.host)
    return routes.with_native(native), unobserved
