"""Counting each route once across the ranks of a run, and summing what they saw.

Every rank of a model-parallel group (Megatron's TP x CP x PP, VeOmni's Ulysses SP group) gets
the same micro-batches, and its routers route a disjoint part of them. The engine's seam
(:mod:`ablate.replay.seams`) knows the groups; here is what is done with them (docs/design.md section 4,
counting in parallel training):

- selection counts (valid, replayed, unrecorded routes) are taken on one rank per model-parallel
  group, once per micro-batch; a world sum then adds the data-parallel replicas;
- what the routers saw (their native routes) is written by each rank into a buffer indexed by
  (token, layer) and summed over the model-parallel group (:func:`sum_disjoint`): every entry is
  written by exactly one rank, so the sum assembles the whole micro-batch on every rank;
- Fisher sums of router-logit gradients are per (token, layer), so a world sum is exact;
- a probe's per-token log-probs are gathered, not summed, in rank order (verl's ``probe_passes``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def collective_device() -> torch.device:
    """Where the hook's buffers live and its collectives run: the current GPU, or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def sum_disjoint(parts: Tensor, groups) -> Tensor:
    """Sum over each process group in turn of a tensor whose every entry one rank wrote.

    A float tensor holds zeros where a rank wrote nothing; an integer one (expert ids) holds -1
    there, and travels as the bytes of ``id + 1``: NCCL has no int16 sum, and because each byte is
    then non-zero on at most one rank, a byte-wise sum is the exact value.
    """
    if parts.is_floating_point():
        assembled = parts.contiguous().clone()
        payload = assembled
    else:
        assembled = parts.contiguous() + 1
        payload = assembled.view(torch.uint8)
    for group in groups:
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(payload, group=group)
    return assembled if parts.is_floating_point() else assembled.sub_(1)


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
