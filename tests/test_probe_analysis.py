"""Probe analysis: per-step effects checked by hand, HAC intervals, and the CLI on a real probed sweep."""

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from synthetic_configs import compose_config

from ablate.analysis.load import load_runs
from ablate.analysis.probe_effects import across_cells, hac_interval, probe_cells, step_effects, within_run
from ablate.diagnostics import probe_key
from ablate.probes import parse_probes, probe_table
from ablate.runner import run_cell

PROBES = ["none", "full", "random@0.25", "random@0.5", "uniform@0.25", "mismatch@0.25"]
TABLE = {row["id"]: row for row in probe_table(parse_probes(PROBES))}


def step_row(step: int, values: dict[str, tuple[float, float]], seed: int = 0) -> dict:
    row = {"cell_id": f"c{seed}", "seed": seed, "policy": "none", "budget": 0.0, "step": step}
    for probe_id, (kl, effective) in values.items():
        row[probe_key(probe_id, "mismatch/kl_k3")] = kl
        row[probe_key(probe_id, "replay/effective_budget")] = effective
    return row


def test_step_effects_by_hand():
    values = {"none": (1.0, 0.0), "full": (0.0, 0.1), "random@0.25": (0.8, 0.02), "random@0.5": (0.6, 0.04),
              "uniform@0.25": (0.7, 0.02), "mismatch@0.25": (0.3, 0.06)}
    frame = pd.DataFrame([step_row(0, values)])
    effects = step_effects(frame, TABLE).set_index(["effect", "policy", "baseline", "budget"])["difference"]
    got = {key: value for key, value in effects.items()}
    assert got[("budget", "random", "none", 0.25)] == pytest.approx(-0.2)
    assert got[("budget", "random", "none", 0.5)] == pytest.approx(-0.4)
    assert got[("selection", "mismatch", "random", 0.25)] == pytest.approx(-0.5)
    assert got[("selection", "mismatch", "uniform", 0.25)] == pytest.approx(-0.4)
    assert got[("selection", "uniform", "random", 0.25)] == pytest.approx(-0.1)
    # random's curve: (0, 1), (0.02, 0.8), (0.04, 0.6), (0.1, 0): at e = 0.06 it is 0.6 - 0.02 * 10 = 0.4
    assert got[("matched_selection", "mismatch", "random", 0.25)] == pytest.approx(0.3 - 0.4)
    assert got[("matched_selection", "uniform", "random", 0.25)] == pytest.approx(0.7 - 0.8)
    replay = [v for (effect, *_), v in got.items() if effect == "replay"]
    assert replay == [pytest.approx(-1.0)]
    assert not any(policy == "random" and effect == "selection" for effect, policy, *_ in got)


def test_steps_without_probes_give_no_effects():
    frame = pd.DataFrame([step_row(0, {}), step_row(1, {"none": (1.0, 0.0), "random@0.25": (0.5, 0.02)})])
    effects = step_effects(frame, TABLE)
    assert effects["step"].tolist() == [1] and effects["effect"].tolist() == ["budget"]


def test_hac_interval_widens_with_autocorrelation():
    rng = np.random.default_rng(0)
    iid = rng.normal(size=400)
    walk = np.convolve(iid, np.ones(8) / 8, mode="valid")  # neighbours share seven of eight draws
    mean, low, high, lags = hac_interval(walk, lags=10)
    naive = 1.96 * walk.std() / math.sqrt(walk.size)
    assert low < mean < high and (high - low) / 2 > 2 * naive and lags == 10
    assert hac_interval(np.full(10, 0.5))[:3] == (0.5, 0.5, 0.5)
    assert math.isnan(hac_interval(np.array([1.0, 2.0]))[1])


def test_within_run_and_across_cells_on_a_hand_frame():
    rows = []
    for seed in range(3):
        for step in range(6):
            shift = 0.01 * seed + 0.001 * step
            rows.append(step_row(step, {"none": (1.0 + shift, 0.0), "random@0.25": (0.8 + shift, 0.02)}, seed))
    frame = pd.DataFrame(rows)
    runs = within_run(step_effects(frame, TABLE))
    assert runs["mean"].tolist() == pytest.approx([-0.2] * 3) and runs["n_steps"].tolist() == [6] * 3
    assert "conditional on its trajectory" in runs["note"].iloc[0]
    cells = probe_cells(frame, TABLE)
    assert sorted(cells["policy"]) == ["none"] * 3 + ["random"] * 3
    across = across_cells(frame, TABLE, min_seeds=3)
    (row,) = across[across["effect"] == "budget"].to_dict("records")
    assert row["mean"] == pytest.approx(-0.2) and row["n_seeds"] == 3


@pytest.mark.slow
def test_probes_cli_on_a_real_probed_sweep(tmp_path):
    for seed in (0, 1):
        run_cell(compose_config("policy=random", "budget=0.1", f"seed={seed}", "sweep=probed", "backend.steps=4",
                                f"probes=[{','.join(PROBES)}]", "probe_every=2", "tracking.mode=disabled", store=tmp_path))
    steps = load_runs(tmp_path / "probed", per_step=True)
    assert set(steps.attrs["probes"]) == set(PROBES)
    per_step = step_effects(steps, steps.attrs["probes"])
    assert sorted(per_step["step"].unique()) == [0, 2]
    record = steps[(steps["seed"] == 0) & (steps["step"] == 2)].iloc[0]
    budget = per_step[(per_step["seed"] == 0) & (per_step["step"] == 2) & (per_step["effect"] == "budget")
                      & (per_step["budget"] == 0.25)]["difference"].item()
    assert budget == record[probe_key("random@0.25", "mismatch/kl_k3")] - record[probe_key("none", "mismatch/kl_k3")]
    done = subprocess.run([sys.executable, "-m", "ablate.analysis", str(tmp_path / "probed"), "--probes",
                           "--min-seeds", "2", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "conditional on that cell's trajectory" in done.stdout and "matched_selection" in done.stdout
    assert (tmp_path / "out" / "probe_effects_kl_k3_mean.csv").is_file()
    wrong = subprocess.run([sys.executable, "-m", "ablate.analysis", str(tmp_path / "probed"), "--probes",
                            "--outcome", "final_reward"], capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and "--outcome final_reward with --probes: expected one of kl_k3_mean" in wrong.stderr
