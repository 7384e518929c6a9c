"""Every policy on the hand batch (tests/handbatch.py), then properties over random batches."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from handbatch import FISHER, VALID, hand_routes, sequence_batch

from ablate import BudgetError, PolicyError, ReplayPolicy, Routes, get_policy, layer_quotas, register_policy, replay_count
from ablate.policies import BudgetViolation, available_policies, replay_mask


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_replay_count_rounds_half_up():
    routes = hand_routes()  # N = 6
    assert replay_count(0.25, routes) == 2  # 1.5 + 0.5 = 2.0 -> 2
    assert replay_count(0.2, routes) == 1  # 1.2 + 0.5 = 1.7 -> 1
    assert replay_count(0.5, routes) == 3
    assert replay_count(0.0, routes) == 0 and replay_count(1.0, routes) == 6
    assert replay_count(0.25, 10) == 3  # 2.5 + 0.5 = 3.0 -> 3 (half up, not banker's)
    assert replay_count(0.5, routes, per_layer=True) == 3


@pytest.mark.parametrize("budget", [1.5, -0.1, float("nan"), "0.5", True, None])
def test_bad_budget_is_named(budget):
    with pytest.raises(BudgetError, match="budget=.*policy=random"):
        get_policy("random").select(hand_routes(), budget)


def test_none_and_full_have_fixed_budgets():
    routes = hand_routes()
    assert not get_policy("none").select(routes).any()
    assert torch.equal(get_policy("full").select(routes), VALID[:, None].expand(4, 2))
    assert torch.equal(get_policy("full").select(routes, 1.0), VALID[:, None].expand(4, 2))
    with pytest.raises(BudgetError, match=r"budget=0.3 in policy=none: .*budget is 0"):
        get_policy("none").select(routes, 0.3)
    with pytest.raises(BudgetError, match=r"budget=0.5 in policy=full"):
        get_policy("full").select(routes, 0.5)


def test_mismatch_replays_largest_disagreement_first():
    routes = hand_routes()
    # n = 1: (t1, l0) differs in 2 experts, (t0, l1) in 1 -> only (t1, l0).
    mask = get_policy("mismatch").select(routes, 0.2, generator=gen())
    assert mask.tolist() == [[False, False], [True, False], [False, False], [False, False]]
    # n = 2: both mismatched routes.
    mask = get_policy("mismatch").select(routes, 0.25, generator=gen())
    assert mask.tolist() == [[False, True], [True, False], [False, False], [False, False]]


def test_mismatch_without_native_routes_is_a_clear_error():
    with pytest.raises(PolicyError, match="needs native routes"):
        get_policy("mismatch").select(hand_routes(native=False), 0.5)


def test_fisher_takes_the_top_scores():
    routes = hand_routes()
    # scores: t0l0=5, t1l0=4, t0l1=3, the rest 1 -> n=3 takes exactly those three.
    mask = get_policy("fisher", scores=FISHER).select(routes, 0.5, generator=gen())
    assert mask.tolist() == [[True, True], [True, False], [False, False], [False, False]]
    # n = 2 -> t0l0 and t1l0.
    mask = get_policy("fisher", scores=FISHER).select(routes, 0.25, generator=gen())
    assert mask.tolist() == [[True, False], [True, False], [False, False], [False, False]]


def test_fisher_per_layer_quotas():
    # n = 3 over 2 layers: quotas [1, 2] (the remainder goes to layer floor(0.5 * 2 / 1) = 1).
    # Layer 0 takes t0 (5); layer 1 takes t0 (3) then one of the tied t1, t2 (score 1 each).
    mask = get_policy("fisher", scores=FISHER, per_layer=True).select(hand_routes(), 0.5, generator=gen())
    assert mask[:, 0].tolist() == [True, False, False, False]
    assert mask[0, 1] and int(mask[:, 1].sum()) == 2 and not mask[3].any()


def test_fisher_without_estimate_falls_back_to_random():
    class Empty:
        has_estimate = False

        def scores(self):
            raise AssertionError("must not be read")

    policy = get_policy("fisher", fisher=Empty())
    mask = policy.select(hand_routes(), 0.5, generator=gen(3))
    assert policy.info["fisher_fallback"] == 1.0
    assert torch.equal(mask, get_policy("random").select(hand_routes(), 0.5, generator=gen(3)))


def test_fisher_temperature_interpolates_to_random():
    routes = hand_routes()
    cold = get_policy("fisher", scores=FISHER, tau=1e-6).select(routes, 0.5, generator=gen(1))
    assert torch.equal(cold, get_policy("fisher", scores=FISHER).select(routes, 0.5, generator=gen(1)))
    # With a huge temperature every valid route gets picked in some seed.
    hot = sum(get_policy("fisher", scores=FISHER, tau=1e6).select(routes, 0.2, generator=gen(s)).int() for s in range(60))
    assert bool((hot[:3] > 0).all())


def test_uniform_stratifies_by_sequence_with_an_offset_per_sequence_and_layer():
    # 3 sequences of 4 valid tokens, 2 layers, b = 0.25: n = 6, quotas [3, 3]. The spacing V / q = 4
    # equals the sequence length, so each sequence gets one route per layer, at valid position
    # floor(u[s, l] * 4) with its own offset u[s, l]: never one position for every sequence.
    routes = sequence_batch([4, 4, 4], 2, 5, 2, seed=0)
    g = gen(5)
    torch.rand((1, 2), generator=g, dtype=torch.float64)  # the per-layer starts of the sequence allocation
    offsets = torch.rand((1, 3, 2), generator=g, dtype=torch.float64)[0]  # then one offset per (sequence, layer)
    mask = get_policy("uniform").select(routes, 0.25, generator=gen(5))
    expected = torch.zeros(12, 2, dtype=torch.bool)
    for sequence in range(3):
        for layer in range(2):
            expected[4 * sequence + int(offsets[sequence, layer] * 4), layer] = True
    assert torch.equal(mask, expected)


def test_random_is_seeded():
    routes = hand_routes()
    masks = {tuple(get_policy("random").select(routes, 0.5, generator=gen(s)).flatten().tolist()) for s in range(30)}
    assert len(masks) > 5  # different seeds give different masks ...
    assert torch.equal(  # ... the same seed the same one
        get_policy("random").select(routes, 0.5, generator=gen(7)), get_policy("random").select(routes, 0.5, generator=gen(7))
    )


def test_registry_errors_and_user_policies():
    with pytest.raises(PolicyError, match=r"unknown policy 'fishr': expected one of .*fisher"):
        get_policy("fishr")
    with pytest.raises(PolicyError, match=r"policy=random got unknown setting\(s\) tau: expected per_layer"):
        get_policy("random", tau=1.0)

    @register_policy("last_layer_first")
    class LastLayerFirst(ReplayPolicy):
        def __init__(self, *, per_layer: bool = False):
            super().__init__(per_layer=per_layer)

        def route_keys(self, routes, rows, draws):
            return torch.arange(routes.num_layers, dtype=torch.float32).expand(rows.numel(), -1)

    assert "last_layer_first" in available_policies()
    mask = get_policy("last_layer_first").select(hand_routes(), 0.5, generator=gen())
    assert mask[:, 1].tolist() == [True, True, True, False] and not mask[:, 0].any()


# ---- properties over random batches ---------------------------------------------------------


@st.composite
def batches(draw):
    tokens = draw(st.integers(1, 40))
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 9))
    topk = draw(st.integers(1, min(experts, 4)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    def draw_routes():
        return torch.rand(tokens, layers, experts, generator=g).argsort(-1)[..., :topk].to(torch.int16)
    valid = torch.rand(tokens, generator=g) < draw(st.floats(0.1, 1.0))
    valid[draw(st.integers(0, tokens - 1))] = True
    return Routes(rollout=draw_routes(), valid=valid, num_experts=experts, native=draw_routes())


BUDGETED = ["random", "uniform", "fisher", "mismatch"]


def make(name: str, routes: Routes, per_layer: bool) -> ReplayPolicy:
    if name == "fisher":
        return get_policy(name, scores=torch.rand(routes.num_layers, routes.num_experts), per_layer=per_layer)
    return get_policy(name) if name == "uniform" else get_policy(name, per_layer=per_layer)


@settings(max_examples=60, deadline=None)
@given(routes=batches(), budget=st.floats(0.0, 1.0), seed=st.integers(0, 1000), per_layer=st.booleans())
def test_every_policy_replays_exactly_the_budget(routes, budget, seed, per_layer):
    for name in BUDGETED:
        policy = make(name, routes, per_layer)
        mask = policy.select(routes, budget, generator=gen(seed))
        assert mask.dtype == torch.bool and mask.shape == (routes.num_tokens, routes.num_layers)
        assert int(mask.sum()) == replay_count(budget, routes), name
        assert not bool((mask & ~routes.valid[:, None]).any()), name
        assert torch.equal(mask, policy.select(routes, budget, generator=gen(seed))), name
        if per_layer or name == "uniform":
            quotas = layer_quotas(replay_count(budget, routes), routes.num_layers, routes.num_valid_tokens)
            assert mask.sum(0).tolist() == quotas.tolist(), name


@settings(max_examples=60, deadline=None)
@given(routes=batches(), budget=st.floats(0.0, 1.0), seed=st.integers(0, 1000), data=st.data())
def test_one_hot_fisher_replays_routes_with_the_hot_expert_first(routes, budget, seed, data):
    layer = data.draw(st.integers(0, routes.num_layers - 1))
    expert = data.draw(st.integers(0, routes.num_experts - 1))
    scores = torch.zeros(routes.num_layers, routes.num_experts)
    scores[layer, expert] = 1.0
    mask = get_policy("fisher", scores=scores).select(routes, budget, generator=gen(seed))
    hot = torch.zeros_like(mask)
    hot[:, layer] = (routes.rollout[:, layer] == expert).any(-1) & routes.valid
    n, num_hot = int(mask.sum()), int(hot.sum())
    if n <= num_hot:
        assert not bool((mask & ~hot).any())  # only hot routes
    else:
        assert bool((mask | ~hot).all())  # every hot route, then the rest


def test_policies_run_on_the_device_of_their_inputs():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine; the CPU path is covered everywhere else")
    routes = hand_routes()
    cuda = Routes(rollout=routes.rollout.cuda(), valid=routes.valid.cuda(), num_experts=4, native=routes.native.cuda())
    for name in BUDGETED:
        mask = make(name, cuda, False).select(cuda, 0.5, generator=gen(0))
        assert mask.device.type == "cuda"


def test_padding_ids_are_never_read():
    # verl pads with zeros, other engines with -1: neither may reach a gather or a range check.
    routes = hand_routes()
    rollout = routes.rollout.clone()
    rollout[3] = -1
    padded = Routes(rollout=rollout, valid=routes.valid, num_experts=4, native=routes.native)
    for name in BUDGETED:
        policy = make(name, padded, False) if name != "fisher" else get_policy("fisher", scores=FISHER)
        assert torch.equal(policy.select(padded, 0.5, generator=gen(0)), policy.select(routes, 0.5, generator=gen(0)))


# ---- replay_mask: the budget checked outside the policy ---------------------------------------


@settings(max_examples=40, deadline=None)
@given(routes=batches(), budget=st.floats(0.0, 1.0), seed=st.integers(0, 1000), per_layer=st.booleans())
def test_replay_mask_accepts_every_builtin_policy_in_both_modes(routes, budget, seed, per_layer):
    per_sequence = Routes(rollout=routes.rollout, valid=routes.valid, num_experts=routes.num_experts,
                          native=routes.native, offsets=torch.tensor([0, routes.num_tokens // 2, routes.num_tokens]))
    for name in BUDGETED:
        policy = make(name, routes, per_layer)
        assert torch.equal(replay_mask(policy, routes, budget, generator=gen(seed)),
                           policy.select(routes, budget, generator=gen(seed)))
        generators = [gen(seed), gen(seed + 1)]
        replay_mask(policy, per_sequence, budget, generator=generators, per_sequence=True)


class _Shifted(ReplayPolicy):
    """Replays the right number of routes, but one too many in the first sequence and one too few in the last."""

    name = "shifted"

    def select(self, routes, budget=None, *, generator=None, per_sequence=False):
        mask = get_policy("random").select(routes, budget, generator=generator, per_sequence=per_sequence)
        first, last = mask[0].clone(), mask[-1].clone()
        mask[0], mask[-1] = first | ~first & torch.arange(mask.shape[1]).eq(int((~first).nonzero()[0])), last
        mask[-1, int(last.nonzero()[0])] = False
        return mask

    def route_keys(self, routes, rows, draws):
        return None


def test_replay_mask_names_a_sequence_whose_count_is_off_though_the_total_is_right():
    routes = sequence_batch([6, 6], layers=2, experts=4, topk=2, seed=0)
    generators = [gen(0), gen(1)]
    with pytest.raises(BudgetViolation, match=r"policy=shifted \(_Shifted\) at budget=0.5 replayed 7 routes in "
                                              r"sequence 0: expected exactly 6"):
        replay_mask(_Shifted(), routes, 0.5, generator=generators, per_sequence=True)


class _OneLayer(ReplayPolicy):
    """Replays the budget's count of routes, all in the first layers, though it says per_layer."""

    name = "one_layer"

    def __init__(self) -> None:
        super().__init__(per_layer=True)

    def select(self, routes, budget=None, *, generator=None, per_sequence=False):
        mask = torch.zeros(routes.num_tokens, routes.num_layers, dtype=torch.bool)
        mask[:, 0] = True  # budget 0.5 of two layers: the right count, all of it in layer 0
        return mask

    def route_keys(self, routes, rows, draws):
        return None


