"""Which routes of one verl micro-batch are replayable, and which of them the policy replays.

verl hands the hook a micro-batch as jagged routes ``[tokens, route layers, topk]`` (sequences
back to back, ``offsets`` between them) and R3's per-token mask. Three things make a verl batch
differ from a clean :class:`ablate.routes.Routes`, and verl's plain R3 accepts all of them:

- the route tensor may cover every transformer layer, dense ones included (DeepSeek-V3 and
  Moonlight have leading dense layers; verl then maps routers by their global layer number).
  Dense columns are not routes: only MoE columns are kept.
- tokens the rollout engine never routed hold zeros: multi-turn gaps, and the placeholder verl
  appends for the final token of each sequence. Their routes are not recorded, so they cannot be
  replayed: they are counted apart and their tokens are not valid for the budget. A route is
  recorded when its top-k ids are distinct and in range (with top-1 a zero cannot be told from
  expert 0; verl's R3 mask already leaves the final token native).
- every sequence gets its own exact quota and its own generator, seeded from the run seed and
  the sequence's routes, in one batched selection over the micro-batch (``per_sequence=True``):
  a sequence's mask does not depend on the sequences beside it, so the old-log-prob pass and
  every update pass replay the same routes whatever the micro-batching, on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ablate.policies import ReplayPolicy, replay_mask
from ablate.routes import Routes


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

    The key seeds the sequence's generator and finds its native routes in a later pass. One
    layer identifies a sequence (two different sequences with the same first-layer routes at
    every position do not occur) at 1/layers of the cost of hashing all routes.
    """
    ids = first_layer.detach().to("cpu", torch.int16).contiguous().numpy()
    bounds = offsets.tolist()
    return [hashlib.blake2b(ids[start:end].tobytes(), digest_size=16).digest() for start, end in zip(bounds[:-1], bounds[1:])]


def sequence_generators(seed: int, keys: list[bytes]) -> list[torch.Generator]:
    """One CPU generator per sequence, seeded from the run seed and the sequence's content."""
    generators = []
    for key in keys:
        digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + key, digest_size=8).digest()
        generators.append(torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63))
    return generators


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
        fisher_fallback: the fisher policy had no estimate and selected at random.
        batch: the routes the policy selected from (None when no token was selectable), with
            what it computed of them (the ``fisher`` policy's route scores) for the counters.
    """

    routes: Tensor
    offsets: Tensor
    keys: list[bytes]
    valid: Tensor
    mask: Tensor
    unrecorded: int
    fisher_fallback: bool
    batch: Routes | None = None


def select_micro_batch(
    policy: ReplayPolicy,
    budget: float,
    seed: int,
    routes: Tensor,
    r3_mask: Tensor,
    offsets: Tensor,
    num_experts: int,
    *,
    keys: list[bytes] | None = None,
    native: Tensor | None = None,
    has_native: Tensor | None = None,
    native_margin: Tensor | None = None,
) -> MicroBatchSelection:
    """Select the replayed routes of one micro-batch of MoE routes ``[tokens, layers, topk]``.

    ``r3_mask`` is verl's per-token R3 mask, ``offsets`` the sequence boundaries and ``keys``
    the sequences' content keys (computed when not given). ``native`` (``[tokens, layers,
    topk]``) and ``native_margin`` (``[tokens, layers]``) are needed by policies that
    ``needs_native_routes``; tokens where ``has_native`` is False are not selected (their native
    routes are not known).
    """
    recorded = recorded_routes(routes, num_experts)
    # A count per token, not .all(1): a reduction over a short last dimension runs element by element.
    valid = r3_mask.to(routes.device).bool() & (recorded.sum(1) == recorded.shape[1])
    keys = sequence_keys(routes[:, 0], offsets) if keys is None else keys
    selectable = valid if has_native is None else valid & has_native
    mask = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    fallback, batch = False, None
    if bool(selectable.any()):
        batch = Routes(rollout=routes, valid=selectable, num_experts=num_experts, native=native, offsets=offsets,
                       ids_checked=True, native_margin=native_margin)
        mask = replay_mask(policy, batch, budget, generator=sequence_generators(seed, keys), per_sequence=True)
        fallback = bool(policy.info.get("fisher_fallback", 0.0))
    return MicroBatchSelection(
        routes=routes, offsets=offsets, keys=keys, valid=valid, mask=mask, unrecorded=int((~recorded).sum()),
        fisher_fallback=fallback, batch=batch,
    )
