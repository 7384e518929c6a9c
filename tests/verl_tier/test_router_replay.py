"""The hook on one rank against verl 0.9.1's real router-replay code and Megatron's TopKRouter.

Routers are driven with logits directly, so each test knows every native route and can check,
layer by layer, that replayed routes use the recorded experts and every other route the native
ones. Multi-rank layouts are in ``test_parallel_layouts.py``.
"""

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402

from ablate.budget import count_for  # noqa: E402
from ablate.policies import available_policies, policy_class  # noqa: E402
from ablate.routes import native_margin  # noqa: E402
from replay_routers import (  # noqa: E402
    NUM_EXPERTS,
    NUM_LAYERS,
    TOPK,
    as_map,
    batch,
    hook_installer,
    left_padded,
    native_of,
    record,
    replay,
    replay_r2,
    router_model,
    through_hook,
)

pytestmark = pytest.mark.verl
routers = pytest.fixture(scope="module")(router_model)
hooked = pytest.fixture()(hook_installer)


def expected_mask(hook, recorded, valid, offsets, native=None, margin=None):
    """The mask the hook's own settings select, computed apart with a freshly built policy."""
    from ablate.replay import ReplaySession
    from ablate.replay.batch import select_micro_batch

    session = ReplaySession(hook.spec, NUM_LAYERS, NUM_EXPERTS, TOPK)
    has_native = None if native is None else torch.ones(recorded.shape[0], dtype=torch.bool)
    return select_micro_batch(session, recorded, valid, offsets, NUM_EXPERTS,
                              native=native, has_native=has_native, native_margin=margin).mask


#: The example policy package (examples/margin_policy), when it is installed here: it runs through
#: the same router-level checks as the built-ins.
MARGIN = [("margin", 0.4)] if "margin" in available_policies() else []


def check_layer_by_layer(maps, recorded, logits, mask, valid):
    native = native_of(logits)
    for layer in range(NUM_LAYERS):
        replayed = valid & mask[:, layer]
        assert torch.equal(maps[replayed, layer], as_map(recorded[replayed, layer])), f"layer {layer}: replayed routes"
        assert torch.equal(maps[~replayed, layer], as_map(native[~replayed, layer])), f"layer {layer}: native routes"


@pytest.mark.parametrize("policy,budget", [("random", 0.4), ("uniform", 0.5), ("fisher", 0.3), ("mismatch", 0.5),
                                           ("full", None), ("none", None), *MARGIN])
def test_masked_routes_replay_recorded_and_unmasked_routes_stay_native(routers, hooked, policy, budget):
    model, config = routers
    generator = torch.Generator().manual_seed(1)
    lengths, response_lengths = [9, 5, 12], [4, 2, 6]
    record_logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    replay_logits = record_logits + 0.8 * torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record(model, record_logits)
    input_ids, response_mask = batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    hook = hooked(policy, budget, seed=3)

    def forward():
        return replay(model, config, routes, input_ids, response_mask, replay_logits)

    (maps, valid), passes, metrics = through_hook(hook, config, routes, input_ids, forward, forward_only=True)
    assert metrics is None  # the old-log-prob pass reports nothing
    needs_native = policy_class(policy).needs_native_routes
    native = native_of(replay_logits) if needs_native else None
    margin = native_margin(replay_logits.transpose(0, 1), native.long()) if needs_native else None
    mask = expected_mask(hook, recorded, valid, input_ids.offsets(), native=native, margin=margin)
    if needs_native:
        # mismatch and margin select on native routes: a first pass replays nothing and records them.
        assert len(passes) == 2
        check_layer_by_layer(passes[0][0], recorded, replay_logits, torch.zeros_like(mask), valid)
    else:
        assert len(passes) == 1
    # The old log-probs verl gets come from a pass that replays the mask, for every policy.
    check_layer_by_layer(maps, recorded, replay_logits, mask, valid)

    (update_maps, _), passes, metrics = through_hook(hook, config, routes, input_ids, forward, forward_only=False)
    assert len(passes) == 1
    # The update replays the same routes as the old-log-prob pass: the PPO ratio starts at 1.
    assert torch.equal(update_maps, maps)
    if policy_class(policy).fixed_budget is None:
        assert any(not torch.equal(mask[:, 0], mask[:, layer]) for layer in range(1, NUM_LAYERS)), "mask is per layer"
    if policy == "mismatch":
        # Mismatched routes are replayed first: either every replayed route overrides the native
        # one, or every mismatched route is replayed.
        assert metrics["replay/override_rate"] == 1.0 or metrics["routing/mismatch_recall"] == 1.0
        assert metrics["routing/residual_mismatch_rate"] < metrics["routing/route_mismatch_rate"]
    if policy == "margin":
        # Within each sequence, every replayed valid route is at least as close to a tie as any
        # valid route left native.
        for start, end in zip(input_ids.offsets()[:-1].tolist(), input_ids.offsets()[1:].tolist()):
            rows = valid[start:end]
            replayed, kept = margin[start:end][rows][mask[start:end][rows]], margin[start:end][rows][~mask[start:end][rows]]
            assert replayed.numel() and float(replayed.max()) <= float(kept.min())
    bounds = input_ids.offsets().tolist()
    per_sequence = [int(valid[start:end].sum()) * NUM_LAYERS for start, end in zip(bounds[:-1], bounds[1:])]
    assert metrics["replay/valid_routes"] == sum(per_sequence)
    assert metrics["replay/replayed_routes"] == sum(count_for(hook.spec.budget, n) for n in per_sequence) == int(mask.sum())
    assert metrics["replay/unrecorded_routes"] == 0
    assert metrics["routing/route_mismatch_rate"] > 0


