"""The worked example, as a user meets it: examples/margin_policy installed into a fresh venv.

Nothing of the test's own interpreter is reused: a new venv gets torch (first, pinned), ablate
and the example package from their folders with pip, and then the commands a user types run a
joblib sweep of ``margin`` beside ``random`` (two worker processes, which find the policy through
its entry point alone) and analyse it. The verl router-level tests run ``margin`` wherever it is
installed (``.ci/verl-env.sh`` installs it into ``.venv-verl``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from synthetic_configs import TINY

REPO = Path(__file__).resolve().parents[1]
#: What a wheel of ablate is built from (copied, so that building leaves nothing in the checkout).
SOURCES = ("ablate", "conf", "sweeps", "hydra_plugins", "examples", "pyproject.toml", "README.md")


def run(command: list[str], cwd: Path, timeout: float = 2400) -> subprocess.CompletedProcess:
    """One command; installing ablate's dependencies into an empty venv takes minutes."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_margin_installs_into_a_fresh_venv_runs_in_a_joblib_sweep_and_is_analysed_in_its_own_colour(tmp_path):
    source = tmp_path / "src"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        elif path.exists():
            shutil.copy2(path, source / name)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], tmp_path)
    run([python, "-m", "pip", "install", "-q", f"{source}[analysis,launchers]", str(source / "examples" / "margin_policy")],
        tmp_path)

    work = tmp_path / "work"
    work.mkdir()
    sweep = run([str(venv / "bin" / "ablate"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                 "policy=random,margin", "budget=0.25", "seed=0,1,2", "sweep=margin_demo", "tracking.mode=disabled",
                 *TINY], work)
    launches = "".join(log.read_text() for log in (work / "runs" / "margin_demo" / "_hydra").glob("multirun-*/launches.log"))
    assert "LocalLauncher is launching 6 jobs" in launches  # hydra/launcher=joblib is ablate's local pool, logged there by the wheel's config
    assert "sweep margin_demo: 6 complete, 0 failed, 0 skipped" in sweep.stdout, sweep.stdout[-3000:]
    cells = sorted((work / "runs" / "margin_demo").glob("margin-b0.25-s*"))
    assert len(cells) == 3
    for cell in cells:
        assert json.loads((cell / "status.json").read_text())["status"] == "complete"

    out = work / "analysis"
    run([str(venv / "bin" / "ablate-analyze"), "margin_demo", "--out", str(out), "--reps", "200"], work)
    table = (out / "table_final_reward.csv").read_text()
    assert "margin" in table and "random" in table
    assert "margin" in (out / "effects_final_reward.csv").read_text()  # margin against random, paired by seed
    colour = run([python, "-c", "from ablate.analysis.plots import policy_color\n"
                  "from ablate.policies import policy_look\n"
                  "builtin = {policy_look(n).color for n in ('none', 'full', 'random', 'uniform', 'fisher', 'mismatch')}\n"
                  "c = policy_color('margin', ['random', 'margin'])\n"
                  "assert c not in builtin, c\nprint(c)"], work).stdout.strip().lower()
    figure = (out / "budget_response_final_reward.svg").read_text().lower()
    assert colour in figure, colour
