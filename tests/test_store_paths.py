"""Issue 18, defect 1: a sweep runs whatever characters its store path (or working directory) holds.

Each case is the command of the issue, as a user types it: ``cd`` into a directory whose name
holds characters of Hydra's override grammar or a non-ASCII letter, and run a sweep with the
default ``store_dir`` (``runs``, relative to that directory).
"""

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ablate.store import read_json

pytestmark = pytest.mark.slow

#: "p (copy)" as the issue writes it, then every other character it names, in one directory name.
AWKWARD_DIRS = ["p (copy)", "l'été, k=v [1]"]


def ablate_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "ablate", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", AWKWARD_DIRS)
def test_a_grid_sweep_runs_in_a_directory_with_any_name(tmp_path, name):
    cwd = tmp_path / name
    done = ablate_in(cwd, "-m", "backend=noop", "policy=none", "seed=0,1", "tracking.mode=disabled")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "HydraException" not in done.stderr
    cells = sorted((cwd / "runs" / "adhoc").glob("*/status.json"))
    assert [p.parent.name.rsplit("-", 1)[0] for p in cells] == ["none-s0", "none-s1"]
    assert all(read_json(p)["status"] == "complete" for p in cells)
    assert f"results under {cwd / 'runs' / 'adhoc'}" in done.stdout


def test_an_optuna_study_runs_in_a_directory_with_any_name_and_leaves_no_running_trial(tmp_path):
    cwd = tmp_path / AWKWARD_DIRS[1]
    done = ablate_in(cwd, "-m", "hydra/sweeper=ablate_optuna", "sweep=study", "backend=noop", "backend.steps=3",
                     "policy=random", "budget=interval(0.1, 0.5)", "hydra.sweeper.n_trials=2", "tracking.mode=disabled",
                     "tracking.progress=false")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    journal = cwd / "runs" / "study" / "optuna.journal"
    trials = optuna.load_study(study_name="study", storage=JournalStorage(JournalFileBackend(str(journal)))).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert len(list((cwd / "runs" / "study").glob("*/summary.json"))) == 2
