"""The hand-checkable batch shared by the core tests: 4 tokens, 2 MoE layers, 4 experts, top-2.

    token  valid  layer 0 rollout / native     layer 1 rollout / native
    t0     yes    {0,1} / {0,1}  match         {2,3} / {2,0}  1 expert differs
    t1     yes    {0,2} / {3,1}  2 differ      {1,3} / {3,1}  match (order differs)
    t2     yes    {1,2} / {2,1}  match         {0,3} / {0,3}  match
    t3     no     {2,3} / {0,0}  (padding: never read)

Valid routes N = 3 tokens * 2 layers = 6. Mismatched routes: (t0, l1) and (t1, l0).
Fisher estimate F = [[4, 1, 0, 0], [0, 0, 2, 1]] gives route scores s(t, l) = sum F[l, e]:
    t0: l0 F[0,0]+F[0,1] = 5, l1 F[1,2]+F[1,3] = 3
    t1: l0 F[0,0]+F[0,2] = 4, l1 F[1,1]+F[1,3] = 1
    t2: l0 F[0,1]+F[0,2] = 1, l1 F[1,0]+F[1,3] = 1
Total valid score = 5+3+4+1+1+1 = 15.
"""

import torch

from ablate import Routes

ROLLOUT = torch.tensor(
    [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[1, 2], [0, 3]], [[2, 3], [0, 1]]], dtype=torch.int16
)
NATIVE = torch.tensor(
    [[[0, 1], [2, 0]], [[3, 1], [3, 1]], [[2, 1], [0, 3]], [[0, 0], [0, 0]]], dtype=torch.int16
)
VALID = torch.tensor([True, True, True, False])
FISHER = torch.tensor([[4.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0]])


def hand_routes(native: bool = True) -> Routes:
    return Routes(rollout=ROLLOUT, valid=VALID, num_experts=4, native=NATIVE if native else None)


def sequence_batch(lengths, layers, experts, topk, seed, *, padding=0.0, native=True) -> Routes:
    """Sequences of the given lengths one after another (``offsets``), with distinct ids per route.

    A ``padding`` share of tokens is invalid and holds verl's zero padding; native routes keep
    each rollout route or replace it with a fresh one, half the time each.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    rollout = torch.rand(tokens, layers, experts, generator=g).argsort(-1)[..., :topk]
    fresh = torch.rand(tokens, layers, experts, generator=g).argsort(-1)[..., :topk]
    other = torch.where(torch.rand(tokens, layers, 1, generator=g) < 0.5, rollout.flip(-1), fresh)
    valid = torch.rand(tokens, generator=g) >= padding
    if not valid.any():
        valid[0] = True
    rollout[~valid], other[~valid] = 0, 0
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return Routes(
        rollout=rollout.short(), valid=valid, num_experts=experts, native=other.short() if native else None, offsets=offsets
    )
