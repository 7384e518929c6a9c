"""Real Hydra multiruns of ablate's grid sweeper into a temporary run store."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from synthetic_configs import TINY

from ablate.store import read_json, read_records

pytestmark = pytest.mark.slow

SMOKE_CELLS = {f"{p}-s{s}" for p in ("none", "full") for s in (0, 1)} | {
    f"{p}-b{b}-s{s}" for p in ("random", "uniform", "fisher", "mismatch") for b in (0.1, 0.5) for s in (0, 1)
}


def ablate(store: Path, *args: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the app; ``.stdout`` holds both streams (Hydra logs to stdout, errors go to stderr)."""
    command = [sys.executable, "-m", "ablate", *args, f"store_dir={store}"]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          cwd=store.parent, env={**os.environ, **(env or {})})


def cells(sweep_dir: Path) -> dict[str, Path]:
    return {p.name.rsplit("-", 1)[0]: p for p in sweep_dir.iterdir() if not p.name.startswith("_")}


def smoke(store: Path, *extra: str) -> subprocess.CompletedProcess:
    shrink = [o for o in TINY if not o.startswith("backend.steps")]
    return ablate(store, "sweeps=smoke", "seed=0,1", "backend.steps=3", *shrink, "tracking.mode=disabled", *extra)


def check_smoke_store(sweep_dir: Path) -> None:
    found = cells(sweep_dir)
    assert set(found) == SMOKE_CELLS  # none/full once per seed, the rest once per budget and seed
    for directory in found.values():
        assert read_json(directory / "status.json")["status"] == "complete"
    replayed = {}
    for name, directory in found.items():
        records = read_records(directory)
        replayed[name] = records["replay/replayed_routes"].tolist()
    for budget in (0.1, 0.5):
        for seed in (0, 1):
            counts = {p: replayed[f"{p}-b{budget}-s{seed}"] for p in ("random", "uniform", "fisher", "mismatch")}
            assert len({tuple(c) for c in counts.values()}) == 1, counts  # budget-matched, step by step
    assert all(v == 0 for v in replayed["none-s0"]) and replayed["full-s0"][0] > replayed["random-b0.5-s0"][0]


