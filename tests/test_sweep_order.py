"""A sweep runs its cells seed by seed under every launcher, so a sweep stopped early can be analysed.

Each test runs the CLI as a user types it on a grid of four arms and three seeds, one cell at a
time, stops it with Ctrl-C (SIGINT to its process group) once the first seed's cells are complete,
and reads the run store: the first seed holds every arm, and no cell of the last seed has started.
Hydra's own order (one policy after another) would have run ``none`` at every seed first.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_launcher_faults import ray_dir  # noqa: F401  (a fixture: a private Ray temp dir)

from ablate.store import read_json

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

ARMS = ("none", "full", "random-b0.5", "mismatch-b0.5")
GRID = ["-m", "backend=noop", "policy=none,full,random,mismatch", "budget=0.5", "seed=0,1,2", "backend.steps=3",
        "backend.step_seconds=0.2", "tracking.mode=disabled", "sweep=order"]


def one_worker(kind: str, ray_temp) -> list[str]:
    return {
        "in_process": [],
        "local": ["hydra/launcher=local", "hydra.launcher.n_jobs=1"],
        "submitit_local": ["hydra/launcher=submitit_local", "hydra.launcher.n_jobs=1", "hydra.launcher.timeout_min=5"],
        "ray": ["hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=1",
                f"+hydra.launcher.ray.init._temp_dir={ray_temp}", "+hydra.launcher.ray.init.include_dashboard=false"],
    }[kind]


def statuses(sweep_dir) -> dict[str, str]:
    """Each started cell's status by its name (``random-b0.5-s1``)."""
    found = {}
    for cell in sweep_dir.iterdir() if sweep_dir.exists() else ():
        try:
            found[cell.name.rsplit("-", 1)[0]] = read_json(cell / "status.json")["status"]
        except (OSError, ValueError, KeyError):
            continue  # not a cell, or not started yet
    return found


@pytest.mark.parametrize("kind", ["in_process", "local", "submitit_local", "ray"])
def test_a_sweep_stopped_after_its_first_seed_holds_every_arm_of_it(tmp_path, kind, ray_dir):  # noqa: F811
    if kind == "ray":
        pytest.importorskip("ray", reason="ray is not installed")
    store = tmp_path / "runs"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-m", "ablate", *GRID, *one_worker(kind, ray_dir), f"store_dir={store}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    first_seed = {f"{arm}-s0" for arm in ARMS}
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        found = statuses(store / "order")
        if all(found.get(name) == "complete" for name in first_seed):
            os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
            break
        time.sleep(0.1)
    out, _ = process.communicate(timeout=120)
    found = statuses(store / "order")
    assert {name for name in first_seed if found.get(name) == "complete"} == first_seed, (found, out[-3000:])
    # One cell at a time, stopped as the first seed completed: no cell of the last seed had started.
    assert not [name for name in found if name.endswith("-s2")], (found, out[-3000:])
    assert process.returncode == 130, out[-3000:]
