import logging
import math

import pytest
import torch
from handbatch import FISHER, hand_routes

from ablate import FisherTracker, PolicyError, get_policy
from ablate.fisher import (
    FisherError,
    GradientCapture,
    check_tracker_settings,
    expert_output_sq_grads,
    linear_param_sq_grads,
    router_logit_sq_grads,
)


def test_ema_is_bias_corrected_and_keeps_unseen_entries():
    tracker = FisherTracker(1, 2, decay=0.5)
    assert not tracker.has_estimate
    # Step 1: expert 0 sees per-token squares 1 and 3 (mean 2); expert 1 sees nothing.
    tracker.accumulate(torch.tensor([[[1.0, 9.0]], [[3.0, 9.0]]]), torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]]))
    tracker.step()
    assert tracker.has_estimate
    assert tracker.estimate().tolist() == [[2.0, 0.0]]  # bias correction: 0.5 * 2 / (1 - 0.5) = 2
    # Step 2: expert 0 mean 4, expert 1 mean 8 (first sighting -> exactly 8).
    tracker.accumulate(torch.tensor([[[4.0, 8.0]]]), torch.ones(1, 1, 1))
    tracker.step()
    # expert 0: ema = 0.5 * 1 + 0.5 * 4 = 2.5 (raw was 1), corrected / (1 - 0.25) = 10/3
    assert tracker.estimate()[0, 0].item() == pytest.approx(10 / 3)
    assert tracker.estimate()[0, 1].item() == pytest.approx(8.0)
    # Step 3 sees nothing: the estimate stays.
    before = tracker.estimate()
    tracker.step()
    assert torch.equal(tracker.estimate(), before)


def test_normalisation_and_state_dict():
    tracker = FisherTracker(2, 2, decay=0.0, normalize="layer")
    tracker.accumulate(torch.tensor([[[1.0, 3.0], [2.0, 2.0]]]), torch.ones(1, 1, 1))
    tracker.step()
    assert tracker.scores().tolist() == [[0.25, 0.75], [0.5, 0.5]]
    tracker.normalize = "global"
    assert tracker.scores().sum().item() == pytest.approx(1.0)
    clone = FisherTracker(2, 2)
    clone.load_state_dict(tracker.state_dict())
    assert torch.equal(clone.scores(), tracker.scores()) and clone.steps == 1
    with pytest.raises(ValueError, match=r"Fisher state has shape \(2, 2\): expected \[layers, experts\]=\(3, 2\)"):
        FisherTracker(3, 2).load_state_dict(tracker.state_dict())
    with pytest.raises(FisherError, match="normalize='max'"):
        FisherTracker(1, 1, normalize="max")


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.1, float("nan"), "0.9", True, None])
def test_out_of_range_decay_is_named(decay):
    with pytest.raises(FisherError, match=rf"decay={decay!r} in the Fisher tracker: expected an EMA decay in \[0, 1\)"):
        FisherTracker(1, 1, decay=decay)
    with pytest.raises(FisherError, match="decay="):
        check_tracker_settings(decay=decay)
    state = FisherTracker(1, 1).state_dict()
    state["decay"] = decay
    with pytest.raises(FisherError, match="decay="):
        FisherTracker(1, 1).load_state_dict(state)


@pytest.mark.parametrize("layers, experts", [(0, 4), (2, -1), (2.5, 4), (True, 4)])
def test_bad_tracker_shapes_are_named(layers, experts):
    with pytest.raises(FisherError, match="expected a positive integer"):
        FisherTracker(layers, experts)


def test_non_finite_contributions_are_skipped_counted_and_warned(caplog):
    tracker = FisherTracker(1, 3, decay=0.0)
    sq = torch.tensor([[[1.0, float("nan"), 5.0]], [[3.0, 2.0, float("inf")]], [[float("nan"), 4.0, 1.0]]])
    weights = torch.tensor([[[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]], [[0.0, 1.0, 1.0]]])  # token 2 not routed to expert 0
    with caplog.at_level(logging.WARNING, logger="ablate.fisher"):
        tracker.accumulate(sq, weights)
        tracker.step()
    # expert 0: tokens 0, 1 (token 2's NaN has weight 0: not a contribution) -> mean 2
    # expert 1: token 0 skipped -> mean of 2 and 4 = 3; expert 2: token 1 skipped -> mean of 5 and 1 = 3
    assert tracker.estimate().tolist() == [[2.0, 3.0, 3.0]]
    assert tracker.nonfinite_last_step == 2 and tracker.nonfinite_total == 2
    assert "skipped 2 non-finite" in caplog.text
    tracker.accumulate(torch.ones(1, 1, 3), torch.ones(1, 1, 1))
    tracker.step()
    assert tracker.nonfinite_last_step == 0 and tracker.nonfinite_total == 2
    assert bool(torch.isfinite(tracker.scores()).all())
    with pytest.raises(FisherError, match="negative or non-finite"):
        tracker.accumulate(torch.ones(1, 1, 3), -torch.ones(1, 1, 1))


