"""The synthetic backend: its rollout engine, verl's PPO step, its mechanisms and its regimes."""

import math
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from synthetic_configs import compose_config
from omegaconf import OmegaConf

from ablate.backends.synthetic import (
    Batch,
    FisherProbe,
    MoE,
    MoEPolicy,
    Replay,
    RolloutEngine,
    mini_batches,
    ppo_loss,
    reward,
    rollout_is_weights,
    run_cell_steps,
    sample_prompts,
    token_log_probs,
)
from ablate.compose import cell_from_config
from ablate.backends.synthetic_config import SyntheticConfig
from ablate.diagnostics import validate_record


def run_records(*overrides: str) -> list[dict[str, float]]:
    records: list[dict[str, float]] = []

    def keep(step: int, record: dict[str, float]) -> None:
        validate_record(record)
        records.append(record)

    run_cell_steps(cell_from_config(compose_config(*overrides)), keep)
    return records


def small_config(**changes) -> SyntheticConfig:
    settings = dict(d_model=16, expert_hidden=16, layers=2, experts=4, topk=2, prompts_per_step=4, group_size=4,
                    digits=3, response_length=4)
    return SyntheticConfig(**{**settings, **changes})


def engine_and_rollout(cfg: SyntheticConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = MoEPolicy(cfg, 1 + cfg.digits + cfg.response_length - 1)
    engine = RolloutEngine(model, cfg, torch.Generator().manual_seed(seed + 1))
    prompts = sample_prompts(cfg, torch.Generator().manual_seed(seed + 2)).prompts
    return model, engine, engine.generate(prompts, cfg.response_length, torch.Generator().manual_seed(seed + 3))


# --- the rollout engine ------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["none", "full"])
def test_float32_engine_without_noise_gives_the_training_log_probs(policy):
    records = run_records(f"policy={policy}", "backend.steps=3", "backend.rollout_dtype=float32", "backend.router_noise=0")
    for record in records:
        assert record["mismatch/abs_logratio_max"] < 1e-5
        assert record["routing/route_mismatch_rate"] == 0.0


@pytest.mark.parametrize("perturbation", [0.0, 0.5])
def test_recorded_routes_are_the_routes_that_produced_every_sampled_token(perturbation):
    # A float32 engine with router noise: its KV-cache decoding, redone as one uncached forward
    # with the noise it drew, must route every fed position as recorded and give the recorded
    # log-prob of every sampled token. A position recomputed with fresh noise would not.
    cfg = small_config(rollout_dtype="float32", router_noise=0.3, router_perturbation=perturbation)
    _, engine, rollout = engine_and_rollout(cfg)
    fed = rollout.sequences[:, :-1]
    prompt_len = 1 + cfg.digits
    with torch.no_grad():
        logits, used, _ = engine.model(fed, noise=rollout.router_noise)
        redrawn = torch.randn(rollout.router_noise.shape, generator=torch.Generator().manual_seed(9)) * cfg.router_noise
        _, used_with_other_noise, _ = engine.model(fed, noise=redrawn)
    recorded = rollout.routes.reshape(used.shape)
    assert torch.equal(used, recorded)
    assert not torch.equal(used_with_other_noise, recorded)  # the check can tell routes apart
    logp = token_log_probs(logits, rollout.sequences[:, 1:])[:, prompt_len - 1 :]
    torch.testing.assert_close(logp, rollout.log_probs, atol=1e-5, rtol=0)


def test_systematic_perturbation_misroutes_the_same_tokens_every_time():
    cfg = small_config(rollout_dtype="float32", router_noise=0.0, router_perturbation=0.5)
    model, engine, rollout = engine_and_rollout(cfg)
    again = engine.generate(rollout.sequences[:, : 1 + cfg.digits], cfg.response_length, torch.Generator().manual_seed(3))
    assert torch.equal(again.routes, rollout.routes)  # deterministic: no noise, the same kernels
    with torch.no_grad():
        _, native, _ = model(rollout.sequences[:, :-1])
    assert not torch.equal(native, rollout.routes.reshape(native.shape))  # but not the trainer's router


def test_bfloat16_engine_rounds_weights_and_differs_from_training_slightly():
    cfg = small_config(router_noise=0.0)
    model, engine, rollout = engine_and_rollout(cfg)
    weight = engine.model.head.weight
    assert torch.equal(weight, weight.to(torch.bfloat16).float())
    with torch.no_grad():
        logits, _, _ = model(rollout.sequences[:, :-1])
    logp = token_log_probs(logits, rollout.sequences[:, 1:])[:, cfg.digits :]
    difference = (logp - rollout.log_probs).abs()
    assert float(difference.max()) > 0 and float(difference.median()) < 1e-2


def test_rollout_lag_makes_the_engine_sample_with_older_weights():
    common = ("policy=full", "backend.steps=4", "backend.rollout_dtype=float32", "backend.router_noise=0")
    synchronous = run_records(*common)
    lagged = run_records(*common, "backend.rollout_lag=2")
    assert all(r["mismatch/abs_logratio_max"] < 1e-5 for r in synchronous)
    # Steps 0 and 1 sample with the initial weights; step 0 trains on them too, step 1 does not.
    assert lagged[0]["mismatch/abs_logratio_max"] < 1e-5
    assert all(r["mismatch/abs_logratio_max"] > 1e-3 for r in lagged[1:])


# --- the task ----------------------------------------------------------------------------


def test_task_shift_changes_every_rule():
    cfg = SyntheticConfig(vocab_digits=8, tasks=4, task_shift_step=10)
    batch = Batch(task=torch.tensor([0, 3]), digits=torch.tensor([[3], [6]]), prompts=torch.zeros(2, 2))
    old_rules = torch.tensor([[4, 5, 6], [2, 6, 2]])  # steps of 1 and 4 from 3 and 6
    new_rules = torch.tensor([[0, 5, 2], [6, 6, 6]])  # steps of 5 and 8 = 0 (mod 8)
    assert reward(cfg, batch, old_rules, shifted=False).tolist() == [1.0, 1.0]
    assert reward(cfg, batch, new_rules, shifted=False).tolist() == [0.0, 0.0]
    assert reward(cfg, batch, new_rules, shifted=True).tolist() == [1.0, 1.0]
    assert reward(cfg, batch, old_rules, shifted=True).tolist() == [0.0, 0.0]
    # A task token (8) never counts, but the digit after it is checked against it: (8 + 5) % 8 = 5.
    assert reward(cfg, batch, torch.tensor([[8, 5, 2], [6, 6, 6]]), shifted=True)[0] == pytest.approx(2 / 3)


def test_records_carry_the_chance_level_and_the_shift():
    records = run_records("policy=none", "backend.steps=4", "backend.task_shift_step=2", "backend.digits=4")
    assert [r["train/task_shifted"] for r in records] == [0.0, 0.0, 1.0, 1.0]
    assert all(r["train/reward_chance"] == pytest.approx(1 / 12) for r in records)  # 8 digits + 4 task tokens


# --- verl's PPO step ---------------------------------------------------------------------


def test_ppo_loss_matches_verl_vanilla_by_hand_and_clip_fraction_counts_removed_gradients():
    # A > 0, r = e (clipped at 1.2); A > 0, r = 0.61 (pessimistic term is the unclipped one);
    # A < 0, r = 0.5 (clipped at 0.8); A < 0, r = 4 (dual clip caps at 3); A < 0, r = 1.5 (unclipped).
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    log_ratio = torch.tensor([[1.0, -0.5, math.log(0.5), math.log(4.0), math.log(1.5)]])
    log_probs = log_ratio.clone().requires_grad_()
    loss, clip_frac, clip_frac_lower = ppo_loss(log_probs, torch.zeros(1, 5), advantages, None, 0.2, 3.0)
    assert float(loss.detach()) == pytest.approx((-1.2 - math.exp(-0.5) + 0.8 + 3.0 + 1.5) / 5)
    assert float(clip_frac) == pytest.approx(2 / 5) and float(clip_frac_lower) == pytest.approx(1 / 5)
    loss.backward()
    assert (log_probs.grad != 0).tolist() == [[False, True, False, False, True]]

    weights = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.5]])
    weighted, _, _ = ppo_loss(log_ratio, torch.zeros(1, 5), advantages, weights, 0.2, 3.0)
    assert float(weighted) == pytest.approx((-2.4 - math.exp(-0.5) + 0.8 + 3.0 + 0.75) / 5)


