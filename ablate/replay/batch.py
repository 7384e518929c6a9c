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
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ablate.routes import Routes

if TYPE_CHECKING:
    from ablate.replay.session import ProbeRun, ReplaySession

log = logging.getLogger(__name__)


def recorded_routes(routes: Tensor, num_experts: int) -> Tensor:
    """``[tokens, layers]`` bool: the route holds ``topk`` distinct ids in ``[0, num_experts)``.

    This is the one check of the micro-batch's ids: :class:`Routes` built from the recorded
    routes skip their own (``ids_checked``). It works on a slot-major copy (``[topk, tokens,
    layers]``), so every comparison is one long contiguous pass: the range from one minimum and
    maximum of the whole micro-batch (route by route only when some id is out of range), then
    every pair of slots for duplicates, on uint8 copies of the
    ids when ``num_experts <= 256`` (four times fewer bytes than the int16 ids; wrapping an
    out-of-range id cannot hide a duplicate, and that route is rejected by the range anyway).
    """
    topk = routes.shape[-1]
    slots = routes.movedim(-1, 0).contiguous()
    bad = _out_of_range(slots, num_experts)
    ids = slots.to(torch.uint8) if num_experts <= 256 else slots
    same = torch.empty_like(bad)
    for first in range(topk):
        for second in range(first + 1, topk):
            torch.eq(ids[first], ids[second], out=same)
            bad |= same
    return ~bad


def _out_of_range(slots: Tensor, num_experts: int) -> Tensor:
    """``[tokens, layers]`` bool: the route holds an id outside ``[0, num_experts)``, from slot-major ids."""
    none = torch.zeros(slots.shape[1:], dtype=torch.bool, device=slots.device)
    if slots.numel() == 0:
        return none
    low, high = torch.aminmax(slots)
    if int(low) >= 0 and int(high) < num_experts:  # the usual case: one reduction settles every route
        return none
    low, high = slots[0].clone(), slots[0].clone()
    for slot in slots[1:]:
        torch.minimum(low, slot, out=low)
        torch.maximum(high, slot, out=high)
    return (low < 0) | (high >= num_experts)


def sequence_keys(first_layer: Tensor, offsets: Tensor) -> list[bytes]:
    """A content key per sequence, from its routes at the first MoE layer.

    The key names the sequence's random stream and finds its native routes in a later pass. One
    layer identifies a sequence (two different sequences with the same first-layer routes at
    every position do not occur) at 1/layers of the cost of hashing all routes.
    """
    ids = first_layer.detach().to("cpu", torch.int16).contiguous().numpy()
    bounds = offsets.tolist()
    return [hashlib.blake2b(ids[start:end].tobytes(), digest_size=16).digest() for start, end in zip(bounds[:-1], bounds[1:])]


@dataclass
class MicroBatchSelection:
    """The hook's choice for one micro-batch.

    Attributes:
        routes: ``[tokens, MoE layers, topk]`` rollout routes.
        offsets: ``[sequences + 1]`` sequence boundaries.
        keys: one content key per sequence.
        valid: ``[tokens]`` the tokens R3 replays whose routes were all recorded.
        mask: ``[tokens, MoE layers]`` replay mask, never True on an invalid token.
        unrecorded: number of MoE routes of the micro-batch that were not recorded.
        batch: the routes the policy selected from (None when no token was selectable), with
            what it computed of them (the ``fisher`` policy's route scores) for the counters.
    """

    routes: Tensor
    offsets: Tensor
    keys: list[bytes]
    valid: Tensor
    mask: Tensor
    unrecorded: int
    batch: Routes | None = None


def select_micro_batch(
    session: ReplaySession | None,
    routes: Tensor,
    r3_mask: Tensor,
    offsets: Tensor,
    num_experts: int,
    *,
    keys: list[bytes] | None = None,
    native: Tensor | None = None,
    has_native: Tensor | None = None,
    native_margin: Tensor | None = None,
    probe: ProbeRun | None = None,
    layer: int | None = None,
) -> MicroBatchSelection:
    """Select the replayed routes of one micro-batch of MoE routes ``[tokens, layers, topk]``.

    ``r3_mask`` is the engine's per-token replay mask, ``offsets`` the sequence boundaries and
    ``keys`` the sequences' content keys (computed when not given). ``session`` selects the cell's
    mask, or ``probe``'s; without a session (a pass that replays nothing) the mask is empty.
    ``native`` (``[tokens, layers, topk]``) and ``native_margin`` (``[tokens, layers]``) are
    needed by policies that ``needs_native_routes``; tokens where ``has_native`` is False are not
    selected (their native routes are not known). ``layer``: the routes are that one MoE layer's
    (:meth:`ReplaySession.select`).
    """
    recorded = recorded_routes(routes, num_experts)
    # A count per token, not .all(1): a reduction over a short last dimension runs element by element.
    valid = r3_mask.to(routes.device).bool() & (recorded.sum(1) == recorded.shape[1])
    keys = sequence_keys(routes[:, 0], offsets) if keys is None else keys
    selectable = valid if has_native is None else valid & has_native
    mask = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    batch = None
    if session is not None and bool(selectable.any()):
        batch = Routes(rollout=routes, valid=selectable, num_experts=num_experts, native=native, offsets=offsets,
                       ids_checked=True, native_margin=native_margin)
        mask = session.select(batch, sequences=keys, probe=probe, layer=layer)
    return MicroBatchSelection(routes=routes, offsets=offsets, keys=keys, valid=valid, mask=mask,
                               unrecorded=int((~recorded).sum()), batch=batch)


def counted_routes(selection: MicroBatchSelection, native: Tensor, num_experts: int) -> Routes | None:
    """The micro-batch's valid routes with the native ids its routers reported, for the session's counts.

    ``native`` is the micro-batch's assembled ``[tokens, MoE layers, topk]`` native ids (-1 where
    no router reported one). Valid routes without a native route leave the ``routing/`` counts out
    rather than compare against a made-up route. None when the micro-batch has no valid route.
    """
    if not bool(selection.valid.any()):
        return None
    # A router writes a route's topk ids together: its first slot says whether it reported one.
    observed = not bool(((native[..., 0] < 0) & selection.valid[:, None]).any())
    if not observed:
        log.warning("ablate replay hook: valid routes without a native route from the routers; routing/ keys skip them")
    # The routes the policy selected from, when they are the same tokens (with the Fisher route scores
    # the ``fisher`` policy computed of them); their rollout ids were checked by recorded_routes and the
    # native ids are the routers' own top-k.
    if selection.batch is not None and selection.batch.valid is selection.valid:
        routes = selection.batch
    else:
        routes = Routes(rollout=selection.routes, valid=selection.valid, num_experts=num_experts, ids_checked=True)
    return routes.with_native(native if observed else None)
