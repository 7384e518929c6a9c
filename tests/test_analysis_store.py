"""load_runs on a run store written by hand per the layout of ablate/store/layout.py, and ablate-analyze end to end."""

import json
import math
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pandas as pd
import pytest
import yaml

from ablate.analysis.cli import main
from ablate.analysis.load import CorruptCellError, ExcludedCellsWarning, MixedSchemaWarning, load_runs
from ablate.cell import cell_id_of
from ablate.outcomes import OUTCOME_NAMES, cell_outcomes

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
        "replay/budget_realized": np.full(STEPS, budget),
        "routing/residual_mismatch_rate": (1.0 - budget) * 0.1 * np.ones(STEPS),
        "drift/experts": step / 100.0,
    })


def write_cell(sweep_dir, policy, budget, seed, status="complete", records=True, backend=None, schema="1.0",
               analysis=None):
    """A cell as the runner writes it; ``backend`` overrides keys of its resolved config, ``analysis`` is the
    sweep file's analysis block."""
    backend = {"name": "synthetic", "steps": STEPS, "router_noise": 0.07, **(backend or {})}
    name = f"{policy}-b{budget:g}-s{seed}"
    config = {
        "backend": backend, "policy": {"name": policy, "per_layer": False},
        "tracking": {"mode": "offline", "tags": []}, "budget": budget, "seed": seed, "sweep": sweep_dir.name,
        "store_dir": str(sweep_dir.parent), "objective": "final_reward", "trial": None,
        "schema_version": schema, **({"analysis": analysis} if analysis else {}),
    }
    cell_id = cell_id_of(config)
    cell_dir = sweep_dir / f"{name}-{cell_id[:8]}"
    cell_dir.mkdir(parents=True)
    (cell_dir / "cell.json").write_text(json.dumps({
        "cell_id": cell_id, "name": name, "sweep": sweep_dir.name, "backend": backend["name"],
        "policy": policy, "budget": budget, "seed": seed, "schema_version": schema, "settings": {"per_layer": False},
    }))
    (cell_dir / "config.yaml").write_text(yaml.safe_dump(config))
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
    with pytest.warns(ExcludedCellsWarning, match="1 failed, 1 unfinished"):
        df = load_runs(sweep_dir)
    assert len(df) == len(list(_grid()))
    # "running" with no live worker holding its claim: its worker was killed or crashed.
    assert df.attrs["excluded"] == {"failed": 1, "interrupted": 0, "running": 0, "unfinished": 1, "corrupt": 0}
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
    assert df.attrs["excluded"] == {"failed": 0, "interrupted": 0, "running": 0, "unfinished": 0, "corrupt": 0}


def test_cli_end_to_end(sweep_dir, capsys):
    # SWEEP given as a name inside --store; the output goes to the default <sweep_dir>/analysis.
    assert main([SWEEP, "--store", str(sweep_dir.parent), "--reps", "200",
                 "--outcome", "final_reward", "--outcome", "kl_k3_mean"]) == 0
    out = sweep_dir / "analysis"
    printed = capsys.readouterr().out
    assert "failed=1, interrupted=0, running=0, unfinished=1" in printed and "| policy | budget | mean" in printed
    table = (out / "table_final_reward.md").read_text().strip().splitlines()
    assert len(table) == 2 + 2 + len(BUDGETS) * 3  # header, rule, none, full, budgeted cells
    for stem in ("table_kl_k3_mean.tex", "table_final_reward.parquet", "effects_final_reward.csv",
                 "effects_final_reward.md", "flags.csv", "cells.csv"):
        assert (out / stem).stat().st_size > 0
    for plot in ("budget_response_final_reward", "selection_effects_final_reward", "steps"):
        for ext in ("png", "svg"):
            assert (out / f"{plot}.{ext}").stat().st_size > 1000
    effects_table = pd.read_csv(out / "effects_final_reward.csv")
    assert "3 paired seeds < 6: no interval" in effects_table["note"].iloc[0]
    assert effects_table["ci_low"].isna().all() and effects_table["p_adj"].notna().all()
    assert "p_adj: Holm (family-wise error) within each family" in printed
    assert (out / "effective_budget_final_reward.png").stat().st_size > 1000


def test_cli_fails_in_one_line_on_a_corrupt_cell_unless_skipped(sweep_dir, tmp_path, capsys):
    bad = next(sweep_dir.glob("none-b0-s0-*")) / "cell.json"
    bad.write_text("{truncated")
    assert main([str(sweep_dir), "--out", str(tmp_path / "a")]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"ablate-analyze: {bad}: corrupt run store file") and "--skip-corrupt" in error
    assert len(error.strip().splitlines()) == 1
    assert main([str(sweep_dir), "--out", str(tmp_path / "b"), "--reps", "50", "--skip-corrupt", "--no-plots"]) == 0
    assert f"corrupt: {bad}" in capsys.readouterr().out
    assert (tmp_path / "b" / "table_final_reward.md").exists()
    assert not list((tmp_path / "b").glob("*.png"))