def test_truncated_importance_weights_by_hand():
    log_ratio = torch.tensor([[math.log(3.0), math.log(0.5)], [math.log(1.5), 0.0]])
    token, metrics = rollout_is_weights(log_ratio, "token", 2.0, batch_normalize=False)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5], [1.5, 1.0]]))
    assert metrics["train/is_weight_mean"] == pytest.approx(5 / 4)
    assert metrics["train/is_truncated_frac"] == pytest.approx(1 / 4)
    sequence, metrics = rollout_is_weights(log_ratio, "sequence", 1.2, batch_normalize=False)
    torch.testing.assert_close(sequence, torch.full((2, 2), 1.2))  # both products are 1.5
    assert metrics["train/is_truncated_frac"] == 1.0
    sequence, metrics = rollout_is_weights(log_ratio, "sequence", 2.0, batch_normalize=False)
    torch.testing.assert_close(sequence, torch.full((2, 2), 1.5))
    assert metrics["train/is_truncated_frac"] == 0.0
    normalized, metrics = rollout_is_weights(log_ratio, "token", 2.0, batch_normalize=True)
    torch.testing.assert_close(normalized, torch.tensor([[2.0, 0.5], [1.5, 1.0]]) / 1.25)
    assert metrics["train/is_weight_mean"] == pytest.approx(5 / 4)  # reported before normalisation


