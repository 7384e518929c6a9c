"""The fault suite: interrupts, kills, concurrent sweeps, reused pids and a full disk, on real processes.

Every case runs the real app (``python -m ablate``) on the ``noop`` backend, whose steps can be
slowed down (``backend.step_seconds``) so that a signal or a kill lands in the middle of a cell.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from ablate.store import CellState, inspect_cell, read_json, read_records
from ablate.tracking import find_offline_runs, read_offline_run
from disks import tmpfs


def command(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ablate", *args, f"store_dir={store}"]


def run(store: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(store, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, cwd=store.parent)


def start(store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(command(store, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=store.parent, start_new_session=True)


def wait_for(condition, timeout: float = 120.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def logged_steps(cell: Path) -> int:
    log = cell / "records.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def cell_dirs(sweep_directory: Path) -> list[Path]:
    """The cell directories of a sweep (each has its cell.json from the moment it is claimed)."""
    return sorted(p.parent for p in sweep_directory.glob("*/cell.json"))


def only_cell(store: Path, sweep: str = "adhoc") -> Path:
    (cell,) = cell_dirs(store / sweep)
    return cell


SLOW_CELL = ["backend=noop", "backend.steps=60", "backend.step_seconds=0.03", "policy=random", "budget=0.5"]


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_during_a_cell_records_it_interrupted_and_the_rerun_replaces_it(tmp_path, signum, status):
    store = tmp_path / "runs"
    process = start(store, *SLOW_CELL, "tracking.mode=offline")
    wait_for(lambda: store.exists() and cell_dirs(store / "adhoc") and logged_steps(only_cell(store)) >= 5,
             what="the cell's first steps")
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == status, out + err
    message = [line for line in err.splitlines() if line.strip()]
    assert len(message) == 1 and message[0].startswith(f"ablate: interrupted by {signal.Signals(signum).name}: ")
    assert "recorded as interrupted" in message[0] and "Traceback" not in out + err

    cell = only_cell(store)
    status_file = read_json(cell / "status.json")
    assert status_file["status"] == "interrupted" and status_file["attempt"] == 1
    kept = read_records(cell)["step"].tolist()
    assert len(kept) >= 5 and kept == list(range(len(kept)))  # the steps it logged are kept
    assert not (cell / "claim.json").exists()
    (first_run,) = find_offline_runs(cell / "wandb")
    first = read_offline_run(first_run)
    assert first.exit_code == status

    rerun = run(store, *SLOW_CELL, "tracking.mode=offline", timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    status_file = read_json(cell / "status.json")
    assert (status_file["status"], status_file["attempt"]) == ("complete", 2)
    assert read_records(cell)["step"].tolist() == list(range(60))
    (run_dir,) = find_offline_runs(cell / "wandb")  # one W&B run for the cell: the partial one is gone
    replaced = read_offline_run(run_dir)
    assert replaced.run_id == first.run_id == read_json(cell / "cell.json")["wandb_run_id"]
    assert replaced.complete and replaced.exit_code == 0 and len(replaced.history) == 60


def test_a_sweep_reruns_a_cell_whose_claim_holder_pid_was_reused(tmp_path):
    """Issue 14, defect 1: a live process with the holder's pid is not the holder."""
    store = tmp_path / "runs"
    cell_args = ["backend=noop", "backend.steps=3", "policy=random", "budget=0.1", "tracking.mode=disabled"]
    assert run(store, *cell_args).returncode == 0
    cell = only_cell(store)
    (cell / "summary.json").unlink()
    status = read_json(cell / "status.json")
    (cell / "status.json").write_text(json.dumps({**status, "status": "running"}))
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        (cell / "claim.json").write_text(json.dumps({"host": socket.gethostname(), "pid": stranger.pid,
                                                     "since": "2020-01-01T00:00:00+00:00"}))
        month_ago = time.time() - 30 * 86400
        os.utime(cell / "claim.json", (month_ago, month_ago))
        result = run(store, "-m", *cell_args)
    finally:
        stranger.kill()
        stranger.wait()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 unfinished (rerun)" in result.stdout and "sweep adhoc: 1 complete, 0 failed, 0 skipped" in result.stdout
    assert read_json(cell / "status.json")["status"] == "complete" and read_json(cell / "status.json")["attempt"] == 2


