"""Probe passes in the verl hook, on one rank, against verl 0.9.1's real router replay and padding code.

The routers are real Megatron TopKRouters driven with logits (``replay_routers``); the "log-probs"
a pass returns are a fixed function of the experts each token was routed to, so a pass's output
depends on exactly the mask it replayed. verl's own ``no_padding_2_padding`` turns them into the
trainer's ``[batch, response]`` layout, as in ``_compute_old_log_prob``.
"""

import math

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from ablate.budget import count_for  # noqa: E402
from ablate.diagnostics.schema import PROBE_KEYS, probe_key  # noqa: E402
from ablate.probes import parse_probes  # noqa: E402
from replay_routers import NUM_EXPERTS, NUM_LAYERS, as_map, native_of, record, replay, router_model  # noqa: E402

pytestmark = pytest.mark.verl
routers = pytest.fixture(scope="module")(router_model)

PROMPTS, RESPONSES = [5, 3, 6], [4, 2, 6]
PROMPT_LEN, RESPONSE_LEN = 6, 6
PROBES = "none,full,random@0.5,mismatch@0.5"


@pytest.fixture()
def hooked():
    from ablate.backends.verl import engines
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.policies import PolicySpec
    from ablate.replay import ReplaySpec

    def make(policy, budget, probes=PROBES, probe_every=1, seed=3):
        settings = HookSettings(ReplaySpec(PolicySpec(policy), budget, seed,
                                           parse_probes(probes.split(",") if probes else []), probe_every))
        return engines.install(settings.make_hook())

    yield make
    engines.uninstall()