def test_mini_batches_are_consecutive_prompt_groups_repeated_per_epoch():
    cfg = SyntheticConfig(prompts_per_step=4, group_size=3, ppo_mini_batch_size=2, ppo_epochs=2)
    assert mini_batches(cfg) == [slice(0, 6), slice(6, 12)] * 2


def test_each_mini_batch_of_each_epoch_is_one_optimizer_step(monkeypatch):
    calls = []
    original = torch.optim.Adam.step
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    run_records("policy=none", "backend.steps=2", "backend.ppo_mini_batch_size=2", "backend.ppo_epochs=3")
    assert len(calls) == 2 * 3 * 2  # steps x epochs x (4 prompts / 2 per mini-batch)


@pytest.mark.parametrize("policy", ["none", "full", "random"])
def test_ratio_against_old_log_probs_is_one_at_the_first_update(policy):
    # One mini-batch, one epoch: the old-log-prob pass replays the same mask at the same weights,
    # so no token's ratio leaves 1 and the clip removes nothing, however large the mismatch.
    common = (f"policy={policy}", "backend.steps=3", "backend.router_noise=0.5", "backend.ppo_mini_batch_size=4")
    budget = ("budget=0.5",) if policy == "random" else ()
    for record in run_records(*common, *budget):
        assert record["train/clip_frac"] == 0.0 and record["train/clip_frac_lower"] == 0.0
        assert record["mismatch/kl_k3"] > 0
    if policy == "none":  # bypass: the ratio is against the rollout, and the mismatch gets clipped
        bypass = run_records(*common, "backend.bypass_mode=true")
        assert sum(r["train/clip_frac"] for r in bypass) > 0


def test_mismatch_policy_replays_in_the_old_pass_unless_told_to_mirror_the_verl_backend():
    common = ("policy=mismatch", "budget=0.5", "backend.steps=3", "backend.router_noise=0.5", "backend.ppo_mini_batch_size=4")
    assert all(r["train/clip_frac"] == 0.0 and r["train/clip_frac_lower"] == 0.0 for r in run_records(*common))
    # Against its native pass, the ratio of every replayed mismatched route starts away from 1.
    native = run_records(*common, "backend.mismatch_native_old_pass=true")
    assert sum(r["train/clip_frac"] + r["train/clip_frac_lower"] for r in native) > 0


def test_rollout_correction_weights_are_logged_only_when_enabled():
    off = run_records("policy=none", "backend.steps=2")
    assert all(math.isnan(r["train/is_weight_mean"]) for r in off)
    on = run_records("policy=none", "backend.steps=2", "backend.rollout_is=sequence", "backend.rollout_is_threshold=1.5",
                     "backend.router_noise=0.5")
    assert all(0 < r["train/is_weight_mean"] <= 1.5 and 0 <= r["train/is_truncated_frac"] <= 1 for r in on)


# --- sparse experts and the Fisher probe -------------------------------------------------


