"""A small verl CPU grid: interrupted in the middle of a cell, resumed, read by ablate-analyze.

The grid (none, random) x seeds 0, 1 shares its sweep with the policy multirun of
test_cpu_cells, whose seed-0 cells are complete: the grid must skip them. A SIGINT while its
first new cell runs must end main_ppo, Ray and every worker (checked on the process tree) and
leave that cell recorded interrupted with its logged steps; a rerun replaces it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cpu_cells import CELLS, PROBE_OVERRIDES, ablate_command, cell_dir, needs_verl_runtime, run_ablate

needs_verl_runtime()
pytestmark = [pytest.mark.slow, pytest.mark.verl]

GRID = ("-m", "policy=none,random", "budget=0.5", "seed=0,1", "sweep=cpu", "tracking.mode=offline", *PROBE_OVERRIDES)


def logged_steps(cell) -> int:
    log = cell / "records.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_grid_interrupted_then_resumed_and_analyzed(policy_store, assets):
    from ablate.store import read_json, read_records

    sweep = policy_store / "cpu"
    before = {name: (cell_dir(sweep, name) / "records.parquet").stat().st_mtime_ns
              for name in (CELLS["none"], CELLS["random"])}
    process = subprocess.Popen(ablate_command(policy_store, assets, *GRID), cwd=policy_store.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    deadline = time.monotonic() + 900
    while not list(sweep.glob("none-s1-*")) or logged_steps(cell_dir(sweep, "none-s1")) < 1:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
        time.sleep(1)
    main_ppo = next(child for child in psutil.Process(process.pid).children(recursive=True)
                    if "verl.trainer.main_ppo" in " ".join(child.cmdline()))
    tree = [main_ppo, *main_ppo.children(recursive=True)]  # main_ppo, Ray's GCS, raylet and every worker
    names = sorted({child.name() for child in tree})
    print(f"\nprocess tree of the running cell: {len(tree)} processes ({', '.join(names)})")
    commands = [" ".join(child.cmdline()) for child in tree]
    assert any("raylet" in command for command in commands) and any("ray::" in command for command in commands)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-4000:]
    cell = cell_dir(sweep, "none-s1")
    survivors = [child for child in tree if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    print(f"after SIGINT: {len(survivors)} of them alive")
    assert not survivors, [(child.pid, child.name()) for child in survivors]
    status = read_json(cell / "status.json")
    assert status["status"] == "interrupted"
    steps = logged_steps(cell)
    assert steps >= 1

    done, seconds = run_ablate(policy_store, assets, *GRID)
    print(f"resumed grid (2 new cells, 2 skipped): {seconds:.0f} s wall")
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert "sweep cpu: 2 complete, 0 failed, 2 skipped" in done.stdout + done.stderr
    for name, stamp in before.items():
        assert (cell_dir(sweep, name) / "records.parquet").stat().st_mtime_ns == stamp  # complete cells are not rerun
    for name in ("none-s1", "random-b0.5-s1"):
        assert read_json(cell_dir(sweep, name) / "status.json")["status"] == "complete"
        assert len(read_records(cell_dir(sweep, name))) == 3
    assert read_json(cell / "status.json")["attempt"] == 2

    analyzed = subprocess.run([sys.executable, "-m", "ablate.analysis", str(sweep), "--reps", "200"],
                              capture_output=True, text=True, timeout=600)
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    for policy in ("none", "random", "full", "fisher", "mismatch", "uniform"):
        assert policy in analyzed.stdout
