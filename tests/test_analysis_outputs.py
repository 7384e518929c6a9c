"""ablate-analyze on a sweep the CLI ran: outputs written whole or not at all, and the cells a table
drops for a NaN, infinite or missing outcome counted and named."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ablate.analysis.cli import main as analyze

SEEDS = "0,1,2,3,4,5"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """12 noop cells: none and random at budget 0.5, six seeds, run by the CLI."""
    root = tmp_path_factory.mktemp("analysis-outputs")
    command = [sys.executable, "-m", "ablate", "-m", "backend=noop", "policy=none,random", "budget=0.5",
               f"seed={SEEDS}", "backend.steps=5", "backend.reward=0.5", "tracking.mode=disabled",
               f"store_dir={root / 'runs'}"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "runs" / "adhoc"


def cell(sweep: Path, name: str) -> Path:
    (found,) = sweep.glob(f"{name}-*")
    return found


@pytest.mark.slow
def test_cells_without_a_finite_outcome_are_counted_and_named(sweep, tmp_path):
    copy = tmp_path / "adhoc"
    subprocess.run(["cp", "-a", str(sweep), str(copy)], check=True)
    # Three cells as a diverged run, an overflowing one and a backend that never logged the reward leave them.
    for name, reward in (("random-b0.5-s2", math.nan), ("none-s4", math.inf), ("random-b0.5-s5", None)):
        records = cell(copy, name) / "records.parquet"
        frame = pd.read_parquet(records)
        if reward is None:
            frame = frame.drop(columns=["train/reward"])
        else:
            frame["train/reward"] = reward
        frame.to_parquet(records)

    done = subprocess.run([sys.executable, "-m", "ablate.analysis", str(copy), "--no-plots", "--reps", "100"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "seeds per arm: 6" in done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("dropped "))
    assert line.startswith("dropped 3 of 12 cells with no finite final_reward (NaN, inf or missing)")
    # cell_outcomes already turns an infinite reward into a NaN outcome.
    for shown in ("random-b0.5-s2 (final_reward=nan)", "none-s4 (final_reward=nan)", "random-b0.5-s5 (final_reward=nan)"):
        assert shown in line
    table = pd.read_csv(copy / "analysis" / "table_final_reward.csv")
    assert sorted(table["n_seeds"]) == [4, 5]  # what the line says: the arms lost those seeds


@pytest.mark.slow
def test_an_analysis_killed_while_writing_leaves_the_previous_outputs_whole(sweep, tmp_path, monkeypatch):
    out = tmp_path / "analysis"
    assert analyze([str(sweep), "--out", str(out), "--no-plots", "--reps", "100"]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert {"cells.csv", "table_final_reward.csv", "table_final_reward.parquet", "flags.md"} <= set(before)

    class Killed(BaseException):
        """Stands for SIGKILL: nothing after it runs."""

    real_to_csv = pd.DataFrame.to_csv

    def dies_halfway(frame, path=None, *args, **kwargs):
        Path(path).write_text(real_to_csv(frame, None, *args, **kwargs)[:10])
        raise Killed

    monkeypatch.setattr(pd.DataFrame, "to_csv", dies_halfway)
    with pytest.raises(Killed):
        analyze([str(sweep), "--out", str(out), "--no-plots", "--reps", "100"])
    after = {path.name: path.read_bytes() for path in out.iterdir()}
    assert after == before  # cells.csv is the previous one, whole; no temporary file is left beside it
