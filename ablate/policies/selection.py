"""Exact top-n selection and seeded randomness, shared by the budgeted policies."""

from __future__ import annotations

import torch
from torch import Tensor


def uniform_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    """U[0, 1) noise drawn from ``generator`` on the generator's own device, then moved.

    Drawing on the generator's device keeps a mask bit-identical for a given seed whichever device
    the routes live on, and lets a CPU generator drive CUDA routes.
    """
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def permutation(size: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    if generator is None:
        return torch.randperm(size, device=device)
    return torch.randperm(size, generator=generator, device=generator.device).to(device)


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    u = uniform_noise(shape, generator, device).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


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