@pytest.mark.parametrize("policy,budget", [("random", 0.4), ("fisher", 0.3), ("full", None)])
def test_under_r2_the_mask_chooses_among_the_routes_the_trainer_recorded(routers, hooked, policy, budget):
    """R2 (replay.source=train): the update replays what the old-log-prob pass recorded, for every
    token and with no mask from verl; ablate's mask decides which of those routes are replayed."""
    model, config = routers
    generator = torch.Generator().manual_seed(2)
    lengths = [9, 5, 12]
    old_logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    update_logits = old_logits + 0.8 * torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record(model, old_logits)  # R2's old-log-prob pass: RECORD, native routing
    input_ids, _ = batch(lengths, [4, 2, 6], generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    hook = hooked(policy, budget, seed=4, source="train")
    maps, passes, metrics = through_hook(hook, config, routes, input_ids,
                                         lambda: replay_r2(model, config, routes, update_logits), forward_only=False)
    assert len(passes) == 1
    every_token = torch.ones(recorded.shape[0], dtype=torch.bool)
    mask = expected_mask(hook, recorded, every_token, input_ids.offsets())
    check_layer_by_layer(maps, recorded, update_logits, mask, every_token)
    per_sequence = [n * NUM_LAYERS for n in lengths]
    assert metrics["replay/valid_routes"] == sum(per_sequence)
    assert metrics["replay/replayed_routes"] == sum(count_for(hook.spec.budget, n) for n in per_sequence)
    # What R2 changes: the recorded routes the update's weights would route otherwise, where replayed.
    assert 0 < metrics["routing/route_mismatch_rate"] and 0 < metrics["replay/effective_budget"]


def test_fisher_scores_come_from_router_logit_gradients(routers, hooked):
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_model_router_replay_action
    from verl.workers.engine.megatron import transformer_impl as ti

    model, config = routers
    generator = torch.Generator().manual_seed(2)
    lengths, response_lengths = [7, 10], [3, 5]
    tokens = sum(lengths)
    logits = torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=generator)
    recorded = record(model, logits)
    input_ids, response_mask = batch(lengths, response_lengths, generator)
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=input_ids.offsets())
    hook = hooked("fisher", 0.25, seed=0, decay=0.5)
    train_logits = logits.clone().requires_grad_(True)
    weights = torch.randn(tokens, NUM_EXPERTS, generator=generator)

    def forward_backward():
        set_model_router_replay_action(model, RouterReplayAction.REPLAY_FORWARD)
        mask = ti.build_r3_replay_mask(input_ids, response_mask)
        ti.set_router_replay_data(align_r3_router_replay_data(routes, input_ids), None, config, 0, replay_mask=mask,
                                  model=model)
        loss = sum((r.routing(train_logits[i][:, None, :])[0] * weights).sum() for i, r in enumerate(model.decoder))
        loss.backward()
        for router in model.decoder:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        assert not hook.tracker.has_estimate
        return mask

    mask, _, metrics = through_hook(hook, config, routes, input_ids, forward_backward, forward_only=False)
    # The step's last update call closed the Fisher step.
    assert metrics["replay/fisher_fallback"] == 1.0
    assert hook.tracker.has_estimate
    rows = mask.values()
    expected = train_logits.grad.square()[:, rows].sum(1) / rows.sum()
    assert torch.allclose(hook.tracker.estimate(), expected.float(), rtol=1e-5, atol=1e-8)

    _, _, metrics = through_hook(hook, config, routes, input_ids,
                                 lambda: replay(model, config, routes, input_ids, response_mask, logits), forward_only=False)
    assert metrics["replay/fisher_fallback"] == 0.0
    fisher_mask = expected_mask(hook, recorded, rows, input_ids.offsets())
    # The estimate ranks the routes: the selection holds more Fisher mass than its share of routes.
    assert metrics["replay/fisher_mass"] > metrics["replay/budget_realized"]
    assert int(fisher_mask.sum()) == metrics["replay/replayed_routes"]


