"""load_runs on a run store written by hand per the layout of ablate/store.py, and ablate-analyze end to end."""

import json
import math
import warnings
import zlib

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.cli import main
from ablate.analysis.load import CorruptCellError, ExcludedCellsWarning, load_runs
from ablate.analysis.outcomes import OUTCOME_NAMES, cell_outcomes

SWEEP = "toy"
BUDGETS = (0.25, 0.5)
SEEDS = (0, 1, 2)
STEPS = 20


def _grid():
    for seed in SEEDS:
        yield "none", 0.0, seed
        yield "full", 1.0, seed
        for budget in BUDGETS:
            for policy in ("random", "uniform", "fisher"):
                yield policy, budget, seed


def _records(policy, budget, seed):
    rng = np.random.default_rng(zlib.crc32(f"{policy}|{budget}|{seed}".encode()))
    step = np.arange(STEPS)
    gain = {"none": 0.2, "full": 0.8}.get(policy, budget + (0.2 if policy == "fisher" else 0.0))
    reward = gain * (1 - np.exp(-step / 5)) + 0.05 * seed + rng.normal(scale=0.01, size=STEPS)
    override = np.full(STEPS, np.nan) if policy == "none" else rng.uniform(0.05, 0.15, STEPS)
    return pd.DataFrame({
        "step": step,
        "train/reward": reward,
        "mismatch/kl_k3": (1.0 - budget) * 0.01 + rng.uniform(0, 0.001, STEPS),
        "mismatch/extreme_token_frac": (1.0 - budget) * 0.02 * np.ones(STEPS),
        "replay/override_rate": override,
        "routing/residual_mismatch_rate": (1.0 - budget) * 0.1 * np.ones(STEPS),
        "drift/experts": step / 100.0,
    })


def write_cell(sweep_dir, policy, budget, seed, status="complete", records=True):
    name = f"{policy}-b{budget:g}-s{seed}"
    cell_id = f"{zlib.crc32(name.encode()):08x}" * 2
    cell_dir = sweep_dir / f"{name}-{cell_id[:8]}"
    cell_dir.mkdir(parents=True)
    (cell_dir / "cell.json").write_text(json.dumps({
        "cell_id": cell_id, "name": name, "sweep": sweep_dir.name, "backend": "synthetic",
        "policy": policy, "budget": budget, "seed": seed, "schema_version": 1, "settings": {},
    }))
    (cell_dir / "status.json").write_text(json.dumps({
        "status": status, "error": "boom" if status == "failed" else None, "traceback": None,
        "started_at": "2026-01-01T00:00:00", "finished_at": None, "host": "h", "pid": 1,
        "attempt": 1, "warnings": [],
    }))
    if records:
        frame = _records(policy, budget, seed)
        frame.to_parquet(cell_dir / "records.parquet")
        (cell_dir / "summary.json").write_text(json.dumps(cell_outcomes(frame)))
    return cell_dir


@pytest.fixture
def sweep_dir(tmp_path):
    sweep_dir = tmp_path / "runs" / SWEEP
    for policy, budget, seed in _grid():
        write_cell(sweep_dir, policy, budget, seed)
    write_cell(sweep_dir, "fisher", 0.25, 7, status="failed", records=False)
    write_cell(sweep_dir, "random", 0.5, 8, status="running", records=False)
    return sweep_dir


def test_load_runs_one_row_per_complete_cell_and_counts_the_rest(sweep_dir):
    with pytest.warns(ExcludedCellsWarning, match="1 failed, 1 running"):
        df = load_runs(sweep_dir)
    assert len(df) == len(list(_grid()))
    assert df.attrs["excluded"] == {"failed": 1, "running": 1, "corrupt": 0}
    assert {"backend", "policy", "budget", "seed", "status", "cell_id", "name", "sweep"} <= set(df.columns)
    assert set(OUTCOME_NAMES) <= set(df.columns)
    assert (df["status"] == "complete").all() and set(df["sweep"]) == {SWEEP}
    row = df[(df.policy == "fisher") & (df.budget == 0.5) & (df.seed == 1)].iloc[0]
    expected = cell_outcomes(_records("fisher", 0.5, 1))
    assert row["final_reward"] == pytest.approx(expected["final_reward"])
    assert row["drift/experts"] == pytest.approx((STEPS - 1) / 100)
    assert math.isnan(df[df.policy == "none"]["override_rate_mean"].iloc[0])