def _varied_sweep(tmp_path):
    """The same grid at two router noise levels, plus a rerun of one level with another step count."""
    sweep_dir = tmp_path / "runs" / "noise"
    for noise in (0.0, 0.07):
        for seed in (0, 1):
            write_cell(sweep_dir, "none", 0.0, seed, backend={"router_noise": noise})
            write_cell(sweep_dir, "random", 0.25, seed, backend={"router_noise": noise})
    for seed in (0, 1):
        write_cell(sweep_dir, "none", 0.0, seed, backend={"router_noise": 0.0, "steps": 5})
    return sweep_dir


def test_varied_config_keys_are_columns_and_filters(tmp_path):
    sweep_dir = _varied_sweep(tmp_path)
    df = load_runs(sweep_dir)
    assert df.attrs["config_keys"] == ["backend.router_noise", "backend.steps"]
    assert sorted(df["backend.router_noise"].unique()) == [0.0, 0.07]
    assert "policy.name" not in df.columns and "tracking.mode" not in df.columns and "store_dir" not in df.columns
    kept = load_runs(sweep_dir, where={"backend.steps": STEPS})
    assert len(kept) == 8 and kept.attrs["config_keys"] == ["backend.router_noise"]
    assert kept.attrs["where"] == {"backend.steps": STEPS}
    one = load_runs(sweep_dir, where={"backend.steps": STEPS, "backend.router_noise": 0.07, "policy": "random"})
    assert len(one) == 2 and one.attrs["config_keys"] == []
    steps = load_runs(sweep_dir, per_step=True, where={"backend.steps": STEPS})
    assert "backend.router_noise" in steps.columns and len(steps) == 8 * STEPS
    with pytest.raises(ValueError, match="did you mean backend.steps"):
        load_runs(sweep_dir, where={"backend.stepz": 5})
    with pytest.raises(ValueError, match="no cell matches; backend.steps takes the values 20, 5 here"):
        load_runs(sweep_dir, where={"backend.steps": 7})


