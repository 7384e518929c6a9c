"""The ``uniform`` control spreads its quota evenly over layers, sequences and positions.

It used to sample systematically over the flattened ``[batch x seq]`` tokens with spacing
``V / q``, which locks onto the sequence length: on 128 sequences x 10 positions at b = 0.1 each
layer replayed one fixed position of every sequence. These tests look at what masks cover, over
many shapes, including those where the spacing divides the sequence length.
"""

import math
from collections import Counter

import pytest
import torch
from handbatch import sequence_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from ablate import Routes, get_policy, layer_quotas, replay_count
from ablate.budget import count_for

MODES = ["global", "per_sequence", "no_offsets"]


def select(routes: Routes, budget: float, seed: int, mode: str) -> torch.Tensor:
    if mode == "no_offsets":
        routes = Routes(rollout=routes.rollout, valid=routes.valid, num_experts=routes.num_experts)
    if mode == "per_sequence":
        generator = [torch.Generator().manual_seed(seed * 1000 + s) for s in range(routes.num_sequences)]
        return get_policy("uniform").select(routes, budget, generator=generator, per_sequence=True)
    return get_policy("uniform").select(routes, budget, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.25, 0.5])
@pytest.mark.parametrize("mode", MODES)
def test_no_layer_replays_fixed_positions_on_the_synthetic_shape(budget, mode):
    sequences, positions, layers = 128, 10, 6  # the synthetic backend's batch
    routes = sequence_batch([positions] * sequences, layers, 8, 2, seed=0)
    mask = select(routes, budget, seed=1, mode=mode).reshape(sequences, positions, layers)
    for layer in range(layers):
        covered = mask[:, :, layer]
        per_position = covered.sum(0)
        # Every position is replayed in some sequence, and none takes much more than its share:
        # the old control replayed 1 of 10 positions at b = 0.1, 5 (1, 3, 5, 7, 9) at b = 0.25.
        assert bool((per_position > 0).all()), (layer, per_position.tolist())
        assert int(per_position.max()) <= 2 * budget * sequences + 10, (layer, per_position.tolist())
        # Sequences do not all replay the same positions: within a sequence the positions are
        # evenly spaced (at b = 0.5, every other one), with a phase of their own.
        patterns = Counter(tuple(row.tolist()) for row in covered)
        assert patterns.most_common(1)[0][1] <= 0.7 * sequences, (layer, patterns.most_common(2))


@st.composite
def shapes(draw):
    ragged = draw(st.booleans())
    sequences = draw(st.integers(1, 40))
    if ragged:
        lengths = draw(st.lists(st.integers(1, 24), min_size=sequences, max_size=sequences))
    else:
        lengths = [draw(st.integers(1, 16))] * sequences
    layers = draw(st.integers(1, 6))
    length = max(lengths)
    # Budgets whose spacing divides the sequence length (1/T, 2/T, 1/2, ...) and arbitrary ones.
    budget = draw(st.one_of(
        st.sampled_from([0.1, 0.2, 0.25, 0.5]),
        st.integers(1, length).map(lambda k: k / length),
        st.floats(0.05, 0.95),
    ))
    return lengths, layers, budget, draw(st.sampled_from(MODES)), draw(st.integers(0, 2**20))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(shape=shapes())
def test_uniform_is_exact_and_even_over_positions_sequences_and_layers(shape):
    lengths, layers, budget, mode, seed = shape
    routes = sequence_batch(lengths, layers, 8, 2, seed=seed, padding=0.2)
    valid_tokens = routes.valid_offsets.diff()
    per_sequence = mode == "per_sequence"
    n = replay_count(budget, routes, per_sequence=per_sequence)
    if n == 0:
        return
    # Inclusion probability of each valid route: q_l / V per layer in the global modes,
    # n_s / N_s for every route of sequence s in the per-sequence mode.
    if per_sequence:
        n_s = torch.tensor([count_for(budget, int(v) * layers) for v in valid_tokens], dtype=torch.float64)
        share = (n_s / (valid_tokens * layers).clamp(min=1)).repeat_interleave(valid_tokens)[:, None].expand(-1, layers)
    else:
        quotas = layer_quotas(n, layers, routes.num_valid_tokens).double()
        share = (quotas / routes.num_valid_tokens)[None, :].expand(routes.num_valid_tokens, -1)
    position = torch.cat([torch.arange(int(v)) for v in valid_tokens])
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), valid_tokens)
    layer = torch.arange(layers).expand(routes.num_valid_tokens, -1)
    # Over positions (valid position within the sequence), over sequences and over layers: the
    # observed counts follow the inclusion probabilities. Stratification makes them *more* even
    # than independent draws, so a chi-square test is conservative; a locked stride fails it by
    # orders of magnitude.
    groupings = [position[:, None].expand(-1, layers), sequence[:, None].expand(-1, layers), layer]
    smallest = min(float(_group_sums(g, share)[_group_sums(g, share) > 0].min()) for g in groupings)
    reps = min(40, max(3, math.ceil(5 / smallest)))
    counts = torch.zeros(routes.num_tokens, layers, dtype=torch.float64)
    for rep in range(reps):
        mask = select(routes, budget, seed=seed + rep, mode=mode)
        assert int(mask.sum()) == n
        assert not bool((mask & ~routes.valid[:, None]).any())
        if per_sequence:
            own = torch.stack([mask[a:b].sum() for a, b in zip(routes.offsets[:-1], routes.offsets[1:])])
            assert own.tolist() == n_s.long().tolist()
        else:
            assert mask.sum(0).tolist() == layer_quotas(n, layers, routes.num_valid_tokens).tolist()
        counts += mask
    for groups in groupings:
        _assert_even(_group_sums(groups, counts[routes.valid]), _group_sums(groups, share * reps), (mode, budget, lengths))


def _group_sums(groups: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    flat = groups.reshape(-1)
    return torch.zeros(int(flat.max()) + 1, dtype=torch.float64).index_add_(0, flat, values.reshape(-1))


def _assert_even(observed: torch.Tensor, expected: torch.Tensor, context) -> None:
    """Chi-square goodness of fit; bins expecting fewer than 5 are pooled into one."""
    assert bool((observed[expected == 0] == 0).all()), context
    small = (expected > 0) & (expected < 5)
    observed = torch.cat([observed[expected >= 5], observed[small].sum()[None]])
    expected = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = expected > 0
    if int(keep.sum()) < 2:
        return
    result = chisquare(observed[keep].numpy(), expected[keep].numpy())
    assert result.pvalue > 1e-4, (result, observed.tolist(), expected.tolist(), context)


def test_without_offsets_each_layer_is_a_simple_random_sample():
    # No sequence boundaries: nothing to stratify on beyond the layer, and no stride to lock on.
    routes = sequence_batch([10] * 64, 3, 8, 2, seed=2)
    flat = Routes(rollout=routes.rollout, valid=routes.valid, num_experts=8)
    counts = sum(get_policy("uniform").select(flat, 0.1, generator=torch.Generator().manual_seed(s)).double() for s in range(100))
    per_position = counts.reshape(64, 10, 3).sum((0, 2))
    assert chisquare(per_position.numpy()).pvalue > 1e-4