def test_load_runs_store_root_plus_sweep_name_and_settings(sweep_dir):
    with pytest.warns(ExcludedCellsWarning):
        df = load_runs(sweep_dir.parent, SWEEP, outcome_settings={"final_fraction": 1.0})
    row = df[(df.policy == "full") & (df.seed == 0)].iloc[0]
    assert row["final_reward"] == pytest.approx(_records("full", 1.0, 0)["train/reward"].mean())
    with pytest.raises(FileNotFoundError, match="pass sweep=NAME"):
        load_runs(sweep_dir.parent)


def test_load_runs_per_step(sweep_dir):
    with pytest.warns(ExcludedCellsWarning):
        steps = load_runs(sweep_dir, per_step=True)
    assert len(steps) == len(list(_grid())) * STEPS
    assert steps.groupby(["policy", "budget", "seed"]).size().eq(STEPS).all()
    assert steps.attrs["excluded"]["failed"] == 1


def test_corrupt_records_raise_naming_the_file_or_are_excluded_and_listed(sweep_dir):
    bad = next(sweep_dir.glob("uniform-b0.25-s2-*")) / "records.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(CorruptCellError, match=str(bad)):
        load_runs(sweep_dir)
    with pytest.warns(ExcludedCellsWarning, match="1 corrupt"):
        df = load_runs(sweep_dir, on_corrupt="exclude")
    assert df.attrs["excluded"]["corrupt"] == 1
    assert str(bad) in df.attrs["corrupt_files"][0]
    assert len(df) == len(list(_grid())) - 1


def test_clean_store_warns_nothing(tmp_path):
    sweep_dir = tmp_path / "clean"
    write_cell(sweep_dir, "none", 0.0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load_runs(sweep_dir)
    assert df.attrs["excluded"] == {"failed": 0, "running": 0, "corrupt": 0}


def test_cli_end_to_end(sweep_dir, capsys):
    # SWEEP given as a name inside --store; the output goes to the default <sweep_dir>/analysis.
    assert main([SWEEP, "--store", str(sweep_dir.parent), "--reps", "200",
                 "--outcome", "final_reward", "--outcome", "kl_k3_mean"]) == 0
    out = sweep_dir / "analysis"
    printed = capsys.readouterr().out
    assert "failed=1, running=1" in printed and "| policy | budget | mean" in printed
    table = (out / "table_final_reward.md").read_text().strip().splitlines()
    assert len(table) == 2 + 2 + len(BUDGETS) * 3  # header, rule, none, full, budgeted cells
    for stem in ("table_kl_k3_mean.tex", "table_final_reward.parquet", "effects_final_reward.csv",
                 "effects_final_reward.md", "flags.csv", "cells.csv"):
        assert (out / stem).stat().st_size > 0
    for plot in ("budget_response_final_reward", "selection_effects_final_reward", "steps"):
        for ext in ("png", "svg"):
            assert (out / f"{plot}.{ext}").stat().st_size > 1000
    effects_table = pd.read_csv(out / "effects_final_reward.csv")
    assert "only 3 paired seeds" in effects_table["note"].iloc[0]


def test_cli_fails_clearly_on_a_corrupt_cell_unless_skipped(sweep_dir, tmp_path, capsys):
    bad = next(sweep_dir.glob("none-b0-s0-*")) / "cell.json"
    bad.write_text("{truncated")
    with pytest.raises(CorruptCellError, match=str(bad)):
        main([str(sweep_dir), "--out", str(tmp_path / "a")])
    assert main([str(sweep_dir), "--out", str(tmp_path / "b"), "--reps", "50", "--skip-corrupt", "--no-plots"]) == 0
    assert f"corrupt: {bad}" in capsys.readouterr().out
    assert (tmp_path / "b" / "table_final_reward.md").exists()
    assert not list((tmp_path / "b").glob("*.png"))