@pytest.fixture(params=["padded", "jagged"])
def step_batch(routers, request):
    """Recorded routes, the logits the trainer's routers see, and verl's batch as the actor gets it.

    ``padded``: the legacy trainer's batch (``left_right_2_no_padding`` of a padded one);
    ``jagged``: the V1 trainer's TransferQueue batch, responses jagged too.
    """
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    model, _ = routers
    generator = torch.Generator().manual_seed(5)
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    record_logits = torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    replay_logits = record_logits + 0.8 * torch.randn(NUM_LAYERS, sum(lengths), NUM_EXPERTS, generator=generator)
    recorded = record(model, record_logits)
    input_ids = torch.nested.nested_tensor([torch.randint(0, 100, (n,), generator=generator) for n in lengths],
                                           layout=torch.jagged)
    offsets = input_ids.offsets()
    routes = torch.nested.nested_tensor_from_jagged(recorded.to(torch.int16), offsets=offsets)
    # left-padded prompts, right-padded responses: the trainer's layout before left_right_2_no_padding
    attention_mask = torch.zeros(len(lengths), PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    response_mask = torch.zeros(len(lengths), RESPONSE_LEN, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        attention_mask[row, PROMPT_LEN - prompt:PROMPT_LEN + response] = 1
        response_mask[row, :response] = 1
    data = TensorDict({
        "input_ids": input_ids, "routed_experts": routes, "attention_mask": attention_mask,
        "response_mask": response_mask, "prompts": torch.zeros(len(lengths), PROMPT_LEN, dtype=torch.long),
        "responses": torch.zeros(len(lengths), RESPONSE_LEN, dtype=torch.long),
        "rollout_log_probs": -torch.rand(len(lengths), RESPONSE_LEN, generator=generator),
    }, batch_size=[len(lengths)])
    if request.param == "jagged":
        for key in ("response_mask", "rollout_log_probs", "responses"):
            data[key] = torch.nested.nested_tensor([row[:n] for row, n in zip(data[key], RESPONSES)], layout=torch.jagged)
    tu.assign_non_tensor(data, enable_routing_replay=True, max_response_len=RESPONSE_LEN)
    return SimpleNamespace(recorded=recorded, logits=replay_logits, routes=routes, input_ids=input_ids, data=data,
                           response_mask=torch.nested.nested_tensor([torch.ones(r, dtype=torch.long) for r in RESPONSES],
                                                                    layout=torch.jagged))


#: per (layer, expert): what routing a token to that expert adds to its "log-prob".
WEIGHTS = torch.linspace(-0.3, 0.2, NUM_LAYERS * NUM_EXPERTS).reshape(NUM_LAYERS, NUM_EXPERTS)


def call(hook, routers, batch, *, forward_only, last_update=True):
    """One verl call through the hook; the output verl gets, every pass's maps and the step's metrics."""
    from ablate.backends.verl import engines
    from verl.utils import tensordict_utils as tu

    model, config = routers
    data = batch.data.clone()
    if not forward_only:
        tu.assign_non_tensor(data, update_lr_scheduler=last_update)
    passes = []

    def forward_backward_batch(engine, data, loss_function, forward_only=False):
        maps, batch.valid = replay(model, config, batch.routes, batch.input_ids, batch.response_mask, batch.logits)
        passes.append(maps)
        log_probs = -1.0 + (maps.float() * WEIGHTS).sum((1, 2))
        return {"model_output": {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs,
                                                                                    offsets=batch.input_ids.offsets())},
                "metrics": {}}

    engine = SimpleNamespace(tf_config=config, is_mp_src_rank_with_outputs=lambda: True)
    output = engines.hooked_call(hook, forward_backward_batch, engine, data, None, forward_only)
    metrics = {key: values[0] for key, values in output["metrics"].items()} or None
    return output["model_output"], passes, metrics


def trainer_mismatch(output, data):
    """The cell's own ``mismatch/`` keys, as verl's trainers compute them (``offpolicy``'s wrapper).

    The legacy trainer pads the pass's log-probs with ``no_padding_2_padding``; the V1 trainer cuts
    them with ``response_from_nested`` and pads the whole jagged batch (``to_padded_tensor``).
    """
    from ablate.backends.verl.offpolicy import with_mismatch_metrics
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    batch = data.select("rollout_log_probs", "response_mask", "responses")
    if data["response_mask"].is_nested:
        batch["old_log_probs"] = response_from_nested(output["log_probs"], data["response_mask"])
        batch = batch.to_padded_tensor()
    else:
        batch["old_log_probs"] = no_padding_2_padding(output["log_probs"], data).float()
    return with_mismatch_metrics(lambda _: {})(SimpleNamespace(batch=batch))


def replayed(maps, batch, mask):
    """Whether each pass's maps replay exactly ``mask`` ([tokens, layers]) and route the rest natively."""
    native = native_of(batch.logits)
    expected = torch.where(mask[..., None], as_map(batch.recorded), as_map(native))
    return torch.equal(maps, expected)


def one_step(hook, routers, batch):
    own, passes, none_yet = call(hook, routers, batch, forward_only=True)
    assert none_yet is None
    _, _, metrics = call(hook, routers, batch, forward_only=False)
    return own, passes, metrics


@pytest.mark.parametrize("policy,budget", [("none", None), ("full", None)])
def test_the_probe_with_the_cells_mask_reproduces_the_cells_keys_exactly(routers, hooked, step_batch, policy, budget):
    hook = hooked(policy, budget)
    own, passes, metrics = one_step(hook, routers, step_batch)
    cell = trainer_mismatch(own, step_batch.data)
    assert cell and all(metrics[probe_key(policy, key)] == value for key, value in cell.items())
    assert metrics[probe_key(policy, "replay/budget_realized")] == metrics["replay/budget_realized"]
    # the other fixed probe differs: the keys measure the mask, not the pass
    other = "full" if policy == "none" else "none"
    assert metrics[probe_key(other, "mismatch/kl_k3")] != cell["mismatch/kl_k3"]


def test_probe_passes_replay_their_own_masks_and_leave_the_cells_alone(routers, hooked, step_batch):
    plain = hooked("random", 0.5, probes="")
    plain_own, plain_passes, plain_metrics = one_step(plain, routers, step_batch)
    hook = hooked("random", 0.5)
    own, passes, metrics = one_step(hook, routers, step_batch)
    # a native pass for the mismatch probe, the pass verl gets, one pass per probe; the update once
    assert len(plain_passes) == 1 and len(passes) == 1 + 1 + 4
    assert torch.equal(passes[1], plain_passes[0]) and torch.equal(own["log_probs"].values(),
                                                                   plain_own["log_probs"].values())
    assert all(metrics[key] == value or (math.isnan(value) and math.isnan(metrics[key]))
               for key, value in plain_metrics.items())
    # the probes' passes: none replays nothing, full every valid route
    valid = step_batch.valid.bool()  # verl's R3 token mask: every route here is recorded
    none, full, random, mismatch = passes[2:]
    assert replayed(none, step_batch, torch.zeros(valid.shape[0], NUM_LAYERS, dtype=torch.bool))
    assert replayed(full, step_batch, valid[:, None].expand(-1, NUM_LAYERS))
    assert not torch.equal(random, passes[1]), "a random probe draws its own mask, not the cell's"
    bounds = step_batch.input_ids.offsets().tolist()
    per_sequence = [int(valid[start:end].sum()) * NUM_LAYERS for start, end in zip(bounds[:-1], bounds[1:])]
    assert metrics[probe_key("random@0.5", "replay/budget_realized")] == metrics["replay/budget_realized"] == (
        sum(count_for(0.5, n) for n in per_sequence) / sum(per_sequence))
    assert metrics[probe_key("none", "replay/budget_realized")] == 0.0
    assert metrics[probe_key("full", "replay/budget_realized")] == 1.0
    assert metrics[probe_key("mismatch@0.5", "replay/override_rate")] == 1.0  # mismatched routes first
    assert {key for key in metrics if key.startswith("probe/")} == {
        probe_key(probe, key) for probe in PROBES.split(",") for key in PROBE_KEYS}


def test_adding_a_probe_changes_no_other_probe(routers, hooked, step_batch):
    _, _, fewer = one_step(hooked("none", None, probes="random@0.5"), routers, step_batch)
    _, _, more = one_step(hooked("none", None, probes="uniform@0.25,random@0.5"), routers, step_batch)
    family = [key for key in fewer if key.startswith("probe/")]
    assert family and all(fewer[key] == more[key] for key in family)


def test_probes_run_on_every_nth_step_only(routers, hooked, step_batch):
    hook = hooked("none", None, probes="full", probe_every=2)
    probed = []
    for _ in range(4):
        _, passes, metrics = one_step(hook, routers, step_batch)
        probed.append((len(passes), probe_key("full", "mismatch/kl_k1") in metrics))
    assert probed == [(2, True), (1, False), (2, True), (1, False)]


def test_probe_draws_depend_on_the_step(routers, hooked, step_batch):
    hook = hooked("none", None, probes="random@0.5")
    first = one_step(hook, routers, step_batch)[1][1]
    second = one_step(hook, routers, step_batch)[1][1]
    assert not torch.equal(first, second)


def test_a_batch_without_rollout_log_probs_is_one_clear_error(routers, hooked, step_batch):
    del step_batch.data["rollout_log_probs"]
    with pytest.raises(RuntimeError, match="calculate_log_probs=true"):
        call(hooked("none", None, probes="full"), routers, step_batch, forward_only=True)


def test_hook_settings_carry_probes_through_json():
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.policies import PolicySpec
    from ablate.replay import ReplaySpec

    settings = HookSettings(ReplaySpec(PolicySpec("random"), 0.5, 1, parse_probes(["none", "fisher@0.25:tau=1.0"]),
                                       probe_every=3))
    assert HookSettings.from_json(settings.to_json()) == settings


# --- over ranks: each data-parallel replica's share, once, in rank order ---------------------------

SEQUENCES = [(3, 4), (5, 2), (2, 6), (4, 5), (6, 1)]  # (prompt, response) lengths of the whole batch


def padded_shard(rows):
    """The legacy trainer's batch and a pass's jagged output for ``rows`` of one fixed batch."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(11)
    width = max(p for p, _ in SEQUENCES), max(r for _, r in SEQUENCES)
    every = [(torch.randn(p + r, generator=generator) - 2, -torch.rand(width[1], generator=generator))
             for p, r in SEQUENCES]
    attention = torch.zeros(len(rows), sum(width), dtype=torch.long)
    response_mask = torch.zeros(len(rows), width[1], dtype=torch.long)
    for index, row in enumerate(rows):
        prompt, response = SEQUENCES[row]
        attention[index, width[0] - prompt:width[0] + response] = 1
        response_mask[index, :response] = 1
    data = TensorDict({"attention_mask": attention, "response_mask": response_mask,
                       "prompts": torch.zeros(len(rows), width[0], dtype=torch.long),
                       "responses": torch.zeros(len(rows), width[1], dtype=torch.long),
                       "rollout_log_probs": torch.stack([every[row][1] for row in rows])}, batch_size=[len(rows)])
    tu.assign_non_tensor(data, max_response_len=width[1])
    output = {"model_output": {"log_probs": torch.nested.as_nested_tensor([every[row][0] for row in rows],
                                                                          layout=torch.jagged)}}
    return output, data


def score_on_rank(rank, port, shares, out):
    """One gloo rank: ``shares[rank]`` is (its rows, whether it is the rank with outputs)."""
    import json
    import os

    import torch.distributed as dist

    from ablate.backends.verl.probe_passes import probe_mismatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(shares))
    rows, has_outputs = shares[rank]
    output, data = padded_shard(rows)
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(probe_mismatch(output, data, has_outputs), handle)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shares", [
    [([0, 1], True), ([2, 3, 4], True)],  # data parallel: each replica scores its share
    # tensor or pipeline parallel: one rank with outputs; what another holds must not count
    [([0, 1, 2, 3, 4], True), ([4, 4], False)],
], ids=["data-parallel", "one-rank-with-outputs"])
def test_ranks_together_give_the_trainers_keys_of_the_whole_batch(tmp_path, shares):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(score_on_rank, args=(port, shares, str(tmp_path / "keys")), nprocs=len(shares))
    output, data = padded_shard(list(range(len(SEQUENCES))))
    whole = trainer_mismatch(output["model_output"], data)
    for rank in range(len(shares)):
        assert json.loads((tmp_path / f"keys.{rank}").read_text()) == whole, rank
