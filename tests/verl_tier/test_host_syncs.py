"""What ablate's hook makes a GPU wait for, counted through verl's real router replay on both engines.

Every aten op and every op whose result the host must read is counted with a ``TorchDispatchMode``
(:class:`ablate.replay.host_reads.OpCounter`), with the hook and without it (verl's own R3 on the
same routes): the difference is the hook's. Limits (docs/verl.md, "GPU shape"): inside a router
call no sync and at most 8 ops; at most 4 syncs per micro-batch in all; the step's counts read
once, at its last update call.
"""

import pytest
import torch

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")

from ablate.replay.host_reads import OpCounter  # noqa: E402
from replay_routers import (  # noqa: E402
    NUM_EXPERTS,
    NUM_LAYERS,
    TOPK,
    batch,
    hook_installer,
    record,
    router_model,
    through_hook,
)

pytestmark = pytest.mark.verl
routers = pytest.fixture(scope="module")(router_model)
hooked = pytest.fixture()(hook_installer)
POLICIES = [("random", 0.4), ("uniform", 0.5), ("fisher", 0.3), ("mismatch", 0.5)]


def megatron_pass(model, config, routes, input_ids, response_mask, logits, per_router: list[OpCounter]):
    """verl's R3 forward of the routers (as replay_routers.replay), each router's call counted apart."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as ti

    set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
    aligned = align_r3_router_replay_data(routes, input_ids)
    ti.set_router_replay_data(aligned, None, config, 0, replay_mask=ti.build_r3_replay_mask(input_ids, response_mask),
                              model=model)
    for router, layer_logits in zip(model.decoder, logits):
        counter = OpCounter()
        with counter.counting():
            router.routing(layer_logits[:, None, :])
        per_router.append(counter)
    for router in model.decoder:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


@pytest.mark.parametrize("policy,budget", POLICIES)
def test_the_megatron_hook_adds_no_sync_in_a_router_and_few_per_micro_batch(routers, hooked, policy, budget):
    model, config = routers
    generator = torch.Generator().manual_seed(2)
    lengths, response_lengths = [9, 5, 12], [4, 2, 6]
    logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record(model, logits + 0.8 * torch.randn(logits.shape, generator=generator))
    input_ids, response_mask = batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())

    plain_routers: list[OpCounter] = []
    plain = OpCounter()
    with plain.counting():
        megatron_pass(model, config, routes, input_ids, response_mask, logits, plain_routers)

    hook = hooked(policy, budget, seed=3)
    added = []
    for forward_only, last_update in ((True, False), (False, False), (False, True)):  # old log-probs, two updates
        hooked_routers: list[OpCounter] = []
        call = OpCounter()
        with call.counting():
            through_hook(hook, config, routes, input_ids, lambda: megatron_pass(
                model, config, routes, input_ids, response_mask, logits, hooked_routers),
                forward_only=forward_only, last_update=last_update)
        passes = len(hooked_routers) // NUM_LAYERS  # mismatch's old-log-prob call runs a native pass first
        for ours, theirs in zip(hooked_routers[-NUM_LAYERS:], plain_routers):
            assert ours.total_syncs - theirs.total_syncs == 0, (policy, dict(ours.syncs), dict(theirs.syncs))
            assert 0 < ours.total_ops - theirs.total_ops <= 8, (policy, ours.ops - theirs.ops)
        # One micro-batch per pass here: what the hook adds to verl's own R3 of it.
        added.append((call.total_syncs - passes * plain.total_syncs, passes, dict(call.syncs)))
    (old_log_prob, passes, seen), (update, _, _), (last, _, _) = added
    assert old_log_prob <= 4 * passes and update <= 4, (policy, added)
    assert last - update == 1, added  # the step's counts, read once at its last update


def veomni_micro_batch(hook, controller, routes, layers, per_router: list[OpCounter]):
    """verl's VeOmni engine arming its controller for one micro-batch (``_prepare_router_replay_inputs``),
    then each router's forward through ``VeOmniRouterReplay.on_router_forward``, each counted apart."""
    from types import SimpleNamespace

    from verl.workers.engine.veomni.transformer_impl import VeOmniEngineWithLMHead

    engine = SimpleNamespace(_router_replay=controller, use_ulysses_sp=False)
    VeOmniEngineWithLMHead._prepare_router_replay_inputs(engine, {"routed_experts": routes}, {})
    for module, (scores, native) in zip(layers, routers_of(routes)):
        counter = OpCounter()
        with counter.counting():
            controller.on_router_forward(module, scores, native)
        per_router.append(counter)