def test_replay_mask_names_a_layer_whose_quota_is_off():
    routes = Routes(rollout=torch.zeros(8, 2, 1, dtype=torch.long), valid=torch.ones(8, dtype=torch.bool),
                    num_experts=2)
    with pytest.raises(BudgetViolation, match=r"with per_layer=true replayed 8 routes in layer 0: expected exactly "
                                              r"its quota 4"):
        replay_mask(_OneLayer(), routes, 0.5)


@pytest.mark.parametrize(("returned", "said"), [
    (lambda routes: torch.ones(routes.num_tokens, routes.num_layers), "returned a mask of torch.float32"),
    (lambda routes: torch.ones(routes.num_tokens, dtype=torch.bool), "expected torch.bool [tokens, layers]"),
    (lambda routes: torch.ones(routes.num_tokens, routes.num_layers, dtype=torch.bool),
     "replayed routes of invalid (padding) tokens"),
])
def test_replay_mask_refuses_a_mask_of_the_wrong_kind(returned, said):
    class Odd(ReplayPolicy):
        name = "odd"

        def select(self, routes, budget=None, *, generator=None, per_sequence=False):
            return returned(routes)

        def route_keys(self, routes, rows, draws):
            return None

    with pytest.raises(BudgetViolation, match=re.escape(said)):
        replay_mask(Odd(), hand_routes(), 0.5)
