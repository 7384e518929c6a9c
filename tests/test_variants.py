"""The replay variants (docs/policies.md, "Replay variants"): R2, prime-rl's score gate, the rollout's gate weights.

The three relations issue 36 asks to hold are checked on tiny synthetic cells of one seed:

- ``full`` with ``replay.source=train`` (R2) replays every valid route and still leaves the
  rollout-trainer mismatch, where ``full`` (R3) leaves none;
- ``threshold`` at ratio 0 is ``full``, at ratio 1 changes no route from the native one, and
  between them hands back a share of the replayed slots strictly between 0 and 1;
- ``full`` with ``replay.weights=rollout`` leaves less ``mismatch/kl_k3`` than ``full``.

Around them: the gate's rule by hand, the variant's place in the cell's identity and name, the one-line
refusals, a grid over ``replay.source`` and the analysis reading a variant of ``full`` against ``full``.
"""

import hashlib
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from synthetic_configs import TINY, compose_config

from ablate.analysis.tables import effects
from ablate.backends.synthetic import run_cell_steps
from ablate.compose import cell_from_config
from ablate.config import ConfigError
from ablate.policies import ThresholdReplay
from ablate.store import read_records
from ablate.sweep import plan_grid

STEPS = "backend.steps=4"


def records(*overrides: str) -> list[dict[str, float]]:
    """The step records of one tiny synthetic cell, run in process."""
    cell = cell_from_config(compose_config(STEPS, *overrides))
    found: list[dict[str, float]] = []
    run_cell_steps(cell, lambda step, record: found.append(record))
    return found


def column(found: list[dict[str, float]], key: str) -> np.ndarray:
    return np.array([record[key] for record in found])


# --- what must hold --------------------------------------------------------------------------


def test_r2_replays_every_route_and_leaves_the_mismatch_that_r3_removes():
    r3, r2 = records("policy=full", "seed=3"), records("policy=full", "replay.source=train", "seed=3")
    assert (column(r2, "replay/budget_realized") == 1).all() and (column(r3, "replay/budget_realized") == 1).all()
    assert (column(r2, "routing/residual_mismatch_rate") > 0).all()
    assert (column(r3, "routing/residual_mismatch_rate") == 0).all()
    # R2's routes are the trainer's own: in the pass that records them it changes none and restores none.
    assert (column(r2, "replay/effective_budget") == 0).all() and (column(r2, "routing/mismatch_recall") == 0).all()
    assert (column(r2, "routing/residual_mismatch_rate") == column(r2, "routing/route_mismatch_rate")).all()


def test_threshold_is_full_at_ratio_0_native_at_ratio_1_and_hands_back_a_share_between():
    full, at_0 = records("policy=full", "seed=1"), records("policy=threshold", "policy.ratio=0", "seed=1")
    assert json.dumps(at_0, sort_keys=True) == json.dumps(full, sort_keys=True)  # every key, every step, NaN alike
    at_1 = records("policy=threshold", "policy.ratio=1", "seed=1")
    assert (column(at_1, "replay/budget_realized") == 1).all()  # every route offered ...
    assert (column(at_1, "replay/effective_budget") == 0).all()  # ... and none left differing from the native one
    assert (column(at_1, "replay/replace_rate") > 0).all()
    between = records("policy=threshold", "policy.ratio=0.97", "seed=1")
    rate = column(between, "replay/replace_rate").mean()
    assert 0 < rate < column(at_1, "replay/replace_rate").mean() <= 1


def test_the_rollouts_gate_weights_leave_less_kl_than_recomputed_ones():
    recomputed = column(records("policy=full", "seed=2"), "mismatch/kl_k3")
    replayed = column(records("policy=full", "replay.weights=rollout", "seed=2"), "mismatch/kl_k3")
    assert replayed[0] < recomputed[0]  # step 0: the same weights and batch, paired
    assert replayed.mean() < recomputed.mean()


# --- the gate --------------------------------------------------------------------------------