def routers_of(routes):
    """Each router's scores and native top-k: another choice than the rollout's on about a third of the rows."""
    values = routes.values()
    generator = torch.Generator().manual_seed(4)
    for layer in range(values.shape[1]):
        scores = torch.rand(values.shape[0], NUM_EXPERTS, generator=generator).softmax(-1)
        yield scores, scores.topk(TOPK, dim=-1).indices


@pytest.mark.parametrize("policy,budget", POLICIES)
def test_the_veomni_hook_adds_no_sync_in_a_router_and_few_per_micro_batch(policy, budget):
    from ablate.backends.verl import engines
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.replay import ReplaySpec
    from ablate.replay.seams import CallInfo
    from verl.utils.veomni.router_replay import VeOmniRouterReplay

    generator = torch.Generator().manual_seed(5)
    lengths = [9, 5, 12]
    recorded = torch.rand(sum(lengths), NUM_LAYERS, NUM_EXPERTS, generator=generator).topk(TOPK, -1).indices
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=offsets)
    layers = [torch.nn.Identity() for _ in range(NUM_LAYERS)]  # the controller tells routers apart by identity

    controller = VeOmniRouterReplay()
    controller.begin_replay()
    plain_routers: list[OpCounter] = []
    plain = OpCounter()
    with plain.counting():
        veomni_micro_batch(None, controller, routes, layers, plain_routers)

    hook = engines.install(HookSettings(ReplaySpec.of(policy, budget, seed=3), engine="veomni").make_hook())
    try:
        added = []
        for forward_only, last_update in ((True, False), (False, False), (False, True)):
            info = CallInfo(forward_only=forward_only, last_update=last_update, num_tokens=sum(lengths),
                            route_layers=NUM_LAYERS, topk=TOPK, num_experts=NUM_EXPERTS,
                            layer_columns=tuple(range(NUM_LAYERS)))
            native_pass = hook.needs_native_pass(info)
            call = OpCounter()
            hooked_routers: list[OpCounter] = []
            with call.counting():
                for pass_native in ([True, False] if native_pass else [False]):
                    hook.begin_call(info, native_pass=pass_native)
                    controller.begin_replay()
                    veomni_micro_batch(hook, controller, routes, layers, hooked_routers)
                    hook.seam.end_pass()
                    metrics = hook.end_call()
            for ours, theirs in zip(hooked_routers[-NUM_LAYERS:], plain_routers):
                assert ours.total_syncs - theirs.total_syncs == 0, (policy, dict(ours.syncs), dict(theirs.syncs))
                assert 0 < ours.total_ops - theirs.total_ops <= 8, (policy, ours.ops - theirs.ops)
            passes = 2 if native_pass else 1
            added.append((call.total_syncs - passes * plain.total_syncs, passes, dict(call.syncs)))
    finally:
        engines.uninstall()
    assert metrics["replay/replayed_routes"] > 0 and metrics["replay/valid_routes"] > 0  # the hook replayed and counted
    (old_log_prob, passes, _), (update, _, _), (last, _, _) = added
    assert old_log_prob <= 4 * passes and update <= 4, (policy, added)
    assert last - update == 1, added  # the step's counts, read once at its last update
