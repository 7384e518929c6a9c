"""From real Hydra multiruns over a key other than policy, budget and seed to the analysis (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from synthetic_configs import TINY

pytestmark = pytest.mark.slow


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900, cwd=cwd, env={**os.environ, "WANDB_MODE": "disabled"})
    assert result.returncode == 0, result.stdout[-3000:]
    return result


def test_a_sweep_over_router_noise_and_its_rerun_with_other_steps_are_analysable(tmp_path):
    shrink = [o for o in TINY if not o.startswith(("backend.steps", "backend.router_noise"))]
    # Seeds whose rollouts hold a route the trainer's float32 numerics flip even without router noise
    # (rare in a model this small): with none, replay at noise 0 would change nothing to compare.
    grid = ["-m", "policy=none,random", "budget=0.25", "seed=4,5", "backend.router_noise=0,0.07", "sweep=noise_test",
            "tracking.mode=disabled", *shrink]
    run(tmp_path, "-m", "ablate", *grid, "backend.steps=5")
    first = run(tmp_path, "-m", "ablate.analysis", "runs/noise_test", "--no-plots")
    assert "arms: policy x budget x backend.router_noise" in first.stdout
    fx = pd.read_csv(tmp_path / "runs/noise_test/analysis/effects_final_reward.csv")
    assert sorted(fx.loc[fx.effect == "budget", "backend.router_noise"]) == [0.0, 0.07]
    assert (fx["n_seeds"] == 2).all() and fx["ci_low"].isna().all()

    # The same sweep again with another step count: new cells beside the old ones.
    run(tmp_path, "-m", "ablate", *grid, "backend.steps=4")
    both = run(tmp_path, "-m", "ablate.analysis", "runs/noise_test", "--no-plots")
    assert "16 complete cells" in both.stdout and "x backend.steps" in both.stdout
    only = run(tmp_path, "-m", "ablate.analysis", "runs/noise_test", "--where", "backend.steps=4",
               "--out", "only4", "--outcome", "effective_budget_mean")
    assert "8 complete cells" in only.stdout and "where backend.steps=4" in only.stdout
    table = pd.read_csv(tmp_path / "only4/table_effective_budget_mean.csv")
    assert list(table.columns[:3]) == ["backend.router_noise", "policy", "budget"]
    effective = table.set_index(["backend.router_noise", "policy"])["mean"]
    assert effective[(0.0, "none")] == 0.0 and effective[(0.07, "none")] == 0.0
    # Router noise makes routes mismatch, so replay changes more of them at 0.07 than at 0.
    assert effective[(0.07, "random")] > effective[(0.0, "random")] > 0.0
    for plot in ("budget_response_effective_budget_mean", "effective_budget_effective_budget_mean", "steps"):
        assert (tmp_path / f"only4/{plot}.png").stat().st_size > 1000