def test_the_gate_keeps_slots_by_the_trainers_score_and_refills_from_its_top_k_in_order():
    scores = torch.tensor([[0.40, 0.30, 0.20, 0.10]])  # the trainer's top-2: experts 0, 1 (weakest 0.30)
    native = torch.tensor([[0, 1]])
    replayed = torch.tensor([[2, 3]])  # scores 0.20 and 0.10: 2/3 and 1/3 of the weakest
    for ratio, used, replaced in ((0.0, [2, 3], 0), (0.5, [2, 0], 1), (0.7, [0, 1], 2), (1.0, [0, 1], 2)):
        got, handed_back = ThresholdReplay(ratio=ratio).gate(scores, replayed, native)
        assert got.tolist() == [used] and handed_back.tolist() == [replaced], ratio
    # A kept native expert is not refilled twice: replayed (1, 3) at ratio 0.5 keeps 1 and takes 0 for 3.
    got, handed_back = ThresholdReplay(ratio=0.5).gate(scores, torch.tensor([[1, 3]]), native)
    assert got.tolist() == [[1, 0]] and handed_back.tolist() == [1]


# --- identity, names, refusals ---------------------------------------------------------------


def test_a_cell_without_a_variant_keeps_the_identity_it_had_before_the_replay_section():
    cell = cell_from_config(compose_config("policy=fisher", "budget=0.25", "seed=3"))
    before = {k: v for k, v in cell.resolved.items()
              if k not in ("replay", "tracking", "store_dir", "sweep", "objective", "plugins", "analysis",
                           "cell_timeout")}
    before["schema_version"] = "1.2"  # the version every stored cell's identity was hashed with
    assert cell.cell_id == hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()
    assert cell.resolved["replay"] == {"source": "rollout", "weights": "recompute"}
    variant = cell_from_config(compose_config("policy=fisher", "budget=0.25", "seed=3", "replay.source=train"))
    assert variant.cell_id != cell.cell_id and variant.name == "fisher+replay.source=train-b0.25-s3"
    assert variant.replay.source == "train" and variant.variant == "replay.source=train"


