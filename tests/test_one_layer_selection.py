"""Routes handed one MoE layer at a time (Megatron-core's ``set_target_indices``, router by router).

``ReplaySession.select(..., layer=l)`` chooses over that layer alone, and its ``fisher`` policy reads
that layer's row of the Fisher estimate: the same mask as a one-layer session whose estimate is that
row. ``count(..., layer=l)`` weighs the mask by the same row.
"""

import torch

from ablate.replay import ReplaySession, ReplaySpec
from ablate.replay.batch import plan_micro_batch, select_micro_batch
from ablate.routes import Routes

LAYERS, EXPERTS, TOPK, TOKENS = 3, 8, 2, 40


def session_with_estimate(estimate: torch.Tensor) -> ReplaySession:
    session = ReplaySession(ReplaySpec.of("fisher", 0.3, seed=4), estimate.shape[0], EXPERTS, TOPK)
    session.tracker.accumulate(estimate[None], torch.ones(1, *estimate.shape))
    session.tracker.step()
    return session


def test_one_layers_routes_are_chosen_with_that_layers_fisher_row():
    generator = torch.Generator().manual_seed(0)
    estimate = torch.rand(LAYERS, EXPERTS, generator=generator, dtype=torch.float64) ** 4
    routes = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOPK] for _ in range(TOKENS)])[:, None]
    offsets = torch.tensor([0, 15, TOKENS])
    everything = torch.ones(TOKENS, dtype=torch.bool)
    whole = session_with_estimate(estimate)
    masks = {}
    for layer in range(LAYERS):
        masks[layer] = select_micro_batch(whole, routes, everything, offsets, EXPERTS, layer=layer).mask
        alone = session_with_estimate(estimate[layer:layer + 1])
        assert torch.equal(masks[layer], select_micro_batch(alone, routes, everything, offsets, EXPERTS).mask), layer
    assert not torch.equal(masks[0], masks[2])  # the rows differ, and so do the routes each replays
    assert whole.counts is None  # no selection fell back: nothing was counted yet

    batch = Routes(rollout=routes, valid=everything, num_experts=EXPERTS, offsets=offsets)
    whole.count(batch, masks[1], layer=1)
    counts = whole.read_counts(whole.counts)
    assert counts["fisher_fallback"] == 0.0
    scores = whole.tracker.scores()[1].double()
    route_scores = scores[routes[:, 0]].sum(-1)
    assert torch.isclose(torch.tensor(counts["fisher_mass"], dtype=torch.float64),
                         route_scores[masks[1][:, 0]].sum())
    assert torch.isclose(torch.tensor(counts["fisher_total"], dtype=torch.float64), route_scores.sum())
    assert len(plan_micro_batch(routes, everything, offsets, EXPERTS).keys) == 2
