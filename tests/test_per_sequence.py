"""Per-sequence selection: exact quotas within each sequence, and a sequence's mask independent of its batch.

verl batches the same sequences differently in its old-log-prob and update passes; every pass must
replay identical routes. So for every policy, a sequence selected alone (with its own generator)
and inside any batch of other sequences must get the same mask, bit for bit.
"""

import pytest
import torch
from handbatch import sequence_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from ablate import PolicyError, Routes, get_policy, replay_count
from ablate.budget import count_for
from ablate.policies import available_policies

BUDGETED = ["random", "uniform", "fisher", "mismatch"]


def policy_for(name: str, routes: Routes, per_layer: bool, seed: int = 0):
    if name == "fisher":
        scores = torch.rand(routes.num_layers, routes.num_experts, generator=torch.Generator().manual_seed(seed))
        scores[0, 0] = 0.0  # some zero scores: ties among routes
        return get_policy(name, scores=scores.round(decimals=1), per_layer=per_layer)
    if name == "uniform":
        return get_policy(name)
    return get_policy(name, per_layer=per_layer)


def generators(seeds):
    return [torch.Generator().manual_seed(int(seed)) for seed in seeds]


def subset(routes: Routes, sequences: list[int]) -> Routes:
    """The routes of ``sequences`` in that order, as a batch of their own."""
    bounds = routes.offsets.tolist()
    rows = torch.cat([torch.arange(bounds[s], bounds[s + 1]) for s in sequences])
    lengths = torch.tensor([bounds[s + 1] - bounds[s] for s in sequences])
    return Routes(
        rollout=routes.rollout[rows], valid=routes.valid[rows], num_experts=routes.num_experts,
        native=None if routes.native is None else routes.native[rows],
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
    )


def rows_of(routes: Routes, sequence: int) -> slice:
    return slice(int(routes.offsets[sequence]), int(routes.offsets[sequence + 1]))


@st.composite
def sequence_batches(draw):
    sequences = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(1, 13), min_size=sequences, max_size=sequences))
    layers = draw(st.integers(1, 5))
    experts = draw(st.integers(2, 9))
    topk = draw(st.integers(1, min(experts, 3)))
    padding = draw(st.sampled_from([0.0, 0.3]))
    return sequence_batch(lengths, layers, experts, topk, draw(st.integers(0, 2**31 - 1)), padding=padding)


@settings(max_examples=25, deadline=None)
@given(routes=sequence_batches(), budget=st.floats(0.0, 1.0), data=st.data(), per_layer=st.booleans())
def test_a_sequence_gets_the_same_mask_alone_and_in_any_batch(routes, budget, data, per_layer):
    seeds = data.draw(st.lists(st.integers(0, 10**6), min_size=routes.num_sequences, max_size=routes.num_sequences))
    # Another batch: the same sequences reversed, with a new sequence (of its own seed) in front.
    extra = sequence_batch([5], routes.num_layers, routes.num_experts, routes.topk, seed=seeds[0] + 1)
    for name in BUDGETED:
        policy = policy_for(name, routes, per_layer)
        batch = policy.select(routes, budget, generator=generators(seeds), per_sequence=True)
        assert not bool((batch & ~routes.valid[:, None]).any()), name
        reordered = list(reversed(range(routes.num_sequences)))
        mixed = _concat(extra, subset(routes, reordered))
        other = policy.select(mixed, budget, generator=generators([7, *[seeds[s] for s in reordered]]), per_sequence=True)
        for position, sequence in enumerate(reordered, start=1):
            mine = batch[rows_of(routes, sequence)]
            assert torch.equal(mine, other[rows_of(mixed, position)]), (name, sequence)
            if routes.valid[rows_of(routes, sequence)].any():
                alone = policy.select(subset(routes, [sequence]), budget, generator=generators([seeds[sequence]]), per_sequence=True)
                assert torch.equal(mine, alone), (name, sequence)


def _concat(first: Routes, second: Routes) -> Routes:
    return Routes(
        rollout=torch.cat([first.rollout, second.rollout]), valid=torch.cat([first.valid, second.valid]),
        num_experts=first.num_experts, native=torch.cat([first.native, second.native]),
        offsets=torch.cat([first.offsets, second.offsets[1:] + first.num_tokens]),
    )


@settings(max_examples=40, deadline=None)
@given(routes=sequence_batches(), budget=st.floats(0.0, 1.0), seed=st.integers(0, 1000), per_layer=st.booleans())
def test_every_sequence_replays_exactly_its_own_budget(routes, budget, seed, per_layer):
    valid_counts = routes.valid_offsets.diff().tolist()
    for name in BUDGETED:
        policy = policy_for(name, routes, per_layer)
        mask = policy.select(routes, budget, generator=torch.Generator().manual_seed(seed), per_sequence=True)
        assert int(mask.sum()) == replay_count(budget, routes, per_sequence=True), name
        for sequence, valid_tokens in enumerate(valid_counts):
            own = mask[rows_of(routes, sequence)]
            n = count_for(budget, valid_tokens * routes.num_layers)
            assert int(own.sum()) == n, (name, sequence)
            if per_layer or name == "uniform":
                # Exact per-layer quotas within the sequence: n // L each, the remainder one each.
                assert sorted(own.sum(0).tolist()) == sorted(_spread(n, routes.num_layers)), (name, sequence)


