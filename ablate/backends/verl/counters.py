"""Counting each route once across the ranks of a run, and summing what they saw.

Every rank of a model-parallel group (Megatron's TP x CP x PP, VeOmni's Ulysses SP group) gets
the same micro-batches, and its routers route a disjoint part of them. The engine's seam
(:mod:`.engines`) knows the groups; here is what is done with them (docs/design.md section 4,
counting in parallel training):

- selection counts (valid, replayed, unrecorded routes) are taken on one rank per model-parallel
  group, once per micro-batch; a world sum then adds the data-parallel replicas;
- what the routers saw (their native routes) is written by each rank into a buffer indexed by
  (token, layer) and summed over the model-parallel group (:func:`sum_disjoint`): every entry is
  written by exactly one rank, so the sum assembles the whole micro-batch on every rank;
- Fisher sums of router-logit gradients are per (token, layer), so a world sum is exact;
- a probe's per-token log-probs are gathered, not summed, in rank order (:mod:`.probe_passes`).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ablate.backends.verl.selection import MicroBatchSelection
from ablate.diagnostics.metrics import route_counts
from ablate.routes import Routes

log = logging.getLogger(__name__)


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def collective_device() -> torch.device:
    """Where the hook's buffers live and its collectives run: the current GPU, or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sum_disjoint(parts: Tensor, groups) -> Tensor:
    """Sum over each process group in turn of a tensor whose every entry one rank wrote (zeros elsewhere).

    Integer tensors travel as bytes: NCCL has no int16 sum, and because each byte is non-zero on
    at most one rank, a byte-wise sum is the exact value.
    """
    assembled = parts.contiguous().clone()
    payload = assembled.view(torch.uint8) if not assembled.is_floating_point() else assembled
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(payload, group=group)
    return assembled


def sum_over_world(values: Tensor) -> Tensor:
    """Sum of a float64 tensor over every rank (on the device collectives run on)."""
    if not distributed() or torch.distributed.get_world_size() == 1:
        return values
    reduced = values.to(collective_device()).clone()
    torch.distributed.all_reduce(reduced)
    return reduced.to(values.device)


def gather_over_world(values: Tensor) -> Tensor:
    """Every rank's 1-D CPU tensor, concatenated in rank order (ranks may hold different lengths)."""
    if not distributed() or torch.distributed.get_world_size() == 1:
        return values
    parts: list[Tensor | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, values.cpu())
    return torch.cat([part for part in parts if part is not None])


def sum_counts_over_world(counts: dict[str, float]) -> dict[str, float]:
    keys = sorted(counts)
    values = sum_over_world(torch.tensor([counts[key] for key in keys], dtype=torch.float64))
    return dict(zip(keys, values.tolist()))


def micro_batch_counts(selection: MicroBatchSelection, native: Tensor, num_experts: int,
                       fisher_scores: Tensor | None) -> dict[str, float]:
    """The shared route counts of one micro-batch, plus its unrecorded routes.

    ``native`` is the micro-batch's assembled ``[tokens, MoE layers, topk]`` native ids (-1
    where no router reported one). Valid routes without a native route leave the ``routing/``
    counts out rather than compare against a made-up route.
    """
    if not bool(selection.valid.any()):
        return {"unrecorded_routes": float(selection.unrecorded)}
    # A router writes a route's topk ids together: its first slot says whether it reported one.
    observed = not bool(((native[..., 0] < 0) & selection.valid[:, None]).any())
    if not observed:
        log.warning("ablate verl hook: valid routes without a native route from the routers; routing/ keys skip them")
    # Native ids are the routers' own top-k: checked by the routers.
    routes = _counted_routes(selection, num_experts).with_native(native if observed else None)
    counts = route_counts(routes, selection.mask, fisher_scores=fisher_scores)
    counts["unrecorded_routes"] += selection.unrecorded
    return counts


def _counted_routes(selection: MicroBatchSelection, num_experts: int) -> Routes:
    """The micro-batch's valid routes: those the policy selected from when they are the same tokens
    (with the Fisher route scores the ``fisher`` policy computed of them), else new ones."""
    if selection.batch is not None and selection.batch.valid is selection.valid:
        return selection.batch
    # The rollout ids were checked by the selection (recorded_routes).
    return Routes(rollout=selection.routes, valid=selection.valid, num_experts=num_experts, ids_checked=True)