def test_cli_where_and_by_on_a_varied_sweep(tmp_path, capsys):
    sweep_dir = _varied_sweep(tmp_path)
    assert main([str(sweep_dir), "--no-plots", "--reps", "50", "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "arms: policy x budget x backend.router_noise x backend.steps" in printed
    assert main([str(sweep_dir), "--no-plots", "--reps", "50", "--out", str(tmp_path / "b"),
                 "--where", "backend.steps=20", "--by", "backend.router_noise"]) == 0
    printed = capsys.readouterr().out
    assert "arms: policy x budget x backend.router_noise; where backend.steps=20" in printed
    fx = pd.read_csv(tmp_path / "b" / "effects_final_reward.csv")
    assert sorted(fx["backend.router_noise"]) == [0.0, 0.07]
    # Leaving a varied key out of --by is an error that names it, in one line.
    assert main([str(sweep_dir), "--no-plots", "--out", str(tmp_path / "c"), "--by", "backend.steps"]) == 1
    error = capsys.readouterr().err
    assert "they differ in backend.router_noise" in error and len(error.strip().splitlines()) == 1


def test_mixed_schema_versions_warn_and_are_compared_only_within_a_version(tmp_path):
    sweep_dir = tmp_path / "mixed"
    for seed in (0, 1):
        write_cell(sweep_dir, "none", 0.0, seed, schema="1.0")
        write_cell(sweep_dir, "none", 0.0, seed, schema="1.1")
        write_cell(sweep_dir, "random", 0.5, seed, schema="1.1")
    with pytest.warns(MixedSchemaWarning, match=r"1.0 \(2 cells\), 1.1 \(4 cells\).*schema_version=1.1"):
        df = load_runs(sweep_dir)
    from ablate.analysis.tables import arm_keys, effects

    assert arm_keys(df) == ["schema_version"]
    fx = effects(df, reps=50)
    assert list(fx["schema_version"]) == ["1.1"] and fx["n_seeds"].tolist() == [2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_runs(sweep_dir, where={"schema_version": "1.1"})) == 4


def test_a_version_that_only_adds_keys_is_compared_with_the_one_it_extends(tmp_path):
    """A store of 1.2 cells resumed after the bump to 1.3 (which adds replay/replace_rate) is one sweep."""
    sweep_dir = tmp_path / "resumed"
    for seed in (0, 1):
        write_cell(sweep_dir, "none", 0.0, seed, schema="1.2")
        write_cell(sweep_dir, "random", 0.5, seed, schema="1.3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load_runs(sweep_dir)
    from ablate.analysis.tables import arm_keys, effects

    assert arm_keys(df) == [] and sorted(df["schema_version"]) == ["1.2", "1.2", "1.3", "1.3"]
    assert effects(df, reps=50)["n_seeds"].tolist() == [2]  # random(0.5) - none, paired across the versions


def test_cli_errors_are_one_line_from_a_real_process(tmp_path):
    for argv, expected in (
        (["nosuch", "--store", str(tmp_path)], "ablate-analyze: nosuch: no such sweep directory"),
        ([str(tmp_path), "--where", "x"], "where 'x': expected KEY=VALUE"),
    ):
        result = subprocess.run([sys.executable, "-m", "ablate.analysis", *argv], capture_output=True, text=True,
                                cwd=tmp_path)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from ablate.analysis.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("blocked", [("matplotlib",), ("scipy",), ("matplotlib", "scipy", "wandb_workspaces")])
def test_base_install_without_the_analysis_extra(sweep_dir, tmp_path, blocked):
    """matplotlib missing: tables without plots, saying so; scipy missing: a one-line error naming the extra."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=set(blocked)), str(sweep_dir),
                             "--out", str(out), "--reps", "50"], capture_output=True, text=True)
    assert "Traceback" not in result.stderr
    if "scipy" in blocked:
        assert result.returncode == 1
        assert result.stderr.strip().endswith("needs scipy, which is not installed: pip install 'ablate[analysis]'")
        assert len(result.stderr.strip().splitlines()) == 1
    else:
        assert result.returncode == 0, result.stderr
        assert "plots skipped: Plots needs matplotlib, which is not installed: pip install 'ablate[analysis]'" in result.stdout
        assert (out / "table_final_reward.md").exists() and not list(out.glob("*.png"))


def test_settings_of_a_named_regime_are_no_arm_keys_of_their_own(tmp_path):
    """backend=synthetic,synthetic_async varies backend.regime and, with it, backend.rollout_lag."""
    from ablate.analysis.sources import LoadedCell
    from ablate.analysis.varied import varied_config_keys

    def cell(regime, lag, noise):
        return LoadedCell(meta={}, config={"backend.regime": regime, "backend.rollout_lag": lag,
                                           "backend.router_noise": noise}, records=pd.DataFrame())

    cells = [cell(r, lag, n) for r, lag in (("default", 0), ("async", 2), ("lag1", 1)) for n in (0.0, 0.07)]
    assert varied_config_keys(cells) == (["backend.regime", "backend.router_noise"],
                                         {"backend.rollout_lag": "backend.regime"})
    # Two lags under one regime: the lag is an arm of its own.
    cells.append(cell("default", 2, 0.0))
    assert varied_config_keys(cells)[0] == ["backend.regime", "backend.rollout_lag", "backend.router_noise"]


def test_one_read_of_a_sweep_gives_both_frames_of_load_runs(sweep_dir):
    from ablate.analysis.load import read_sweep

    with pytest.warns(ExcludedCellsWarning, match="1 failed, 1 unfinished"):
        read = read_sweep(sweep_dir, where={"seed": 1})
    with pytest.warns(ExcludedCellsWarning):
        cells, steps = load_runs(sweep_dir, where={"seed": 1}), load_runs(sweep_dir, per_step=True, where={"seed": 1})
    for mine, theirs in ((read.cells_frame(), cells), (read.steps_frame(), steps)):
        pd.testing.assert_frame_equal(mine, theirs)
        assert mine.attrs == theirs.attrs
    assert set(cells["seed"]) == {1} and len(steps) == len(cells) * STEPS


def test_outcomes_come_from_a_summary_written_after_the_records_else_from_the_records(tmp_path):
    import os

    cell = write_cell(tmp_path / "sweep", "none", 0.0, 0)
    records, summary = cell / "records.parquet", cell / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "final_reward": 123.0}))
    os.utime(records, ns=(1_000_000_000, 1_000_000_000))
    os.utime(summary, ns=(2_000_000_000, 2_000_000_000))
    assert load_runs(tmp_path / "sweep")["final_reward"].iloc[0] == 123.0  # the runner's summary stands
    os.utime(records, ns=(3_000_000_000, 3_000_000_000))  # records replaced after their summary
    expected = cell_outcomes(_records("none", 0.0, 0))["final_reward"]
    assert load_runs(tmp_path / "sweep")["final_reward"].iloc[0] == pytest.approx(expected)
    summary.write_text(json.dumps({"final_reward": 123.0}))  # newer, but without every outcome
    assert load_runs(tmp_path / "sweep")["final_reward"].iloc[0] == pytest.approx(expected)
