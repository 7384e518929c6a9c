"""verl's Megatron seam where verl drives Megatron-core's own ``RouterReplay`` instead of its patched copy.

verl 0.9.1 replays routes through its own copy of the class (``verl.utils.megatron.router_replay_patch``);
a later verl may drive Megatron-core's (``megatron.core.transformer.moe.router_replay``), as NeMo RL,
SkyRL and AReaL do. Such a verl is stood in for in a fresh process where verl's patch is never
applied: verl 0.9.1's own R3 functions with Megatron-core's ``RouterReplay`` and
``RouterReplayAction`` in ``router_replay_utils``' namespace (where verl hands each router its
targets and reads its action), three real ``TopKRouter`` s built with
``moe_enable_routing_replay=True``, and ablate told which class verl drives, as
:func:`ablate.backends.verl.entry_points.router_replay_module` would read it from such a verl's sources.

``run(...)`` saves, per policy, the experts every router used for every (token, layer) in the
old-log-prob call and the update call, the mask the hook's settings choose (computed apart), the
recorded and native routes, and the step's keys.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_core_world
from megatron_core_world import NUM_EXPERTS, NUM_LAYERS, TOPK


def as_verl_on_megatron_core() -> None:
    """verl 0.9.1 driving Megatron-core's RouterReplay: its class and actions where verl's R3 functions read them."""
    from megatron.core.transformer.moe import router_replay

    from ablate.backends.verl import entry_points
    from ablate.replay import megatron_routers
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = "cpu"  # verl's platform registry says "cuda" on a CPU-only machine
    router_replay_utils.RouterReplay = router_replay.RouterReplay
    router_replay_utils.RouterReplayAction = router_replay.RouterReplayAction
    entry_points.router_replay_module = lambda: megatron_routers.ROUTER_REPLAY


def set_action(model, action) -> None:
    for router in model.decoder:
        router.router_replay.set_router_replay_action(action)


def run(rank: int, port: int, policies: list, out_path: str) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from ablate.backends.verl import engines
    from ablate.backends.verl.engines.megatron import replay_class_points
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.policies import policy_class
    from ablate.replay import ReplaySession, ReplaySpec
    from ablate.replay.batch import select_micro_batch
    from ablate.routes import native_margin
    from replay_routers import batch, through_hook
    from verl.workers.engine.megatron import transformer_impl as ti

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    megatron_core_world.cpu_shims()
    mpu.initialize_model_parallel(1, 1)
    as_verl_on_megatron_core()
    model = torch.nn.Module()
    model.decoder = torch.nn.ModuleList(megatron_core_world.routers(megatron_core_world.LAYOUTS["single"]))
    config = model.decoder[0].config
    generator = torch.Generator().manual_seed(1)
    lengths, response_lengths = [9, 5, 12], [4, 2, 6]
    record_logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    logits = record_logits + 0.8 * torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record_logits.topk(TOPK, dim=-1).indices.permute(1, 0, 2)
    native = logits.topk(TOPK, dim=-1).indices.permute(1, 0, 2)
    input_ids, response_mask = batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    valid = ti.build_r3_replay_mask(input_ids, response_mask).values()

    def forward():
        set_action(model, RouterReplayAction.REPLAY_FORWARD)
        aligned = ti.align_r3_router_replay_data(routes, input_ids)
        ti.set_router_replay_data(aligned, None, config, 0, replay_mask=ti.build_r3_replay_mask(input_ids, response_mask),
                                  model=model)
        maps = [router.routing(layer_logits[:, None, :])[1] for router, layer_logits in zip(model.decoder, logits)]
        for router in model.decoder:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        return torch.stack(maps, dim=1)

    results = {"seam_points": [point.module for point in replay_class_points()]}
    for policy, budget in policies:
        spec = ReplaySpec.of(policy, budget, seed=3)
        hook = engines.install(HookSettings(spec).make_hook())
        old, _, _ = through_hook(hook, config, routes, input_ids, forward, forward_only=True)
        update, _, metrics = through_hook(hook, config, routes, input_ids, forward, forward_only=False)
        engines.uninstall()
        extra = {}
        if policy_class(policy).needs_native_routes:
            margin = torch.stack([native_margin(logits[layer], native[:, layer]) for layer in range(NUM_LAYERS)], 1)
            extra = dict(native=native, has_native=torch.ones(valid.shape[0], dtype=torch.bool), native_margin=margin)
        session = ReplaySession(spec, NUM_LAYERS, NUM_EXPERTS, TOPK)
        mask = select_micro_batch(session, recorded, valid, input_ids.offsets(), NUM_EXPERTS, **extra).mask
        results[policy] = {"old": old, "update": update, "mask": mask, "metrics": metrics}
    results.update(recorded=recorded, native=native, valid=valid, offsets=input_ids.offsets())
    torch.save(results, out_path)
    dist.destroy_process_group()
