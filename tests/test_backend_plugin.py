"""A backend of your own: one object with its own config class, found by entry point, typed, checked, run.

The backend's package is written into ``tmp_path`` as a user would install it: its module and a
``dist-info`` folder whose ``entry_points.txt`` names the object in group ``ablate.backends``
(what pip writes for ``[project.entry-points."ablate.backends"]``). Nothing of ablate is edited:
the registry finds it, Hydra composes ``backend=counter`` with its dataclass as the schema, its
``check()`` refuses a bad value before the run store is touched, and a cell runs with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ablate import backends
from ablate.store import CellState, inspect_cell, read_records
from synthetic_configs import compose_config

#: A backend module as a user writes it: its config class, its run, its one object.
COUNTER_MODULE = '''
from dataclasses import dataclass

from ablate.backends import Backend, BackendConfig
from ablate.config import is_number, require, require_int


@dataclass
class CounterConfig(BackendConfig):
    name: str = "counter"
    steps: int = 2
    #: Reward gained per step, up to 1.
    gain: float = 0.25

    def check(self) -> None:
        require_int("backend.steps", self.steps, 1)
        require(is_number(self.gain) and 0 < self.gain <= 1, "backend.gain", self.gain, "a reward gain in (0, 1]")


def run(cell, context):
    cfg = BACKEND.config_of(cell)
    for step in range(cfg.steps):
        context.log_step(step, {"train/reward": min(1.0, cfg.gain * (step + 1)),
                                "replay/budget_requested": cell.budget})


BACKEND = Backend(name="counter", config=CounterConfig, run=run)
'''


#: A backend that logs a word where a number belongs, at its second step.
WORDY_MODULE = '''
from ablate.backends import Backend, BackendConfig


def run(cell, context):
    context.log_step(0, {"train/reward": 0.5})
    context.log_step(1, {"train/reward": "high"})


BACKEND = Backend(name="wordy", config=BackendConfig, run=run)
'''


@pytest.fixture()
def installed(tmp_path):
    """A folder holding the backends' modules and their distribution's metadata, as site-packages would."""
    site = tmp_path / "site"
    (site / "counter_backend-0.1.dist-info").mkdir(parents=True)
    (site / "counter_backend.py").write_text(COUNTER_MODULE)
    (site / "wordy_backend.py").write_text(WORDY_MODULE)
    (site / "counter_backend-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: counter-backend\nVersion: 0.1\n")
    (site / "counter_backend-0.1.dist-info" / "entry_points.txt").write_text(
        "[ablate.backends]\ncounter = counter_backend:BACKEND\nwordy = wordy_backend:BACKEND\n")
    return site


@pytest.fixture()
def registered(installed, monkeypatch):
    """The folder on this process's path, the registry read again and the schemas registered; undone after."""
    from hydra.core.config_store import ConfigStore

    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    monkeypatch.setattr(backends, "_entry_points_loaded", False)
    backends.register_backend_schemas()
    yield installed
    sys.modules.pop("counter_backend", None)
    repo = ConfigStore.instance().repo
    repo.pop("base_counter.yaml", None)
    repo["backend"].pop("counter.yaml", None)


def test_an_installed_backend_composes_with_its_own_typed_config_and_runs_a_cell(registered, tmp_path):
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    from ablate.compose import ConfigError, cell_from_config
    from ablate.runner import run_cell

    assert "counter" in backends.backend_names()
    cfg = compose_config("backend=counter", "policy=none", "backend.gain=0.5", "tracking.mode=disabled",
                         store=tmp_path / "runs", tiny=False)
    cell = cell_from_config(cfg)
    assert type(cell.backend).__name__ == "CounterConfig" and cell.backend.gain == 0.5
    summary = run_cell(cfg)
    assert summary["final_reward"] == 1.0
    with pytest.raises(ConfigError, match=r"^backend.gain=1.5: expected a reward gain in \(0, 1\]$"):
        cell_from_config(compose_config("backend=counter", "policy=none", "backend.gain=1.5", tiny=False))
    with pytest.raises(ConfigCompositionException) as typed:
        compose_config("backend=counter", "policy=none", "backend.steps=two", tiny=False)
    assert isinstance(typed.value.__cause__, ValidationError)
    with pytest.raises(ConfigCompositionException, match="Could not override 'backend.topk'"):
        compose_config("backend=counter", "policy=none", "backend.topk=2", tiny=False)


