import pytest
import torch

from ablate import FisherTracker, get_policy
from ablate.fisher import GradientCapture, expert_output_sq_grads, linear_param_sq_grads, router_logit_sq_grads


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
    with pytest.raises(ValueError, match="decay=1.0"):
        FisherTracker(1, 1, decay=1.0)
    with pytest.raises(ValueError, match="normalize='max'"):
        FisherTracker(1, 1, normalize="max")


def test_tracker_drives_the_fisher_policy():
    from handbatch import hand_routes

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