def dense_moe(moe: MoE, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then the chosen ones: the reference for the sparse path."""
    gates = moe.router(x).gather(-1, chosen).softmax(-1)
    out = torch.einsum("neh,ehd->ned", F.gelu(torch.einsum("nd,edh->neh", x, moe.w_in)), moe.w_out)
    return (gates[..., None] * out.gather(1, chosen[..., None].expand(-1, -1, x.shape[1]))).sum(1)


def test_sparse_experts_equal_dense_experts_with_gradients():
    torch.manual_seed(0)
    moe = MoE(small_config())
    x = torch.randn(7, 16, requires_grad=True)
    y, chosen, native = moe(x, 0, None, None, None)
    assert torch.equal(chosen, native)
    reference = dense_moe(moe, x, chosen)
    torch.testing.assert_close(y, reference)
    grads = torch.autograd.grad(y.square().sum(), [x, moe.w_in, moe.w_out, moe.router.weight])
    expected = torch.autograd.grad(reference.square().sum(), [x, moe.w_in, moe.w_out, moe.router.weight])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("estimator", ["router_logits", "expert_outputs", "expert_params"])
def test_fisher_probe_gives_per_token_squared_gradients(estimator):
    # Token-local losses: the probe's per-token value must equal each token's own gradient, taken
    # alone by autograd, for every (token, expert) it counts.
    torch.manual_seed(0)
    moe = MoE(small_config())
    x = torch.randn(5, 16)
    coefficients = torch.randn(5, 16)
    probe = FisherProbe(estimator, 4)
    replay = Replay(routes=torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]], [[0, 3]], [[3, 1]]]), mask=torch.ones(5, 1, dtype=torch.bool))
    y, chosen, _ = moe(x, 0, replay, None, probe)
    (coefficients * y).sum().backward()
    values, weights = probe.sq_grads(torch.ones(5, dtype=torch.bool), scale=1.0)
    for token in range(5):
        moe.zero_grad()
        single = FisherProbe(estimator, 4)
        y_token, _, _ = moe(x[token : token + 1], 0, Replay(replay.routes[token : token + 1], replay.mask[token : token + 1]), None, single)
        (coefficients[token] * y_token).sum().backward()
        for expert in range(4):
            routed = expert in chosen[token].tolist()
            if estimator == "router_logits":
                want = float(single.logits.grads[0][0, expert] ** 2)
            elif not routed:
                assert weights[token, 0, expert] == 0
                continue
            elif estimator == "expert_outputs":
                want = float(single.sq_grads(torch.ones(1, dtype=torch.bool), 1.0)[0][0, 0, expert])
                row = (single.routed[0]["expert"] == expert).nonzero()[0, 0]
                assert want == pytest.approx(float(single.outputs.grads[0][row].square().sum()))
            else:
                want = float(moe.w_in.grad[expert].square().sum() + moe.w_out.grad[expert].square().sum())
            assert float(values[token, 0, expert]) == pytest.approx(want, rel=1e-4)


# --- settings and regimes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("backend.ppo_mini_batch_size=3", "backend.ppo_mini_batch_size=3: expected a divisor of backend.prompts_per_step=4"),
        ("backend.d_model=12", "backend.d_model=12: expected a multiple of 8"),
        ("backend.rollout_lag=-1", "backend.rollout_lag=-1: expected an integer >= 0"),
        ("backend.task_shift_step=6", r"backend.task_shift_step=6: expected an integer in \[1, 5\] \(backend.steps - 1\)"),
        ("backend.clip_ratio_c=1.0", "backend.clip_ratio_c=1.0: expected a ratio > 1"),
        ("backend.rollout_dtype=int8", "backend.rollout_dtype=int8: expected one of float32, float16, bfloat16"),
        ("backend.group_size=1", "backend.group_size=1: expected an integer >= 2"),
    ],
)
def test_bad_settings_are_named(override, message):
    cfg = compose_config("policy=none", override).backend
    with pytest.raises(ValueError, match=message):
        OmegaConf.to_object(cfg).check()


def test_rollout_correction_is_refused_in_bypass_mode():
    cfg = OmegaConf.to_object(compose_config("backend.bypass_mode=true", "backend.rollout_is=token").backend)
    with pytest.raises(ValueError, match="backend.rollout_is=.*expected null with backend.bypass_mode=true"):
        cfg.check()


REGIMES = sorted(Path(p.name).stem for p in resources.files("ablate.conf").joinpath("backend").iterdir()
                 if p.name.startswith("synthetic") and p.name.endswith(".yaml"))


def test_each_named_regime_has_its_own_name():
    names = [OmegaConf.to_object(compose_config(f"backend={regime}").backend).regime for regime in REGIMES]
    assert len(REGIMES) >= 5 and len(set(names)) == len(names)


@pytest.mark.parametrize("regime", REGIMES)
def test_each_named_regime_runs(regime):
    # The regime's own settings, shrunk by TINY; a shift or a lag must still fit in 6 steps.
    shrink = ["backend.task_shift_step=3"] if "shift" in regime else []
    records = run_records(f"backend={regime}", "policy=mismatch", "budget=0.5", *shrink)
    assert len(records) == 6