def test_unusable_estimates_fall_back_to_random_and_say_so():
    routes = hand_routes()

    class Broken:
        has_estimate = True

        def __init__(self, scores):
            self._scores = scores

        def scores(self):
            return self._scores

    random_mask = get_policy("random").select(routes, 0.5, generator=torch.Generator().manual_seed(3))
    for scores in (torch.full((2, 4), float("nan")), torch.zeros(2, 4), FISHER.clone().index_fill_(1, torch.tensor([0]), math.inf)):
        policy = get_policy("fisher", fisher=Broken(scores))
        mask = policy.select(routes, 0.5, generator=torch.Generator().manual_seed(3))
        assert policy.info["fisher_fallback"] == 1.0
        assert torch.equal(mask, random_mask)
    policy = get_policy("fisher", fisher=Broken(FISHER))
    policy.select(routes, 0.5, generator=torch.Generator().manual_seed(3))
    assert policy.info["fisher_fallback"] == 0.0


@pytest.mark.parametrize("scores, message", [
    (torch.rand(3), r"scores has shape \(3,\) in policy=fisher: expected \[layers, experts\]"),
    (torch.rand(2, 0), r"scores has shape \(2, 0\)"),
    ([[1.0, 2.0]], "scores is a list in policy=fisher"),
    (torch.tensor([[1.0, float("nan")]]), r"scores\[0, 1\]=nan in policy=fisher: expected finite"),
    (torch.tensor([[1.0], [-2.0]]), r"scores\[1, 0\]=-2.0 in policy=fisher: expected non-negative"),
    (torch.ones(2, 2, dtype=torch.bool), "dtype torch.bool"),
])
def test_bad_fisher_scores_are_rejected_when_the_policy_is_built(scores, message):
    with pytest.raises(PolicyError, match=message):
        get_policy("fisher", scores=scores)


def test_fisher_shapes_are_checked_against_the_routes_at_select():
    with pytest.raises(PolicyError, match=r"Fisher estimate has shape \(3, 4\): expected \[layers, experts\]=\(2, 4\)"):
        get_policy("fisher", scores=torch.rand(3, 4)).select(hand_routes(), 0.5)
    tracker = FisherTracker(2, 5, decay=0.0)
    tracker.accumulate(torch.rand(1, 2, 5), torch.ones(1, 1, 1))
    tracker.step()
    with pytest.raises(PolicyError, match=r"Fisher estimate has shape \(2, 5\)"):
        get_policy("fisher", fisher=tracker).select(hand_routes(), 0.5)
    with pytest.raises(PolicyError, match="fisher=str in policy=fisher: expected a Fisher source"):
        get_policy("fisher", fisher="tracker")


def test_tracker_drives_the_fisher_policy():
    tracker = FisherTracker(2, 4, decay=0.0)
    policy = get_policy("fisher", fisher=tracker)
    policy.select(hand_routes(), 0.5, generator=torch.Generator().manual_seed(0))
    assert policy.info["fisher_fallback"] == 1.0
    tracker.accumulate(torch.tensor([[[4.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0]]]), torch.ones(1, 1, 1))
    tracker.step()
    mask = policy.select(hand_routes(), 0.5, generator=torch.Generator().manual_seed(0))
    assert policy.info["fisher_fallback"] == 0.0
    assert mask.tolist() == [[True, True], [True, False], [False, False], [False, False]]


def _tiny_moe(tokens=5, hidden=3, experts=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g, requires_grad=True)
    weights = torch.randn(experts, hidden, hidden, generator=g, requires_grad=True)
    target = torch.randn(tokens, hidden, generator=g)
    return x, router, weights, target


def _per_token_losses(x, router, weights, target, capture=None):
    logits = x @ router.T
    if capture is not None:
        logits = capture.watch(0, logits)
    gates = logits.softmax(-1)  # dense soft MoE: each token's output mixes all experts
    outputs = torch.einsum("eoi,ti->teo", weights, x)
    y = (gates[..., None] * outputs).sum(1)
    return ((y - target) ** 2).sum(-1), logits, outputs


def test_router_logit_estimator_equals_per_token_autograd():
    x, router, weights, target = _tiny_moe()
    capture = GradientCapture()
    losses, _, _ = _per_token_losses(x, router, weights, target, capture)
    losses.sum().backward()
    got = router_logit_sq_grads(capture.stacked())  # [tokens, layers=1, experts]
    for t in range(x.shape[0]):  # per-token gradients, one backward each (test-side reference)
        xt = x[t : t + 1].clone()
        logits = (xt @ router.T).detach().requires_grad_()
        gates = logits.softmax(-1)
        y = (gates[..., None] * torch.einsum("eoi,ti->teo", weights.detach(), xt)).sum(1)
        (grad,) = torch.autograd.grad(((y - target[t]) ** 2).sum(), logits)
        assert torch.allclose(got[t, 0], grad[0] ** 2, atol=1e-6)
    with pytest.raises(RuntimeError, match="no gradient was captured"):
        GradientCapture().stacked()


def test_expert_param_ghost_norm_equals_per_token_weight_gradient():
    x, router, weights, target = _tiny_moe()
    losses, _, outputs = _per_token_losses(x, router, weights, target)
    outputs.retain_grad()
    losses.sum().backward()
    ghost = linear_param_sq_grads(x[:, None, :].expand(-1, 4, -1), outputs.grad)  # [tokens, experts]
    for t in range(x.shape[0]):
        (grad,) = torch.autograd.grad(_per_token_losses(x, router, weights, target)[0][t], weights)
        assert torch.allclose(ghost[t], grad.square().sum((1, 2)), rtol=1e-4)
    assert torch.allclose(expert_output_sq_grads(outputs.grad), outputs.grad.square().sum(-1))
