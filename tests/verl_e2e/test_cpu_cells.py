"""Every policy as a complete verl cell on the CPU, read back from the run store and the W&B run.

One multirun runs the six policies (and the example `margin`, where installed) at budget 0.5 (seed 0)
through verl's real ``main_ppo``: Ray, the Megatron actor with R3 on gloo, the CPU rollout with noisy
routers, the worker hook.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from cpu_cells import (
    BUDGET,
    CELLS,
    EXAMPLE,
    POLICIES,
    PROBES,
    STEPS,
    cell_dir,
    check_complete_with_every_key,
    needs_verl_runtime,
)

needs_verl_runtime()
pytestmark = [pytest.mark.slow, pytest.mark.verl]

def records(store, policy) -> pd.DataFrame:
    from ablate.store import read_records

    return read_records(cell_dir(store / "cpu", CELLS[policy]))


def test_every_policy_completes_with_every_key_from_the_store_and_the_wandb_run(policy_store):
    for policy in (*POLICIES, *EXAMPLE):
        check_complete_with_every_key(cell_dir(policy_store / "cpu", CELLS[policy]), policy)


def test_replayed_routes_are_the_budgets_count_of_the_recorded_routes(policy_store):
    from ablate.budget import count_for

    for policy in POLICIES:
        frame = records(policy_store, policy)
        budget = {"none": 0.0, "full": 1.0}.get(policy, BUDGET)
        assert (frame["replay/valid_routes"] > 0).all(), policy
        # Each micro-batch replays count_for(budget, its routes); with 2 MoE layers every micro-batch has an
        # even number of routes, so at 0.5 the step's sum is exactly the count of the step's routes.
        expected = [count_for(budget, int(valid)) for valid in frame["replay/valid_routes"]]
        assert frame["replay/replayed_routes"].astype(int).tolist() == expected, policy
        assert frame["replay/budget_requested"].tolist() == [budget] * STEPS, policy


def test_routes_disagree_and_replay_fixes_them(policy_store):
    none, full = records(policy_store, "none"), records(policy_store, "full")
    assert (none["routing/route_mismatch_rate"] > 0).all()  # the CPU rollout's noisy routers disagree
    assert (none["routing/residual_mismatch_rate"] == none["routing/route_mismatch_rate"]).all()
    assert (full["routing/residual_mismatch_rate"] == 0).all()
    assert (full["replay/override_rate"] > 0).all()
    assert full["mismatch/kl_k3"].mean() < none["mismatch/kl_k3"].mean()
    for policy in ("random", "uniform", "fisher", "mismatch"):
        frame = records(policy_store, policy)
        assert (frame["routing/residual_mismatch_rate"] < frame["routing/route_mismatch_rate"]).all(), policy


def test_mismatch_selects_on_the_native_routes_of_its_native_pass(policy_store):
    mismatch, random = records(policy_store, "mismatch"), records(policy_store, "random")
    # mismatch ranks the routes its native pass found mismatched first, and they fit the budget.
    fits = mismatch["routing/route_mismatch_rate"] <= mismatch["replay/budget_realized"]
    assert fits.all()
    # The routing/ keys compare against the native routes of the replayed pass. Replaying a
    # route changes the hidden states of the layers after it, so a few later-layer native routes
    # move away from what the native pass saw: recall is near 1, not exactly 1. Without the
    # native pass the choice would be blind and recall would sit near the budget, as random's does.
    assert (mismatch["routing/mismatch_recall"] >= 0.9).all()
    assert (mismatch["routing/residual_mismatch_rate"] < random["routing/residual_mismatch_rate"] / 4).all()
    assert (random["routing/mismatch_recall"] < 0.75).all()


def test_fisher_falls_back_on_its_first_step_only(policy_store):
    fisher = records(policy_store, "fisher")
    assert fisher["replay/fisher_fallback"].tolist() == [1.0] + [0.0] * (STEPS - 1)
    assert math.isnan(fisher["replay/fisher_mass"].iloc[0])
    assert (fisher["replay/fisher_mass"].iloc[1:] > 0).all()
    assert (fisher["replay/fisher_mass"].iloc[1:] <= 1).all()


def test_probes_with_the_cells_mask_reproduce_its_keys_exactly(policy_store):
    from ablate.diagnostics import SCHEMA
    from ablate.diagnostics.schema import PROBE_KEYS, probe_key

    mismatch = [key for key in SCHEMA if key.startswith("mismatch/")]
    for policy in POLICIES:
        frame = records(policy_store, policy)
        missing = [probe_key(probe, key) for probe in PROBES for key in PROBE_KEYS if probe_key(probe, key) not in frame]
        assert not missing, (policy, missing)
    for policy in ("none", "full"):
        frame = records(policy_store, policy)
        for key in (*mismatch, "replay/budget_realized"):
            assert frame[probe_key(policy, key)].tolist() == frame[key].tolist(), (policy, key)
    # random@0.5 draws its own mask at the cell's exact budget: the same count, other routes
    random = records(policy_store, "random")
    probe = f"random@{BUDGET}"
    assert random[probe_key(probe, "replay/budget_realized")].tolist() == random["replay/budget_realized"].tolist()
    assert random[probe_key(probe, "mismatch/kl_k3")].tolist() != random["mismatch/kl_k3"].tolist()


@pytest.mark.skipif(not EXAMPLE, reason="examples/margin_policy is not installed here (.ci/verl-env.sh installs it)")
def test_the_example_margin_policy_replays_its_budget_and_finds_the_routes_that_flip(policy_store):
    from ablate.budget import count_for

    margin, random = records(policy_store, "margin"), records(policy_store, "random")
    assert margin["replay/budget_requested"].tolist() == [BUDGET] * STEPS
    expected = [count_for(BUDGET, int(valid)) for valid in margin["replay/valid_routes"]]
    assert margin["replay/replayed_routes"].astype(int).tolist() == expected
    # margin ranks on its native pass's router margins (near-ties are where routes flip): it finds
    # mismatched routes well beyond the budget's share, which is all random can find.
    assert margin["routing/mismatch_recall"].mean() > random["routing/mismatch_recall"].mean() + 0.1
    assert (margin["routing/residual_mismatch_rate"] < margin["routing/route_mismatch_rate"]).all()


#: Keys that time or size the run: they say nothing about what probes do to training.
RUN_SIZE_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")


def test_probes_leave_training_as_it_is_without_them(policy_store, assets):
    """The multirun's `random` cell scores three probes on every step; the same cell without probes
    (its own sweep) must train the same, bit for bit: the same samples, rewards, routes, replay,
    losses and every batch mean (each request seeded from its sample, each step's batch in the
    order of its prompts: docs/verl-cpu.md). Only the timings and sizes of the run may differ.
    """
    from cpu_cells import run_ablate

    done, seconds = run_ablate(policy_store, assets, "policy=random", f"budget={BUDGET}", "seed=0",
                               "sweep=cpu-unprobed", "tracking.mode=disabled")
    print(f"\nthe unprobed random cell: {seconds:.0f} s wall")
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    from ablate.store import read_records

    unprobed = read_records(cell_dir(policy_store / "cpu-unprobed", CELLS["random"]))
    probed = records(policy_store, "random")
    assert not [key for key in unprobed.columns if key.startswith("probe/")]
    assert {key for key in probed.columns if not key.startswith("probe/")} == set(unprobed.columns)
    keys = [key for key in unprobed.columns if not key.startswith(RUN_SIZE_PREFIXES)]
    assert len(keys) > 80 and {"replay/replayed_routes", "actor/pg_loss", "critic/score/mean"} <= set(keys)
    differing = [key for key in keys if not probed[key].equals(unprobed[key])]  # NaN equals NaN here
    assert not differing, {key: (probed[key].tolist(), unprobed[key].tolist()) for key in differing}
