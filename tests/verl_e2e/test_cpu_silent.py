"""A verl cell whose hook never installs fails at its first step with one line, on a real run, in either engine."""

from __future__ import annotations

import importlib.util

import pytest

from cpu_cells import cell_dir, needs_verl_runtime, run_ablate

needs_verl_runtime()
pytestmark = [pytest.mark.slow, pytest.mark.verl]

VEOMNI = pytest.mark.skipif(importlib.util.find_spec("veomni") is None,
                            reason="VeOmni is not installed here: build the environment with .ci/verl-env.sh")


@pytest.mark.parametrize("engine", ["megatron", pytest.param("veomni", marks=VEOMNI)])
def test_a_cell_whose_hook_never_installs_fails_in_one_line(tmp_path, assets, engine):
    from ablate.store import read_json

    store = tmp_path / "runs"
    done, seconds = run_ablate(store, assets, f"backend.engine={engine}", "policy=random", "budget=0.5", "seed=0",
                               "tracking.mode=disabled", "backend.overrides=['actor_rollout_ref.model.external_lib=null']")
    print(f"\nhook-less {engine} cell failed after {seconds:.0f} s wall")
    assert done.returncode == 1
    line = next(line for line in done.stderr.splitlines() if "failed after" in line)
    assert "step 1: the replay hook never installed in verl's actor" in line
    status = read_json(cell_dir(store / "adhoc", "random-b0.5-s0") / "status.json")
    assert status["status"] == "failed" and "the replay hook never installed" in status["error"]
