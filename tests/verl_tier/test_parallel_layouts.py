"""The hook in a real multi-rank Megatron run on CPU: every layout replays and counts like one rank.

Each layout runs in its own gloo world of 2 processes (tensor parallel with sequence
parallelism, context parallel, pipeline parallel, pipeline with virtual stages, data parallel)
and is compared with the same run on one rank: for every policy, two training steps of an
old-log-prob call and two update calls, every router must use the same experts for every
(token, layer) in every pass, and the step's ``replay/`` and ``routing/`` keys must be equal.
In every layout the old-log-prob pass verl gets back replays exactly the routes of the update
passes, for ``mismatch`` too (after its native pass), so the PPO ratio starts at 1. The model
and the passes are described in ``megatron_world.py``.
"""

import math

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import megatron_world as world  # noqa: E402
from ablate.backends.verl.engines import MICRO_BATCHES_KEY  # noqa: E402
from ablate.budget import count_for  # noqa: E402
from worlds import merged  # noqa: E402
from worlds import run_layout as run_world  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.slow]

POLICIES = [("random", 0.4, {}), ("uniform", 0.5, {}), ("fisher", 0.3, {}), ("mismatch", 0.5, {})]
COUNTS = ("replay/valid_routes", "replay/replayed_routes", "replay/unrecorded_routes")


