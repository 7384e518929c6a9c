"""Three real Megatron TopKRouters driven with logits, and verl's R3 calls around them.

Shared by the single-rank tests: routers get logits directly, so a test knows every native route.
"""

import os

import torch

NUM_LAYERS, NUM_EXPERTS, TOPK = 3, 8, 2


def router_model():
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
    router_replay_utils.device_name = "cpu"  # verl's platform registry says "cuda" on a CPU-only machine
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


def hook_installer():
    from ablate.backends.verl import engines
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.policies import PolicySpec
    from ablate.replay import ReplaySpec

    def make(policy, budget, seed=0, source="rollout", **settings):
        spec = PolicySpec(policy, {k: v for k, v in settings.items() if k != "decay"},
                          fisher_decay=settings.get("decay", 0.9))
        return engines.install(HookSettings(ReplaySpec(spec, budget, seed, source=source)).make_hook())

    yield make
    engines.uninstall()


def record(model, logits):
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


def through_hook(hook, config, routes, input_ids, forward, *, forward_only, last_update=True):
    """One verl call through the hook's ``forward_backward_batch`` wrapper, from a real TensorDict.

    ``forward()`` stands in for the engine's forward (and backward) and returns its output. Returns
    the output verl gets back, the outputs of every pass the call ran (``mismatch``'s old-log-prob
    call runs a native pass first), and the step's metrics (None but at the step's last update).
    """
    from types import SimpleNamespace

    from tensordict import TensorDict

    from ablate.backends.verl import engines
    from verl.utils import tensordict_utils as tu

    data = TensorDict({"input_ids": input_ids, "routed_experts": routes}, batch_size=[input_ids.shape[0]])
    tu.assign_non_tensor(data, enable_routing_replay=True)
    if not forward_only:
        tu.assign_non_tensor(data, update_lr_scheduler=last_update)
    passes = []

    def forward_backward_batch(engine, data, loss_function, forward_only=False):
        passes.append(forward())
        return {"model_output": passes[-1], "metrics": {}}

    engine = SimpleNamespace(tf_config=config)
    output = engines.hooked_call(hook, forward_backward_batch, engine, data, None, forward_only)
    metrics = {key: values[0] for key, values in output["metrics"].items()} or None
    return output["model_output"], passes, metrics


def replay(model, config, routes_nested, input_ids, response_mask, logits):
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


def replay_r2(model, config, routes_nested, logits):
    """verl's R2 update forward_step through transformer_impl's names: the recorded routes, no mask; routing maps."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as ti

    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    ti.set_router_replay_data(routes_nested, None, config, 0, replay_mask=None, model=model)
    maps = [router.routing(layer_logits[:, None, :])[1] for router, layer_logits in zip(model.decoder, logits)]
    for router in model.decoder:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    return torch.stack(maps, dim=1)


def batch(lengths, response_lengths, generator):
    """Nested input_ids / response_mask of sequences of different lengths."""
    input_ids = torch.nested.nested_tensor([torch.randint(0, 100, (n,), generator=generator) for n in lengths], layout=torch.jagged)
    response_mask = torch.nested.nested_tensor([torch.ones(r, dtype=torch.long) for r in response_lengths], layout=torch.jagged)
    return input_ids, response_mask


def as_map(indices):
    return torch.zeros(*indices.shape[:-1], NUM_EXPERTS, dtype=torch.bool).scatter(-1, indices.long(), True)


def native_of(logits):
    return torch.stack([torch.topk(layer_logits, TOPK, dim=-1).indices for layer_logits in logits], dim=1)


def left_padded(lengths, seq_len, generator):
    batch_size = len(lengths)
    attention_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        attention_mask[b, seq_len - n :] = 1
    routed = torch.zeros(batch_size, seq_len, NUM_LAYERS, TOPK, dtype=torch.int16)
    for b in range(batch_size):
        for s in range(seq_len):
            if attention_mask[b, s]:
                for layer in range(NUM_LAYERS):
                    routed[b, s, layer] = torch.randperm(NUM_EXPERTS, generator=generator)[:TOPK].to(torch.int16)
    return routed, attention_mask
