"""The VeOmni engine (FSDP2) as complete verl cells on the CPU, with every guarantee of the Megatron cells.

One multirun runs ``none``, ``full`` and ``random`` at budget 0.5 (seed 0) with ``backend.engine=veomni``
through verl's real ``main_ppo``: Ray, verl's VeOmni actor with R3 on two FSDP2 ranks over gloo, the CPU
rollout with noisy routers, the worker hook in the VeOmni seam. Every cell scores the probes
``none``, ``full`` and ``random@0.5`` on every step. SIGTERM ends a running cell with everything it
started; a cell whose hook never installs fails at its first step (``test_cpu_silent.py``, both engines).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import yaml

from cpu_cells import BUDGET, PROBES, STEPS, ablate_command, cell_dir, check_complete_with_every_key, needs_verl_runtime

needs_verl_runtime()
pytest.importorskip("veomni", reason="VeOmni is not installed here: build the environment with .ci/verl-env.sh")
pytestmark = [pytest.mark.slow, pytest.mark.verl]

VEOMNI = ("backend.engine=veomni",)
POLICIES = ("none", "full", "random")
CELLS = {"none": "none-s0", "full": "full-s0", "random": f"random-b{BUDGET}-s0"}


def records(store, policy):
    from ablate.store import read_records

    return read_records(cell_dir(store / "cpu-veomni", CELLS[policy]))


def test_every_cell_completes_with_every_key_from_the_store_and_the_wandb_run(veomni_store):
    store, _ = veomni_store
    for policy in POLICIES:
        cell = cell_dir(store / "cpu-veomni", CELLS[policy])
        assert yaml.safe_load((cell / "config.yaml").read_text())["backend"]["engine"] == "veomni"
        check_complete_with_every_key(cell, policy)


def test_verls_printed_config_runs_the_veomni_engine_with_r3(veomni_store):
    _, output = veomni_store
    assert "'strategy': 'veomni'" in output
    assert "VeOmniEngineWithLMHead" in output or "veomni" in output.lower()
    assert "Apply data parallel to the model: fsdp2." in output  # VeOmni's own log of its FSDP2 build


def test_replayed_routes_are_the_budgets_count_of_the_recorded_routes(veomni_store):
    from ablate.budget import count_for

    store, _ = veomni_store
    for policy in POLICIES:
        frame = records(store, policy)
        budget = {"none": 0.0, "full": 1.0}.get(policy, BUDGET)
        assert (frame["replay/valid_routes"] > 0).all(), policy
        expected = [count_for(budget, int(valid)) for valid in frame["replay/valid_routes"]]
        assert frame["replay/replayed_routes"].astype(int).tolist() == expected, policy
        assert frame["replay/budget_requested"].tolist() == [budget] * STEPS, policy


def test_routes_disagree_and_replay_fixes_them(veomni_store):
    store, _ = veomni_store
    none, full, random = (records(store, policy) for policy in POLICIES)
    assert (none["routing/route_mismatch_rate"] > 0).all()
    assert (none["routing/residual_mismatch_rate"] == none["routing/route_mismatch_rate"]).all()
    assert (full["routing/residual_mismatch_rate"] == 0).all()
    assert (full["replay/override_rate"] > 0).all()
    assert full["mismatch/kl_k3"].mean() < none["mismatch/kl_k3"].mean()
    assert (random["routing/residual_mismatch_rate"] < random["routing/route_mismatch_rate"]).all()


def test_probes_with_the_cells_mask_reproduce_its_keys_exactly(veomni_store):
    from ablate.diagnostics import SCHEMA
    from ablate.diagnostics.schema import PROBE_KEYS, probe_key

    store, _ = veomni_store
    mismatch = [key for key in SCHEMA if key.startswith("mismatch/")]
    for policy in POLICIES:
        frame = records(store, policy)
        missing = [probe_key(probe, key) for probe in PROBES for key in PROBE_KEYS if probe_key(probe, key) not in frame]
        assert not missing, (policy, missing)
    for policy in ("none", "full"):
        frame = records(store, policy)
        for key in (*mismatch, "replay/budget_realized"):
            assert frame[probe_key(policy, key)].tolist() == frame[key].tolist(), (policy, key)
    random = records(store, "random")
    probe = f"random@{BUDGET}"
    assert random[probe_key(probe, "replay/budget_realized")].tolist() == random["replay/budget_realized"].tolist()
    assert random[probe_key(probe, "mismatch/kl_k3")].tolist() != random["mismatch/kl_k3"].tolist()


def test_sigterm_ends_a_veomni_cell_with_everything_it_started(tmp_path, assets):
    """SIGTERM once both FSDP2 ranks of verl's VeOmni actor are up: main_ppo, Ray and every worker end,
    the cell is recorded interrupted."""
    from ablate.store import read_json

    store = tmp_path / "runs"
    process = subprocess.Popen(ablate_command(store, assets, *VEOMNI, "policy=random", "budget=0.5", "seed=0",
                                              "tracking.mode=disabled"),
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    deadline, tree = time.monotonic() + 900, []
    while sum("WorkerDict" in " ".join(child.cmdline()) for child in tree if child.is_running()) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
        time.sleep(1)
        try:
            tree = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
    time.sleep(5)  # the ranks build VeOmni's model and join their gloo group
    tree = psutil.Process(process.pid).children(recursive=True)
    commands = [" ".join(child.cmdline()) for child in tree if child.is_running()]
    print(f"\nprocess tree of the running VeOmni cell: {len(tree)} processes")
    assert any("verl.trainer.main_ppo" in command for command in commands)
    assert any("raylet" in command for command in commands)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 143, output[-4000:]
    survivors = [child for child in tree if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, [(child.pid, child.name()) for child in survivors]
    assert read_json(cell_dir(store / "adhoc", "random-b0.5-s0") / "status.json")["status"] == "interrupted"
