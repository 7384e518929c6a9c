"""verl backend on CPU against verl 0.9.1's real router-replay code and megatron's TopKRouter."""

import os
from pathlib import Path

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402

pytestmark = pytest.mark.verl

NUM_LAYERS, NUM_EXPERTS, TOPK = 3, 8, 2
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"


@pytest.fixture(scope="module")
def routers():
    """Three real TopKRouters patched by verl's apply_router_replay_patch, in a one-rank gloo group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    router_replay_utils.device_name = "cpu"
    apply_router_replay_patch()
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK, moe_router_load_balancing_type="none", enable_routing_replay=True,
        use_cpu_initialization=True, add_bias_linear=False,
    )
    pg = ProcessGroupCollection.use_mpu_process_groups()
    model = torch.nn.Module()
    model.decoder = torch.nn.ModuleList()
    for layer in range(NUM_LAYERS):
        router = TopKRouter(config, pg_collection=pg)
        router.set_layer_number(layer + 1)
        model.decoder.append(router)
    yield model, config
    parallel_state.destroy_model_parallel()


@pytest.fixture()
def hooked():
    from ablate.backends.verl import hook

    installed = []

    def make(policy, budget, seed=0, **settings):
        installed.append(hook.install(hook.ReplayMaskHook(policy, budget, seed, settings)))
        return installed[-1]

    yield make
    hook.uninstall()


def _record(model, logits):
    """Run every router in RECORD mode; ``[tokens, layers, topk]`` recorded routes."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action

    set_model_router_replay_action(model, RouterReplayAction.RECORD)
    for router, layer_logits in zip(model.decoder, logits):
        router.routing(layer_logits[:, None, :])
    recorded = torch.stack([r.router_replay.recorded_topk_idx for r in model.decoder], dim=1)
    for router in model.decoder:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    return recorded