@pytest.mark.slow
def test_the_cli_runs_an_installed_backend_and_refuses_its_bad_setting_before_writing(installed, tmp_path):
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def ablate(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ablate", "backend=counter", "policy=none", "tracking.mode=disabled",
                   f"store_dir={tmp_path / 'runs'}", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    refused = ablate("backend.gain=1.5")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.strip().splitlines() == ["ablate: backend.gain=1.5: expected a reward gain in (0, 1]"]
    assert not (tmp_path / "runs" / "adhoc").exists()  # only Hydra's own folder (runs/_hydra) is made

    done = ablate("backend.gain=0.4", "backend.steps=3")
    assert done.returncode == 0, done.stderr
    (cell_dir,) = (tmp_path / "runs" / "adhoc").glob("none-*")
    assert inspect_cell(cell_dir).state is CellState.COMPLETE
    assert json.loads((cell_dir / "cell.json").read_text())["backend"] == "counter"
    assert read_records(cell_dir)["train/reward"].round(6).tolist() == [0.4, 0.8, 1.0]

    helped = subprocess.run([sys.executable, "-m", "ablate", "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300)
    assert "backend: counter, noop, synthetic" in helped.stdout


def test_a_value_that_is_not_a_number_fails_its_cell_recorded_with_the_error(installed, tmp_path):
    """The issue's backend logs {"train/reward": "high"}: its cell stayed 'running' with no error and no records."""
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    base = [sys.executable, "-m", "ablate", "backend=wordy", "policy=none", "tracking.mode=disabled",
            f"store_dir={tmp_path / 'runs'}"]
    done = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""  # no schema warning beside the line: the value ends the cell first
    (line,) = done.stderr.strip().splitlines()
    assert "step 1: train/reward='high' (a str) logged by backend=wordy: expected a number" in line
    assert line.endswith("(its traceback is in status.json)")
    (cell_dir,) = (tmp_path / "runs" / "adhoc").glob("none-*")
    status = json.loads((cell_dir / "status.json").read_text())
    assert status["status"] == "failed" and "train/reward='high'" in status["error"] and status["traceback"]
    assert read_records(cell_dir)["train/reward"].tolist() == [0.5]  # the step before it is kept

    sweep = subprocess.run([*base[:3], "-m", *base[3:], "seed=0,1", "sweep=words"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=300)
    assert sweep.returncode == 1, sweep.stdout + sweep.stderr
    failed = [line for line in sweep.stdout.splitlines() if line.startswith("  failed: ")]
    assert len(failed) == 2 and all("expected a number" in line for line in failed)
    assert "no live worker holds it" not in sweep.stdout


def documented_backend() -> str:
    """The replaying backend of docs/writing-a-backend.md, as the page prints it."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    block = page.split("```python\n# my_package/toy_backend.py\n", 1)[1]
    return block.split("```", 1)[0]


@pytest.mark.slow
def test_the_documented_backend_drives_the_replay_session_in_a_sweep(tmp_path):
    """The page's backend, installed as a package: a real multirun of it replays each budget exactly."""
    source = documented_backend()
    assert len(source.strip().splitlines()) < 40
    site = tmp_path / "site"
    (site / "toy_backend-0.1.dist-info").mkdir(parents=True)
    (site / "toy_backend.py").write_text(source)
    (site / "toy_backend-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    (site / "toy_backend-0.1.dist-info" / "entry_points.txt").write_text("[ablate.backends]\ntoy = toy_backend:BACKEND\n")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ablate", "-m", "backend=toy", "policy=random,mismatch,full",
                           "budget=0.1,0.5", "seed=0", "tracking.mode=disabled", f"store_dir={tmp_path / 'runs'}",
                           "sweep=toy"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    cells = sorted((tmp_path / "runs" / "toy").glob("*-*"))
    assert len(cells) == 5  # full runs once per seed, at its own budget
    for cell_dir in cells:
        identity = json.loads((cell_dir / "cell.json").read_text())
        records = read_records(cell_dir)
        valid = records["replay/valid_routes"]
        assert (records["replay/replayed_routes"] == (identity["budget"] * valid + 0.5).apply(int)).all()
        assert records["routing/route_mismatch_rate"].gt(0).all()
        if identity["policy"] == "full":
            assert records["routing/residual_mismatch_rate"].eq(0).all()