def test_every_bad_setting_fails_the_grid_before_anything_is_written(tmp_path):
    """Issue 14, defect 2: inside a -m grid too, where an unknown objective used to exit 0.

    Every bad value is checked in process by test_runner; these run the real grid sweeper.
    """
    store = tmp_path / "runs"
    for bad, named in [("objective=nope", "objective=nope"), ("policy.fisher.decay=1.5", "policy.fisher.decay=1.5"),
                       ("sweep=../escape", "sweep='../escape'"),
                       ("seed=0,9223372036854775807", "seed=9223372036854775807")]:  # issue 18, defect 8
        result = run(store, "-m", "backend=synthetic", "policy=fisher,random", "budget=0.1", "seed=0,1", bad,
                     "tracking.mode=disabled")
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line
        assert result.stderr.startswith(f"ablate: {named}") and "in the sweep job" in result.stderr
        assert not store.exists() and not (tmp_path / "escape").exists()


def test_an_empty_grid_is_one_line_and_repeated_values_are_said(tmp_path):
    store = tmp_path / "runs"
    grid = ["-m", "backend=noop", "backend.steps=2", "policy=random", "budget=0.1", "tracking.mode=disabled"]
    empty = run(store, *grid, "seed=range(0,0)")
    assert empty.returncode == 2 and "results under" not in empty.stdout
    assert [line for line in empty.stderr.splitlines() if line.strip()] == [
        "ablate: seed=range(0,0) gives no value: a grid with an empty sweep has no cells (expected at least one value)"]
    assert not store.exists() or not list(store.glob("*/*/cell.json"))

    repeated = run(store, *grid, "seed=0,0,1")
    assert repeated.returncode == 0, repeated.stderr
    assert "ablate: seed=0,0,1 lists 0 2 times: each cell runs once" in repeated.stderr
    assert "2 complete, 0 failed" in repeated.stdout


def test_two_arms_that_differ_in_a_backend_setting_get_two_wandb_names(tmp_path):
    store = tmp_path / "runs"
    done = run(store, "-m", "backend=noop", "backend.steps=2", "policy=random", "budget=0.1", "backend.reward=0.1,0.2",
               "sweep=arms", "tracking.mode=offline")
    assert done.returncode == 0, done.stderr
    names = sorted(read_offline_run(found).name for cell in cell_dirs(store / "arms")
                   for found in find_offline_runs(cell / "wandb"))
    assert names == ["random-b0.1-s0 backend.reward=0.1", "random-b0.1-s0 backend.reward=0.2"]


def test_a_full_disk_mid_cell_is_recorded_failed_and_rerun_once_there_is_room(tmp_path):
    # 96 KiB: room for a cell's files and a few hundred steps, then ENOSPC.
    with tmpfs(tmp_path / "disk", "96k", instead="test_store injects ENOSPC instead") as disk:
        store = disk / "runs"
        cell_args = ["backend=noop", "backend.steps=3000", "policy=none", "tracking.mode=disabled"]
        full = run(store, *cell_args)
        assert full.returncode == 1 and "No space left on device" in full.stderr
        cell = only_cell(store)
        status = read_json(cell / "status.json")
        assert status["status"] == "failed" and "No space left on device" in status["error"]
        assert [p.name for p in cell.rglob("*.tmp")] == []
        steps = read_records(cell)["step"].tolist()
        assert 0 < len(steps) < 3000 and steps == list(range(len(steps)))  # the steps on disk are readable
        assert inspect_cell(cell).state is CellState.FAILED

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        resumed = run(store, "-m", *cell_args)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "1 failed (rerun)" in resumed.stdout
        assert read_json(cell / "status.json")["attempt"] == 2 and len(read_records(cell)) == 3000