def _replay(model, config, routes_nested, input_ids, response_mask, logits):
    """verl's R3 forward_step sequence through transformer_impl's names; per-layer routing maps."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as ti

    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    aligned = align_r3_router_replay_data(routes_nested, input_ids)
    token_mask = ti.build_r3_replay_mask(input_ids, response_mask)
    ti.set_router_replay_data(aligned, None, config, 0, replay_mask=token_mask, model=model)
    maps = [router.routing(layer_logits[:, None, :])[1] for router, layer_logits in zip(model.decoder, logits)]
    for router in model.decoder:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    return torch.stack(maps, dim=1), token_mask.values()


def _batch(lengths, response_lengths, generator):
    """Nested input_ids / response_mask of sequences of different lengths."""
    input_ids = torch.nested.nested_tensor([torch.randint(0, 100, (n,), generator=generator) for n in lengths], layout=torch.jagged)
    response_mask = torch.nested.nested_tensor([torch.ones(r, dtype=torch.long) for r in response_lengths], layout=torch.jagged)
    return input_ids, response_mask


def _as_map(indices):
    return torch.zeros(*indices.shape[:-1], NUM_EXPERTS, dtype=torch.bool).scatter(-1, indices.long(), True)


def _check_layer_by_layer(maps, recorded, logits, mask, valid):
    native = torch.stack([torch.topk(layer_logits, TOPK, dim=-1).indices for layer_logits in logits], dim=1)
    for layer in range(NUM_LAYERS):
        replayed = valid & mask[:, layer]
        assert torch.equal(maps[replayed, layer], _as_map(recorded[replayed, layer])), f"layer {layer}: replayed routes"
        assert torch.equal(maps[~replayed, layer], _as_map(native[~replayed, layer])), f"layer {layer}: native routes"


@pytest.mark.parametrize("policy,budget", [("random", 0.4), ("uniform", 0.5), ("fisher", 0.3), ("mismatch", 0.5), ("full", None), ("none", None)])
def test_masked_routes_replay_recorded_and_unmasked_routes_stay_native(routers, hooked, policy, budget):
    model, config = routers
    generator = torch.Generator().manual_seed(1)
    lengths, response_lengths = [9, 5, 12], [4, 2, 6]
    tokens = sum(lengths)
    record_logits = torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=generator)
    replay_logits = record_logits + 0.8 * torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=generator)
    recorded = _record(model, record_logits)
    input_ids, response_mask = _batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    hook = hooked(policy, budget, seed=3)

    hook.begin(forward_only=True)
    maps, valid = _replay(model, config, routes, input_ids, response_mask, replay_logits)
    first = hook.end(forward_only=True)
    if policy == "mismatch":
        # The first forward of a sequence routes natively to record its native routes.
        mask = torch.zeros(valid.shape[0], NUM_LAYERS, dtype=torch.bool)
    else:
        mask, _ = hook.select(recorded, valid, input_ids.offsets(), NUM_EXPERTS)
    _check_layer_by_layer(maps, recorded, replay_logits, mask, valid)
    if policy == "mismatch":
        hook.begin(forward_only=False)
        maps, valid = _replay(model, config, routes, input_ids, response_mask, replay_logits)
        second = hook.end(forward_only=False)
        mask, _ = hook.select(recorded, valid, input_ids.offsets(), NUM_EXPERTS)
        _check_layer_by_layer(maps, recorded, replay_logits, mask, valid)
        # Mismatched routes are replayed first: either every replayed route overrides the native
        # one, or every mismatched route is replayed.
        assert second["replay/override_rate"] == 1.0 or second["routing/mismatch_recall"] == 1.0
        assert second["routing/residual_mismatch_rate"] < first["routing/route_mismatch_rate"]
    if policy in ("random", "uniform", "fisher", "mismatch"):
        assert any(not torch.equal(mask[:, 0], mask[:, layer]) for layer in range(1, NUM_LAYERS)), "mask is per layer"
    expected_replayed = {"full": int(valid.sum()) * NUM_LAYERS, "none": 0}.get(policy)
    if expected_replayed is not None:
        assert first["replay/replayed_routes"] == expected_replayed
    assert first["replay/valid_routes"] == int(valid.sum()) * NUM_LAYERS
    assert first["routing/route_mismatch_rate"] > 0


def test_fisher_scores_come_from_router_logit_gradients(routers, hooked):
    model, config = routers
    generator = torch.Generator().manual_seed(2)
    lengths, response_lengths = [7, 10], [3, 5]
    tokens = sum(lengths)
    logits = torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=generator)
    recorded = _record(model, logits)
    input_ids, response_mask = _batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    hook = hooked("fisher", 0.25, seed=0, decay=0.5)

    hook.begin(forward_only=False)
    train_logits = logits.clone().requires_grad_(True)
    maps, valid = _replay(model, config, routes, input_ids, response_mask, train_logits)
    assert hook.tracker is not None and not hook.tracker.has_estimate
    metrics = hook.end(forward_only=False)
    assert metrics["replay/fisher_fallback"] == 1.0
    del maps
    hook.begin(forward_only=False)
    train_logits = logits.clone().requires_grad_(True)
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_model_router_replay_action
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.workers.engine.megatron import transformer_impl as ti

    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    mask = ti.build_r3_replay_mask(input_ids, response_mask)
    ti.set_router_replay_data(align_r3_router_replay_data(routes, input_ids), None, config, 0, replay_mask=mask, model=model)
    weights = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    loss = sum((r.routing(train_logits[i][:, None, :])[0] * weights).sum() for i, r in enumerate(model.decoder))
    loss.backward()
    for router in model.decoder:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    hook.end(forward_only=False)
    hook.begin(forward_only=True)  # the next step's first pass closes the Fisher step
    assert hook.tracker.has_estimate
    rows = mask.values()
    expected = train_logits.grad.square()[:, rows].sum(1) / rows.sum()
    assert torch.allclose(hook.tracker.estimate(), expected.float(), rtol=1e-5, atol=1e-8)
    selected, _ = hook.select(recorded, rows, input_ids.offsets(), NUM_EXPERTS)
    assert hook.counters["fisher_fallback"] == 0
    assert int(selected.sum()) == sum(int(torch.floor(torch.tensor(0.25 * NUM_LAYERS * int(rows[s:e].sum())) + 0.5)) for s, e in zip(input_ids.offsets()[:-1].tolist(), input_ids.offsets()[1:].tolist()))


def _left_padded(lengths, seq_len, generator):
    batch = len(lengths)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention_mask[b, seq_len - n :] = 1
    routed = torch.zeros(batch, seq_len, NUM_LAYERS, TOPK, dtype=torch.int16)
    for b in range(batch):
        for s in range(seq_len):
            if attention_mask[b, s]:
                for layer in range(NUM_LAYERS):
                    routed[b, s, layer] = torch.randperm(NUM_EXPERTS, generator=generator)[:TOPK].to(torch.int16)
    return routed, attention_mask


def test_left_padded_batch_through_verl_thd_path(routers, hooked):
    """verl's own no-padding conversion, R3 alignment and packing, with per-layer masks."""
    from tensordict import TensorDict

    from verl.workers.utils.padding import left_right_2_no_padding

    model, config = routers
    generator = torch.Generator().manual_seed(5)
    lengths, seq_len, response_len = [6, 11, 3, 9], 12, 4
    routed, attention_mask = _left_padded(lengths, seq_len, generator)
    response_mask = attention_mask[:, -response_len:].clone()
    data = TensorDict(
        {
            "input_ids": torch.randint(0, 100, (len(lengths), seq_len), generator=generator),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": torch.arange(seq_len).expand(len(lengths), seq_len).clone(),
            "routed_experts": routed,
        },
        batch_size=[len(lengths)],
    )
    data = left_right_2_no_padding(data)
    tokens = int(attention_mask.sum())
    logits = torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=generator)
    hook = hooked("random", 0.5, seed=11)
    hook.begin(forward_only=True)
    maps, valid = _replay(model, config, data["routed_experts"], data["input_ids"], data["response_mask"], logits)
    hook.end(forward_only=True)

    from ablate.routes import Routes

    routes = Routes.from_verl(routed, attention_mask, num_experts=NUM_EXPERTS)
    recorded = routes.rollout[routes.valid]  # left padding removed, batch order: verl's packed rows
    mask, _ = hook.select(recorded, valid, data["input_ids"].offsets(), NUM_EXPERTS)
    _check_layer_by_layer(maps, recorded, logits, mask, valid)
    assert mask.any() and not mask.all()