def test_left_padded_batch_through_verl_thd_path(routers, hooked):
    """verl's own no-padding conversion, R3 alignment and packing, with per-layer masks."""
    from tensordict import TensorDict

    from verl.workers.utils.padding import left_right_2_no_padding

    model, config = routers
    generator = torch.Generator().manual_seed(5)
    lengths, seq_len, response_len = [6, 11, 3, 9], 12, 4
    routed, attention_mask = left_padded(lengths, seq_len, generator)
    data = TensorDict(
        {
            "input_ids": torch.randint(0, 100, (len(lengths), seq_len), generator=generator),
            "attention_mask": attention_mask,
            "response_mask": attention_mask[:, -response_len:].clone(),
            "position_ids": torch.arange(seq_len).expand(len(lengths), seq_len).clone(),
            "routed_experts": routed,
        },
        batch_size=[len(lengths)],
    )
    data = left_right_2_no_padding(data)
    logits = torch.randn(NUM_LAYERS, int(attention_mask.sum()), NUM_EXPERTS, generator=generator)
    hook = hooked("random", 0.5, seed=11)
    (maps, valid), _, _ = through_hook(
        hook, config, data["routed_experts"], data["input_ids"],
        lambda: replay(model, config, data["routed_experts"], data["input_ids"], data["response_mask"], logits),
        forward_only=True,
    )

    recorded = routed[attention_mask.bool()]  # left padding removed, batch order: verl's packed rows
    mask = expected_mask(hook, recorded, valid, data["input_ids"].offsets())
    check_layer_by_layer(maps, recorded, logits, mask, valid)
    assert mask.any() and not mask.all()


def test_batches_plain_r3_accepts_are_accepted(routers, hooked):
    """A final-token placeholder, a multi-turn gap of zeros and a sequence without a response.

    verl's plain R3 replays all of them (zeros included); the hook replays none of the routes
    the rollout did not record, counts them apart, and spends the budget on the recorded ones.
    """
    model, config = routers
    generator = torch.Generator().manual_seed(9)
    lengths, response_lengths = [10, 8, 6], [5, 4, 0]
    logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record(model, logits)
    input_ids, response_mask = batch(lengths, response_lengths, generator)
    bounds = input_ids.offsets().tolist()
    # The rollout records no route for each final token (align_r3 appends the zero placeholder)
    # and none for tokens 3..5 of the first sequence (a tool response between two turns).
    parts = [recorded[start : end - 1].to(torch.int16) for start, end in zip(bounds[:-1], bounds[1:])]
    parts[0][3:6] = 0
    routes = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    hook = hooked("random", 0.5, seed=4)

    (maps, r3_valid), _, metrics = through_hook(
        hook, config, routes, input_ids, lambda: replay(model, config, routes, input_ids, response_mask, logits),
        forward_only=False,
    )
    gap = torch.zeros(sum(lengths), dtype=torch.bool)
    gap[3:6] = True
    valid = r3_valid & ~gap
    assert metrics["replay/valid_routes"] == int(valid.sum()) * NUM_LAYERS == (9 - 3 + 7) * NUM_LAYERS
    assert metrics["replay/unrecorded_routes"] == (3 + len(lengths)) * NUM_LAYERS  # the gap and the placeholders
    mask = expected_mask(hook, recorded, valid, input_ids.offsets())
    check_layer_by_layer(maps, recorded, logits, mask, valid)  # gap, placeholders: native routes
    assert int(mask.sum()) == metrics["replay/replayed_routes"] > 0


def test_selection_skips_dense_columns_and_unrecorded_routes():
    """Routes of every transformer layer (a dense first layer), as the rollout reports them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ablate.backends.verl.engines.megatron import layer_columns
    from ablate.replay import ReplaySession, ReplaySpec
    from ablate.replay.batch import recorded_routes, select_micro_batch

    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, num_moe_experts=NUM_EXPERTS,
                               moe_router_topk=TOPK, moe_layer_freq=[0, 1, 1, 1])
    assert layer_columns(config, 4) == (None, 1, 2, 3)  # one column per layer: by global layer
    assert layer_columns(config, 3) == (None, 0, 1, 2)  # MoE layers only: by MoE ordinal
    routes = torch.tensor([[[0, 0], [1, 2], [3, 4], [5, 6]], [[0, 0], [1, 1], [2, 3], [4, 5]],
                           [[0, 0], [0, 0], [0, 0], [0, 0]], [[0, 0], [7, 8], [1, 2], [3, 4]]], dtype=torch.int16)
    moe = routes[:, [1, 2, 3]]
    assert recorded_routes(moe, NUM_EXPERTS).tolist() == [[True] * 3, [False, True, True], [False] * 3,
                                                          [False, True, True]]  # duplicate, zeros, id 8 of 8
    session = ReplaySession(ReplaySpec.of("full"), 3, NUM_EXPERTS, TOPK)
    selection = select_micro_batch(session, moe, torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4]), NUM_EXPERTS)
    assert selection.valid.tolist() == [True, False, False, False]
    assert selection.mask.tolist() == [[True] * 3, [False] * 3, [False] * 3, [False] * 3]
    assert selection.unrecorded == 5


def test_routes_from_verl_matches_verl_alignment():
    from verl import DataProto
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data
    from verl.workers.utils.padding import left_right_2_no_padding

    from ablate.routes import Routes

    generator = torch.Generator().manual_seed(7)
    routed, attention_mask = left_padded([4, 9, 2], 10, generator)
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