# --- slow: whole sweeps ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_disk_that_fills_mid_sweep_ends_with_the_tally_and_one_line_and_the_rerun_finishes(tmp_path):
    """Issue 28, defect 3: a 1 MiB tmpfs with 750 KB taken holds a few cells of this sweep, not eight."""
    with tmpfs(tmp_path / "disk", "1m") as mount:
        (mount / "filler").write_bytes(b"\0" * 750_000)
        store = mount / "runs"
        grid = ["-m", "backend=noop", "backend.steps=40", "policy=random", "budget=0.1,0.3,0.5,0.7", "seed=0,1",
                "sweep=full", "tracking.mode=offline"]
        full = run(store, *grid)
        assert full.returncode == 1, full.stdout + full.stderr
        assert "Traceback" not in full.stdout + full.stderr and "Logging error" not in full.stdout + full.stderr
        tally = [line for line in full.stdout.splitlines() if line.startswith("sweep full: ") and " skipped in " in line]
        assert len(tally) == 1 and "0 skipped" in tally[0]
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith("ablate: sweep full stopped: the disk is full (") and "run the same command again" in last
        states = {cell.name: inspect_cell(cell).state for cell in cell_dirs(store / "full")}
        assert CellState.RUNNING not in states.values() and CellState.UNFINISHED not in states.values()
        done = sum(state is CellState.COMPLETE for state in states.values())
        assert 0 < done < 8

        (mount / "filler").unlink()
        rerun = run(store, *grid)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert f"{8 - done} complete, 0 failed, {done} skipped" in rerun.stdout

GRID = ["-m", "backend=noop", "backend.steps=12", "backend.step_seconds=0.04", "policy=random,uniform",
        "budget=0.1,0.3,0.5", "seed=0", "sweep=faults", "tracking.mode=offline", "hydra.sweeper.progress_interval=0.2"]


def snapshot(sweep_dir: Path) -> dict[str, dict[str, int]]:
    """Modification times of every file of every complete cell."""
    return {cell.name: {str(p.relative_to(cell)): p.stat().st_mtime_ns for p in cell.rglob("*") if p.is_file()}
            for cell in cell_dirs(sweep_dir) if inspect_cell(cell).state is CellState.COMPLETE}


def check_every_file_reads(sweep_dir: Path) -> None:
    for cell in cell_dirs(sweep_dir):
        for name in ("cell.json", "status.json", "summary.json"):
            if (cell / name).exists():
                json.loads((cell / name).read_text())
        if (cell / "records.parquet").exists():
            pd.read_parquet(cell / "records.parquet")
        read_records(cell)
        if inspect_cell(cell).state is CellState.COMPLETE:
            # kill -9 mid-write leaves a temporary file no reader opens; the next claim of an
            # unfinished cell removes it, and a complete cell is never claimed again, so none may be there
            assert [p.name for p in cell.rglob("*.tmp")] == []


@pytest.mark.slow
def test_kill_9_at_random_points_never_rewrites_a_complete_cell_nor_corrupts_a_file(tmp_path):
    store = tmp_path / "runs"
    sweep_dir = store / "faults"
    rng = random.Random(14)
    complete: dict[str, dict[str, int]] = {}
    for trial in range(8):
        process = start(store, *GRID)
        time.sleep(rng.uniform(0.5, 6.0))  # start-up, planning, mid-cell, between cells, W&B closing
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        check_every_file_reads(sweep_dir)
        now_complete = snapshot(sweep_dir)
        for name, files in complete.items():
            assert {k: now_complete[name][k] for k in files} == files, f"trial {trial}: {name} was rewritten"
        complete = now_complete
    finished = run(store, *GRID, timeout=900)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    for name, files in complete.items():
        assert {k: snapshot(sweep_dir)[name][k] for k in files} == files
    cells = cell_dirs(sweep_dir)
    assert len(cells) == 6
    for cell in cells:
        assert inspect_cell(cell).state is CellState.COMPLETE
        assert read_records(cell)["step"].tolist() == list(range(12))
        (run_dir,) = find_offline_runs(cell / "wandb")  # one W&B run per cell, however often it was cut
        assert read_offline_run(run_dir).complete
        assert [p.name for p in cell.rglob("*.tmp")] == []  # every killed writer's leftovers were removed