def test_routes_from_verl_matches_verl_alignment():
    from verl import DataProto
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data
    from verl.workers.utils.padding import left_right_2_no_padding

    from ablate.routes import Routes

    generator = torch.Generator().manual_seed(7)
    routed, attention_mask = _left_padded([4, 9, 2], 10, generator)
    proto = DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 100, (3, 10), generator=generator),
            "attention_mask": attention_mask,
            "response_mask": attention_mask[:, -3:].clone(),
            "position_ids": torch.arange(10).expand(3, 10).clone(),
            "routed_experts": routed,
        }
    )
    routes = Routes.from_verl(proto.batch["routed_experts"], proto.batch["attention_mask"], num_experts=NUM_EXPERTS)
    nested = left_right_2_no_padding(proto.batch.clone())
    aligned = align_r3_router_replay_data(nested["routed_experts"], nested["input_ids"])
    assert torch.equal(routes.rollout[routes.valid], aligned.values())
    assert routes.to_verl(3, 10).equal(routed)


POLICIES = [("none", None), ("full", None), ("random", 0.25), ("uniform", 0.5), ("fisher", 0.25), ("mismatch", 0.1)]


@pytest.mark.parametrize("policy,budget", POLICIES)
def test_overrides_pass_verl_validation(policy, budget):
    from omegaconf import OmegaConf

    from verl.utils.config import validate_config

    from ablate.backends.verl.launch import check_cell_config, compose, verl_overrides

    overrides = verl_overrides(policy, budget, 3, {"tau": 0.5} if policy == "fisher" else {})
    mode = {"none": "disabled"}.get(policy, "R3")
    assert f"actor_rollout_ref.actor.megatron.router_replay.mode={mode}" in overrides
    hooked_policy = policy not in ("none", "full")
    assert any("external_lib=ablate.backends.verl.worker" in o for o in overrides) == hooked_policy
    config = compose(EXAMPLES, "ablate_ppo", overrides + ["actor_rollout_ref.model.path=/tmp/unused"])
    validate_config(config, use_reference_policy=False, use_critic=False)
    check_cell_config(config)
    assert config.actor_rollout_ref.actor.megatron.router_replay.mode == mode
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay == (policy != "none")
    if hooked_policy:
        env = OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.env_vars)
        assert env["ABLATE_VERL_POLICY"] == policy and float(env["ABLATE_VERL_BUDGET"]) == budget


def test_check_cell_config_rejects_fsdp_and_missing_rollout_routes():
    from ablate.backends.verl.launch import VerlLaunchError, check_cell_config, compose, verl_overrides

    base = verl_overrides("random", 0.5, 0, {}) + ["actor_rollout_ref.model.path=/tmp/unused"]
    config = compose(EXAMPLES, "ablate_ppo", base + ["actor_rollout_ref.rollout.enable_rollout_routing_replay=False"])
    with pytest.raises(VerlLaunchError, match="no routed_experts"):
        check_cell_config(config)
    config.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    config.actor_rollout_ref.actor.strategy = "fsdp"
    with pytest.raises(VerlLaunchError, match="Megatron"):
        check_cell_config(config)


def test_check_verl_version(tmp_path):
    from ablate.backends.verl.launch import VerlLaunchError, check_verl

    assert check_verl() == "0.9.1"
    wrong = tmp_path / "REQUIRED_VERL.txt"
    wrong.write_text("UPSTREAM=x\nMODE=pinned_tag\nTAG=v0.8.0\n")
    with pytest.raises(VerlLaunchError, match="expected verl==0.8.0"):
        check_verl(wrong)