def _spread(n: int, layers: int) -> list[int]:
    return [n // layers + (1 if layer < n % layers else 0) for layer in range(layers)]


def test_per_sequence_ties_are_broken_at_random_and_the_top_goes_first():
    # Two sequences; fisher scores rank layer 1 above layer 0, and all routes of a layer tie.
    routes = sequence_batch([6, 6], 2, 4, 2, seed=0)
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    policy = get_policy("fisher", scores=scores)
    seen = torch.zeros(12, 2)
    for seed in range(120):
        mask = policy.select(routes, 0.25, generator=generators([seed, seed + 1000]), per_sequence=True)
        # n_s = floor(0.25 * 6 * 2 + 0.5) = 3 per sequence, all from layer 1 (the higher score).
        assert mask[:, 0].sum() == 0 and mask[:6, 1].sum() == 3 and mask[6:, 1].sum() == 3
        seen += mask
    # Ties: each valid route of layer 1 is replayed about half the time (3 of 6), none favoured.
    rates = seen[:, 1] / 120
    assert bool(((rates - 0.5).abs() < 0.17).all()), rates  # 3.7 standard deviations of a rate of 120 draws


def test_per_layer_remainders_rotate_over_layers():
    # 40 sequences of 3 tokens, 4 layers, b = 0.5: n_s = 6 = 1 per layer + 2 extra. A fixed rule
    # would give layers 0 and 2 the extra route in every sequence.
    routes = sequence_batch([3] * 40, 4, 6, 2, seed=1)
    mask = get_policy("random", per_layer=True).select(
        routes, 0.5, generator=generators(range(40)), per_sequence=True
    )
    per_layer = mask.sum(0).tolist()
    assert sum(per_layer) == 240 and min(per_layer) >= 50, per_layer  # 60 each in expectation


def test_none_and_full_and_single_generators_in_per_sequence_mode():
    routes = sequence_batch([4, 0, 3], 2, 5, 2, seed=3)
    assert not get_policy("none").select(routes, per_sequence=True).any()
    assert torch.equal(get_policy("full").select(routes, per_sequence=True), routes.valid_routes())
    one = get_policy("random").select(routes, 0.5, generator=torch.Generator().manual_seed(0), per_sequence=True)
    again = get_policy("random").select(routes, 0.5, generator=torch.Generator().manual_seed(0), per_sequence=True)
    assert torch.equal(one, again) and int(one.sum()) == count_for(0.5, 8) + count_for(0.5, 6)


def test_per_sequence_errors_name_the_problem():
    routes = sequence_batch([4, 3], 2, 5, 2, seed=3)
    flat = Routes(rollout=routes.rollout, valid=routes.valid, num_experts=5)
    with pytest.raises(PolicyError, match=r"per_sequence=True in policy=random needs sequence boundaries"):
        get_policy("random").select(flat, 0.5, per_sequence=True)
    with pytest.raises(PolicyError, match=r"generator is a list of 2 in policy=random: .* needs per_sequence=True"):
        get_policy("random").select(routes, 0.5, generator=generators([0, 1]))
    with pytest.raises(PolicyError, match=r"generator lists 3 generators in policy=uniform: expected one per sequence, 2"):
        get_policy("uniform").select(routes, 0.5, generator=generators([0, 1, 2]), per_sequence=True)
    with pytest.raises(PolicyError, match=r"generator\[1\] is a int in policy=random"):
        get_policy("random").select(routes, 0.5, generator=[torch.Generator(), 3], per_sequence=True)
    with pytest.raises(PolicyError, match="generator is a int in policy=random"):
        get_policy("random").select(routes, 0.5, generator=3)


def test_every_registered_policy_supports_both_modes():
    routes = sequence_batch([5, 7, 2], 3, 6, 2, seed=4)
    for name in available_policies():
        if name in BUDGETED:
            policy, budget = policy_for(name, routes, False), 0.4
        elif name in ("none", "full"):
            policy, budget = get_policy(name), None
        else:
            continue  # a user policy registered by another test
        for per_sequence in (False, True):
            mask = policy.select(routes, budget, generator=generators([0, 1, 2]) if per_sequence else None, per_sequence=per_sequence)
            assert mask.shape == (routes.num_tokens, routes.num_layers)


def test_masks_do_not_depend_on_the_device_of_the_routes():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine; run on a GPU machine to check CPU/CUDA agreement")
    routes = sequence_batch([9, 4, 13, 1, 7], 3, 8, 2, seed=5, padding=0.2)
    cuda = Routes(rollout=routes.rollout.cuda(), valid=routes.valid.cuda(), num_experts=8,
                  native=routes.native.cuda(), offsets=routes.offsets.cuda())
    for name in BUDGETED:
        for per_layer in (False, True):
            policy = policy_for(name, routes, per_layer)
            for per_sequence in (False, True):
                def run(batch):
                    seeds = generators(range(5)) if per_sequence else torch.Generator().manual_seed(0)
                    return policy.select(batch, 0.35, generator=seeds, per_sequence=per_sequence)

                on_cuda = run(cuda)
                assert on_cuda.device.type == "cuda"
                assert torch.equal(on_cuda.cpu(), run(routes)), (name, per_layer, per_sequence)
