"""The hook in a real multi-rank Megatron run on CPU: every layout replays and counts like one rank.

Each layout runs in its own gloo world of 2 processes (tensor parallel with sequence
parallelism, context parallel, pipeline parallel, pipeline with virtual stages, data parallel)
and is compared with the same run on one rank: for every policy, two training steps of an
old-log-prob pass and two update calls, every router must use the same experts for every
(token, layer), and the step's ``replay/`` and ``routing/`` keys must be equal. The model and
the passes are described in ``megatron_world.py``.
"""

import math
import socket

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import megatron_world as world  # noqa: E402
from ablate.budget import count_for  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.slow]

POLICIES = [("random", 0.4, {}), ("uniform", 0.5, {}), ("fisher", 0.3, {}), ("mismatch", 0.5, {})]
COUNTS = ("replay/valid_routes", "replay/replayed_routes", "replay/unrecorded_routes")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_layout(name: str, directory) -> dict:
    layout = world.LAYOUTS[name]
    path = directory / f"{name}.pt"
    mp.spawn(world.run, args=(layout, free_port(), POLICIES, str(path)), nprocs=layout.world)
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_layout("single", tmp_path_factory.mktemp("single"))


def merged(per_call: list[list[dict]]) -> tuple[dict, int]:
    """One (row, layer) -> experts map over calls and ranks, and how many entries were routed twice."""
    used, twice = {}, 0
    for ranks in per_call:
        for rank_used in ranks:
            twice += sum(1 for key in rank_used if key in used)
            used.update(rank_used)
    return used, twice


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
            used, twice = merged(step["used"]["update"])
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
            used, _ = merged(step["used"]["update"])
            follows = sum(1 for key, bits in recorded.items() if used[key] == bits)
            assert follows >= step["metrics"]["replay/replayed_routes"], policy
    mismatch = reference["mismatch"][1]["metrics"]
    assert mismatch["replay/override_rate"] > reference["random"][1]["metrics"]["replay/override_rate"]


@pytest.mark.parametrize("name", ["tp2_sp", "cp2", "pp2", "pp2_vpp2", "dp2"])
def test_layout_replays_and_counts_like_one_rank(reference, tmp_path, name):
    result = run_layout(name, tmp_path)
    for policy, _, _ in POLICIES:
        for step_index, (ours, theirs) in enumerate(zip(result[policy], reference[policy])):
            where = f"{name}, {policy}, step {step_index + 1}"
            for call in ("log_prob", "update"):
                used, twice = merged(ours["used"][call])
                assert twice == 0, f"{where}, {call}: some (token, layer) was routed on two ranks"
                assert used == merged(theirs["used"][call])[0], f"{where}, {call}: routes differ from one rank's"
            assert ours["metrics"].keys() == theirs["metrics"].keys()
            for key, value in theirs["metrics"].items():
                if math.isnan(value):
                    assert math.isnan(ours["metrics"][key]), f"{where}: {key}"
                else:
                    assert ours["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-12), f"{where}: {key}"