@pytest.mark.parametrize("overrides, message", [
    (["policy=none", "replay.source=train"],
     "replay.source=train with policy=none: none replays no route, so how routes are replayed changes nothing; "
     "leave replay.source at its default (a sweep's grid drops it for none)"),
    (["policy=full", "replay.source=train", "replay.weights=rollout"],
     "replay.weights=rollout with replay.source=train: R2 replays the trainer's own expert ids, and its "
     "old-log-prob pass records no rollout gate weights to go with them; use replay.weights=recompute"),
    (["policy=threshold", "replay.weights=rollout"],
     "replay.weights=rollout with policy=threshold: its gate puts the trainer's experts into replayed routes, "
     "which have no rollout gate weights; use replay.weights=recompute"),
    (["policy=mismatch", "budget=0.5", "replay.source=train"],
     "replay.source=train with policy=mismatch: mismatch ranks routes by how their replayed experts differ from "
     "the native ones, and R2 replays the trainer's own native routes, so none differ"),
    (["policy=random", "budget=0.5", "probes=[threshold]"], "probes=[threshold]: a probe scores a mask"),
    (["policy=threshold", "policy.ratio=1.5"],
     "policy.ratio=1.5: expected a ratio in [0, 1] of the trainer's weakest top-k gate score (0: full replay; 1: "
     "none that differs)"),
    (["policy=full", "replay.source=trian"], "replay.source"),
])
def test_a_variant_a_cell_cannot_replay_fails_in_one_line(overrides, message):
    with pytest.raises(Exception) as raised:
        cell_from_config(compose_config(*overrides))
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("overrides, message", [
    (["policy=threshold"], "policy=threshold with backend=verl: its gate needs the trainer's router scores where "
                           "each route is applied"),
    (["policy=full", "replay.weights=rollout"], "replay.weights=rollout with backend=verl: its rollout hands over "
                                                 "expert ids without their gate weights"),
])
def test_verl_refuses_the_variants_it_cannot_replay_before_anything_is_written(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cell_from_config(compose_config("backend=verl", *overrides, tiny=False))
    assert cell_from_config(compose_config("backend=verl", "policy=full", "replay.source=train", tiny=False))


def test_a_grid_over_the_replay_source_drops_it_for_none(tmp_path):
    jobs = [[f"policy={policy}", f"replay.source={source}", "budget=0.5", "seed=0"]
            for policy in ("none", "random") for source in ("rollout", "train")]
    planned = plan_grid(jobs, lambda overrides: compose_config(*overrides, store=tmp_path))
    assert sorted(p.cell.name for p in planned) == ["none-s0", "random+replay.source=train-b0.5-s0", "random-b0.5-s0"]


# --- the analysis ----------------------------------------------------------------------------


def test_a_variant_of_full_meets_random_at_budget_1_which_is_full():
    rows = []
    for seed in range(6):
        for policy, budget, y, e in (("none", 0.0, 5.0, 0.0), ("full", 1.0, 1.0, 0.2), ("random", 0.5, 3.0, 0.1),
                                     ("full[replay.source=train]", 1.0, 5.0 + 0.01 * seed, 0.0)):
            rows.append({"policy": policy, "budget": budget, "seed": seed, "kl_k3_mean": y,
                         "effective_budget_mean": e})
    table = effects(pd.DataFrame(rows), "kl_k3_mean", reps=200)
    variant = table[table["policy"] == "full[replay.source=train]"].set_index("effect")
    assert variant.loc["selection", "baseline"] == "random" and variant.loc["selection", "budget"] == 1.0
    assert variant.loc["selection", "mean"] == pytest.approx(4.025)  # against full, seed by seed
    assert math.isclose(variant.loc["matched_selection", "mean"], 0.025)  # against none: random's curve at e=0


# --- from the command line -------------------------------------------------------------------


def ablate(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ablate", *args, f"store_dir={tmp_path / 'runs'}"]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
                          cwd=tmp_path)


def test_the_variants_sweep_plans_its_union_of_grids(tmp_path):
    done = ablate(tmp_path, "sweeps=variants", "hydra.sweeper.dry_run=true")
    assert done.returncode == 0, done.stdout[-2000:]
    planned = "sweep variants: 120 cells: 0 complete (skipped), 0 failed (rerun), 0 unfinished (rerun), 120 new"
    assert planned in done.stdout
    names = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("new ")}
    assert {"none-s9", "full-s9", "random-b0.1-s9", "full+replay.source=train-s9", "random+replay.source=train-b0.5-s9",
            "threshold+ratio=0.98-s9", "full+replay.weights=rollout-s9"} <= names
    assert not any(name.startswith("none+") or name.startswith("random+replay.source=train-b0.1") for name in names)


@pytest.mark.slow
def test_the_replay_source_is_a_grid_axis_of_a_real_multirun(tmp_path):
    shrink = [o for o in TINY if not o.startswith("backend.steps")]
    done = ablate(tmp_path, "-m", "policy=none,full,random", "budget=0.5", "replay.source=rollout,train", "seed=0",
                  "backend.steps=2", *shrink, "tracking.mode=disabled")
    assert done.returncode == 0, done.stdout[-3000:]
    sweep = tmp_path / "runs" / "adhoc"
    found = {path.name.rsplit("-", 1)[0]: path for path in sweep.iterdir() if not path.name.startswith("_")}
    assert set(found) == {"none-s0", "full-s0", "random-b0.5-s0", "full+replay.source=train-s0",
                          "random+replay.source=train-b0.5-s0"}
    r2 = read_records(found["full+replay.source=train-s0"])
    assert (r2["routing/residual_mismatch_rate"] > 0).all() and (r2["replay/budget_realized"] == 1).all()