@pytest.mark.slow
def test_two_sweeps_at_once_on_one_store_run_each_cell_once_and_report_no_failure(tmp_path):
    """Issue 14, defect 3: the first sweep used to exit 1 with 'failed: random-b0.5-s0: running'."""
    store = tmp_path / "runs"
    grid = ["-m", "backend=noop", "backend.steps=300", "backend.step_seconds=0.1", "policy=random",
            "budget=0.1,0.5", "seed=0", "sweep=c4", "tracking.mode=disabled", "hydra.sweeper.progress_interval=0.2"]
    first = start(store, *grid)
    wait_for(lambda: (store / "c4").exists() and any(logged_steps(c) for c in cell_dirs(store / "c4")),
             what="the first sweep's first step")
    second = run(store, *grid, timeout=600)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert second.returncode == 0, second.stdout + second.stderr
    assert "running elsewhere (waited for)" in second.stdout
    for cell in cell_dirs(store / "c4"):
        status = read_json(cell / "status.json")
        assert (status["status"], status["attempt"]) == ("complete", 1)  # each cell ran exactly once
    for output in (out, second.stdout):
        assert "sweep c4: 2 complete, 0 failed, 0 skipped" in output  # one ran here, one waited for


@pytest.mark.slow
def test_sigterm_stops_a_sweep_with_its_tally_and_the_rerun_resumes_it(tmp_path):
    store = tmp_path / "runs"
    process = start(store, *GRID)
    wait_for(lambda: (store / "faults").exists() and sum(
        inspect_cell(c).state is CellState.COMPLETE for c in cell_dirs(store / "faults")) >= 1, what="a complete cell")
    wait_for(lambda: any(inspect_cell(c).state is CellState.RUNNING and logged_steps(c)
                         for c in cell_dirs(store / "faults")), what="a running cell")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, out + err
    assert "interrupted: " in out and "ablate: sweep faults interrupted by SIGTERM" in err
    states = [inspect_cell(c).state for c in cell_dirs(store / "faults")]
    assert CellState.INTERRUPTED in states and CellState.RUNNING not in states
    resumed = run(store, *GRID, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 interrupted (rerun)" in resumed.stdout
    assert all(inspect_cell(c).state is CellState.COMPLETE for c in cell_dirs(store / "faults"))


def test_the_same_cell_in_two_stores_logs_to_two_wandb_runs(tmp_path):
    """A cell's W&B run id is drawn at its first attempt and kept in cell.json, never derived
    from the cell: the same cell run on another machine or after a wiped store must not resume
    (or be refused by) the first one's run."""
    from ablate.runner import wandb_run_id

    first, second = tmp_path / "a" / "cell", tmp_path / "b" / "cell"
    for store in ("a", "b"):
        assert run(tmp_path / store, "backend=noop", "backend.steps=2", "policy=none", "seed=0",
                   "tracking.mode=disabled").returncode == 0
    ids = [read_json(only_cell(tmp_path / store) / "cell.json")["wandb_run_id"] for store in ("a", "b")]
    assert ids[0] != ids[1] and all(len(i) == 16 for i in ids)
    assert wandb_run_id(only_cell(tmp_path / "a")) == ids[0]  # a later attempt keeps it
    assert wandb_run_id(first) != wandb_run_id(second)  # nothing kept yet: a fresh draw each


def test_a_seed_out_of_range_is_refused_before_the_cell_is_written(tmp_path):
    """Issue 18, defect 8: it used to write the cell, then fail in torch.manual_seed."""
    store = tmp_path / "runs"
    result = run(store, "backend=noop", "policy=none", "seed=9223372036854775807", "tracking.mode=disabled")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("ablate: seed=9223372036854775807: expected an integer in [0, 2147483647] "
                                     "(2**31 - 1, the largest seed every backend's generators take)")
    assert not store.exists() or not list(store.glob("*/*/cell.json"))