def run_layout(name: str, directory) -> dict:
    return run_world(world, name, POLICIES, directory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_layout("single", tmp_path_factory.mktemp("single"))


def returned(call: dict) -> dict:
    """The pass of a call whose output verl gets back."""
    return call["passes"][call["returned"]]


def pass_of_calls(step: dict, name: str, pass_index: int, what: str) -> list[dict]:
    """Every rank's ``what`` (``used``, ``outputs``) in one pass of every call ``name`` of a step."""
    return [rank for call in step["calls"] if call["name"] == name for rank in call["passes"][pass_index][what]]


def update_routes(step: dict) -> tuple[dict, int]:
    """Experts used for every (row, layer) over the step's update calls, and how many were routed twice."""
    return merged(pass_of_calls(step, "update", 0, "used"))


def old_log_prob_call(step: dict) -> dict:
    (call,) = [call for call in step["calls"] if call["name"] == "log_prob"]
    return call


def expected_counts(budget: float) -> dict[str, float]:
    """Counts of one step worked out from the batch: valid and unrecorded routes, per-sequence quotas."""
    moe_layers = sum(world.MOE_LAYER_FREQ)
    valid = replayed = unrecorded = 0
    for sequence in (s for batch in world.MICRO_BATCHES for s in batch):
        gap = sequence.gap[1] - sequence.gap[0]
        # R3 replays every token but the last of a sequence with a response; gaps are not recorded.
        tokens = sequence.tokens - 1 - gap if sequence.response else 0
        valid += tokens * moe_layers
        replayed += count_for(budget, tokens * moe_layers)
        unrecorded += (gap + 1) * moe_layers  # the gap and the final token's placeholder
    return {"replay/valid_routes": valid, "replay/replayed_routes": replayed, "replay/unrecorded_routes": unrecorded}


def test_one_rank_counts_the_batch_as_built(reference):
    for policy, budget, _ in POLICIES:
        first, second = (step["metrics"] for step in reference[policy])
        expected = expected_counts(budget)
        for metrics in (first, second):
            assert {key: metrics[key] for key in COUNTS} == expected, policy
            assert metrics["replay/budget_requested"] == budget
        assert first["replay/fisher_fallback"] == float(policy == "fisher")  # no estimate before step 1
        assert second["replay/fisher_fallback"] == 0.0
        for step in reference[policy]:
            used, twice = update_routes(step)
            assert twice == 0 and len(used) == sum(s.tokens for b in world.MICRO_BATCHES for s in b) * 7


def test_replayed_routes_use_the_recorded_experts(reference):
    """At least every replayed route uses its recorded experts; mismatch replays mismatched ones."""
    recorded = {}
    for index in range(len(world.MICRO_BATCHES)):
        batch = world.micro_batch_tensors(index)
        for rows, routes in zip(batch["rows"].unbind(), batch["routed_experts"].unbind()):
            for row, route in zip(rows.tolist(), routes):
                for layer, moe in enumerate(world.MOE_LAYER_FREQ):
                    if moe and len(set(route[layer].tolist())) == world.TOPK:
                        recorded[(row, layer + 1)] = sum(1 << int(e) for e in route[layer])
    for policy, _, _ in POLICIES:
        for step in reference[policy]:
            used, _ = update_routes(step)
            follows = sum(1 for key, bits in recorded.items() if used[key] == bits)
            assert follows >= step["metrics"]["replay/replayed_routes"], policy
    mismatch = reference["mismatch"][1]["metrics"]
    assert mismatch["replay/override_rate"] > reference["random"][1]["metrics"]["replay/override_rate"]


def check_old_log_probs_replay_the_update_routes(result: dict, where: str) -> None:
    """The old-log-prob pass verl gets back routes every (token, layer) as the update passes do.

    No optimizer step runs between the passes, so equal routes give equal outputs: the PPO ratio
    of the first update starts at exactly 1. ``mismatch`` runs a native pass first: its routes and
    outputs differ from the replayed pass's (had verl got them back, the ratio would start away
    from 1 on the routes ``mismatch`` replays).
    """
    for policy, _, _ in POLICIES:
        for step_index, step in enumerate(result[policy]):
            at = f"{where}, {policy}, step {step_index + 1}"
            call = old_log_prob_call(step)
            assert len(call["passes"]) == (2 if policy == "mismatch" else 1), at
            old_routes, _ = merged(returned(call)["used"])
            assert old_routes == update_routes(step)[0], f"{at}: the old-log-prob pass routes unlike the updates"
            old_outputs, _ = merged(returned(call)["outputs"])
            update_outputs, _ = merged(pass_of_calls(step, "update", 0, "outputs"))
            assert old_outputs == update_outputs, f"{at}: old-log-prob outputs differ from the update's"
            if policy == "mismatch":
                native_routes, _ = merged(call["passes"][0]["used"])
                native_outputs, _ = merged(call["passes"][0]["outputs"])
                assert native_routes.keys() == old_routes.keys() and native_routes != old_routes, at
                assert native_outputs.keys() == old_outputs.keys() and native_outputs != old_outputs, at


def test_old_log_probs_come_from_a_replayed_forward(reference):
    check_old_log_probs_replay_the_update_routes(reference, "single")


@pytest.mark.parametrize("name", ["tp2_sp", "cp2", "pp2", "pp2_vpp2", "dp2"])
def test_layout_replays_and_counts_like_one_rank(reference, tmp_path, name):
    result = run_layout(name, tmp_path)
    for policy, _, _ in POLICIES:
        for step_index, (ours, theirs) in enumerate(zip(result[policy], reference[policy])):
            where = f"{name}, {policy}, step {step_index + 1}"
            # Data-parallel ranks share the calls of a step: compare each kind of call and pass as a whole.
            for call_name, passes in (("log_prob", 2 if policy == "mismatch" else 1), ("update", 1)):
                for pass_index in range(passes):
                    at = f"{where}, {call_name} pass {pass_index}"
                    used, twice = merged(pass_of_calls(ours, call_name, pass_index, "used"))
                    assert twice == 0, f"{at}: some (token, layer) was routed on two ranks"
                    assert used == merged(pass_of_calls(theirs, call_name, pass_index, "used"))[0], \
                        f"{at}: routes differ from one rank's"
            assert ours["metrics"].keys() == theirs["metrics"].keys()
            for key, value in theirs["metrics"].items():
                if key == MICRO_BATCHES_KEY:
                    # The liveness count of this rank's own micro-batches: under DP each rank sees its
                    # share of them, so it is no route count to match one rank's; it must be positive.
                    assert ours["metrics"][key] > 0, f"{where}: {key}"
                elif math.isnan(value):
                    assert math.isnan(ours["metrics"][key]), f"{where}: {key}"
                else:
                    assert ours["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), f"{where}: {key}"
    check_old_log_probs_replay_the_update_routes(result, name)