def test_smoke_grid_in_process(tmp_path):
    store = tmp_path / "runs"
    result = smoke(store, "budget=0.1,0.5")  # a user's budget list never multiplies none/full
    assert result.returncode == 0, result.stdout[-3000:]
    assert "sweep smoke: 20 cells: 0 complete (skipped), 0 failed (rerun), 0 unfinished (rerun), 20 new" in result.stdout
    assert "sweep smoke: 20 complete, 0 failed, 0 skipped" in result.stdout
    assert "sweep smoke: 20 done, 0 running, 0 failed, 0 left" in result.stdout
    check_smoke_store(store / "smoke")
    # Started again: every cell is complete, none is rerun.
    again = smoke(store)
    assert again.returncode == 0
    assert "20 complete (skipped)" in again.stdout and "0 complete, 0 failed, 20 skipped" in again.stdout
    # From the real run store to the summary table and the plots.
    out = tmp_path / "analysis"
    analysis = subprocess.run([sys.executable, "-m", "ablate.analysis", str(store / "smoke"), "--out", str(out),
                               "--reps", "200"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert analysis.returncode == 0, analysis.stdout[-3000:]
    table = (out / "table_final_reward.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith(("| policy", "| :"))]
    arms = {tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows}
    assert arms == {("none", "0"), ("full", "1")} | {
        (p, b) for p in ("random", "uniform", "fisher", "mismatch") for b in ("0.1", "0.5")}
    assert len(rows) == 10
    for plot in ("budget_response_final_reward", "selection_effects_final_reward", "steps"):
        for suffix in (".png", ".svg"):
            assert (out / f"{plot}{suffix}").stat().st_size > 1000


def test_smoke_grid_with_joblib(tmp_path):
    store = tmp_path / "runs"
    result = smoke(store, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert result.returncode == 0, result.stdout[-3000:]
    # The launcher's own lines go to the sweep's launches.log, not the console (its progress bar's).
    launches = next((store / "smoke" / "_hydra").glob("multirun-*/launches.log")).read_text()
    assert "LocalLauncher is launching 20 jobs" in launches  # hydra/launcher=joblib is ablate's local pool
    assert "is launching" not in result.stdout
    workers = {read_json(d / "status.json")["pid"] for d in cells(store / "smoke").values()}
    assert len(workers) == 2  # n_jobs=2: two worker processes ran the 20 cells
    check_smoke_store(store / "smoke")


def test_failing_cell_is_isolated(tmp_path):
    store = tmp_path / "runs"
    result = ablate(store, "-m", "backend=noop", "backend.steps=3", "backend.fail_seeds=[1]", "backend.fail_at_step=1",
                    "policy=none,random", "budget=0.5", "seed=0,1,2", "sweep=fail", "tracking.mode=disabled")
    assert result.returncode == 1
    assert "sweep fail: 4 complete, 2 failed, 0 skipped" in result.stdout
    assert "failed: none-s1: PlannedFailure: noop backend: seed 1 is in fail_seeds=[1]" in result.stdout
    found = cells(store / "fail")
    assert {n for n, d in found.items() if read_json(d / "status.json")["status"] == "failed"} == {"none-s1", "random-b0.5-s1"}
    failed = read_json(found["none-s1"] / "status.json")
    assert "Traceback" in failed["traceback"] and read_records(found["none-s1"])["step"].tolist() == [0]
    # Rerun: complete cells are skipped, the failed ones run again (and fail again).
    again = ablate(store, "-m", "backend=noop", "backend.steps=3", "backend.fail_seeds=[1]", "backend.fail_at_step=1",
                   "policy=none,random", "budget=0.5", "seed=0,1,2", "sweep=fail", "tracking.mode=disabled")
    assert "6 cells: 4 complete (skipped), 2 failed (rerun), 0 unfinished (rerun), 0 new" in again.stdout
    assert read_json(found["none-s1"] / "status.json")["attempt"] == 2


def test_interrupted_sweep_resumes_without_rerunning_complete_cells(tmp_path):
    store = tmp_path / "runs"
    args = [sys.executable, "-m", "ablate", "-m", "policy=random,uniform", "budget=0.1,0.3,0.5", "seed=0", "sweep=kill",
            *TINY, "backend.steps=40", "tracking.mode=offline", f"store_dir={store}"]
    process = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    sweep_dir = store / "kill"
    deadline = time.monotonic() + 600
    def complete_cells():
        if not sweep_dir.exists():
            return {}
        return {n: d for n, d in cells(sweep_dir).items()
                if (d / "status.json").exists() and read_json(d / "status.json")["status"] == "complete"}
    while len(complete_cells()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # no cleanup runs: as hard as a crash gets
    process.wait()
    done = complete_cells()
    assert 2 <= len(done) < 6
    stamps = {n: (d / "records.parquet").stat().st_mtime_ns for n, d in done.items()}
    # Every file already written parses; an interrupted cell is left "running" with a dead claim.
    for directory in cells(sweep_dir).values():
        for name in ("cell.json", "status.json"):
            if (directory / name).exists():
                json.loads((directory / name).read_text())
        read_records(directory)
    result = subprocess.run(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"6 cells: {len(done)} complete (skipped)" in result.stdout
    assert f"sweep kill: {6 - len(done)} complete, 0 failed, {len(done)} skipped" in result.stdout
    for name, stamp in stamps.items():
        assert (cells(sweep_dir)[name] / "records.parquet").stat().st_mtime_ns == stamp  # not rerun
    for directory in cells(sweep_dir).values():
        assert read_json(directory / "status.json")["status"] == "complete"
        assert len(pd.read_parquet(directory / "records.parquet")) == 40


@pytest.mark.xdist_group("ray")  # with the launcher fault suite's Ray clusters, one at a time
def test_ray_launcher(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed")
    store = tmp_path / "runs"
    result = ablate(store, "-m", "backend=noop", "policy=none,random", "budget=0.1,0.5", "seed=0,1", "sweep=ray",
                    "tracking.mode=offline", "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                    env={"RAY_AUTH_MODE": "disabled"})
    assert result.returncode == 0, result.stdout[-3000:]
    assert "sweep ray: 6 complete, 0 failed, 0 skipped" in result.stdout
    found = cells(store / "ray")
    assert set(found) == {"none-s0", "none-s1", "random-b0.1-s0", "random-b0.1-s1", "random-b0.5-s0", "random-b0.5-s1"}
    from ablate.tracking import find_offline_runs, read_offline_run
    groups = {read_offline_run(find_offline_runs(d / "wandb")[0]).group for d in found.values()}
    assert groups == {"ray"}  # one W&B group whichever worker ran the cell


def test_submitit_local_launcher(tmp_path):
    store = tmp_path / "runs"
    result = ablate(store, "-m", "backend=noop", "policy=full,mismatch", "budget=0.25", "seed=0,1", "sweep=slurm",
                    "tracking.mode=disabled", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5")
    assert result.returncode == 0, result.stdout[-3000:]
    assert set(cells(store / "slurm")) == {"full-s0", "full-s1", "mismatch-b0.25-s0", "mismatch-b0.25-s1"}
