"""The run store's claims, its one classification of cells and its crash safety, with real processes."""

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pandas as pd
import psutil
import pytest

from ablate.store import (
    STALE_AFTER,
    CellBusy,
    CellRecorder,
    CellState,
    Claim,
    claim,
    claim_holder,
    inspect_cell,
    read_json,
    read_records,
)


def hold_claim(cell_dir):
    """A child process that takes the cell's claim and sleeps until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from ablate.store import claim
        claim(Path({str(cell_dir)!r}))
        print("held", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_live_claim_keeps_other_workers_out_and_a_dead_one_is_taken_over(tmp_path):
    child = hold_claim(tmp_path)
    try:
        with pytest.raises(CellBusy, match=f"pid {child.pid} on "):
            claim(tmp_path)
    finally:
        child.kill()
        child.wait()
    taken = claim(tmp_path)  # the holder died without cleaning up: its claim is stale
    assert json.loads((tmp_path / "claim.json").read_text())["pid"] != child.pid
    taken.release()
    assert not (tmp_path / "claim.json").exists()


def test_a_crash_mid_write_loses_only_the_cut_line(tmp_path):
    recorder = CellRecorder(tmp_path)
    recorder.start({"cell_id": "x"}, "a: 1\n", attempt=1)
    for step in range(3):
        recorder.record(step, {"train/reward": float(step)})
    with open(tmp_path / "records.jsonl", "a") as log:
        log.write('{"step": 3, "train/rew')  # the process died here
    assert read_records(tmp_path)["step"].tolist() == [0, 1, 2]
    assert read_json(tmp_path / "status.json")["status"] == "running"
    recorder.fail(RuntimeError("killed"), "traceback")
    assert read_records(tmp_path)["step"].tolist() == [0, 1, 2]  # the Parquet copy has them too
    assert read_json(tmp_path / "status.json")["status"] == "failed"


def test_a_corrupt_store_file_is_named(tmp_path):
    from ablate.store import StoreError

    (tmp_path / "status.json").write_text('{"status": "comp')
    with pytest.raises(StoreError, match=f"{tmp_path / 'status.json'}: corrupt run store file"):
        read_json(tmp_path / "status.json")
    (tmp_path / "records.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(StoreError, match=r"records.jsonl:2: corrupt step record"):
        read_records(tmp_path)


# --- claims: who holds a cell ---------------------------------------------------------------


def write_claim(cell_dir, holder, age_seconds=0.0):
    cell_dir.mkdir(parents=True, exist_ok=True)
    path = cell_dir / "claim.json"
    path.write_text(json.dumps(holder))
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture
def stranger():
    """A live process on this host that has nothing to do with ablate (its pid may be 'reused')."""
    child = subprocess.Popen(["sleep", "600"])
    yield child
    child.kill()
    child.wait()


def test_a_claim_whose_pid_now_belongs_to_another_process_is_stale(tmp_path, stranger):
    started = psutil.Process(stranger.pid).create_time()
    holder = {"host": socket.gethostname(), "pid": stranger.pid, "since": "2020-01-01T00:00:00+00:00"}
    # The pid is alive, but it is not the process that claimed the cell: that one started earlier.
    path = write_claim(tmp_path, {**holder, "process_start": started - 3600})
    assert claim_holder(path) is None
    taken = claim(tmp_path)
    assert read_json(path)["pid"] == os.getpid()
    taken.release()
    # The same pid with its own start time is the holder itself: alive, however old the heartbeat.
    path = write_claim(tmp_path, {**holder, "process_start": started}, age_seconds=30 * 86400)
    assert claim_holder(path)["pid"] == stranger.pid
    with pytest.raises(CellBusy):
        claim(tmp_path)


def test_a_claim_without_a_start_time_lives_by_its_heartbeat(tmp_path, stranger):
    """Claims written by an older ablate hold only host and pid: their age decides."""
    holder = {"host": socket.gethostname(), "pid": stranger.pid, "since": "2020-01-01T00:00:00+00:00"}
    assert claim_holder(write_claim(tmp_path, holder, age_seconds=STALE_AFTER / 2)) is not None
    assert claim_holder(write_claim(tmp_path, holder, age_seconds=30 * 86400)) is None


def test_claims_of_other_hosts_live_by_their_heartbeat(tmp_path):
    holder = {"host": "another-host", "pid": 1, "process_start": 1.0}
    assert claim_holder(write_claim(tmp_path, holder, age_seconds=STALE_AFTER / 2)) is not None
    assert claim_holder(write_claim(tmp_path, holder, age_seconds=STALE_AFTER * 2)) is None


def test_the_heartbeat_keeps_a_claim_fresh_without_steps(tmp_path):
    path = tmp_path / "claim.json"
    taken = claim(tmp_path)
    taken.release()
    taken = claim(tmp_path)
    old = time.time() - 1000
    os.utime(path, (old, old))
    beating = Claim(path, taken.identity, heartbeat_every=0.02)
    deadline = time.monotonic() + 10
    while path.stat().st_mtime <= old + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.stat().st_mtime > old + 1
    beating.release()
    taken.release()
    assert not path.exists()


# --- the one classification of a cell directory ---------------------------------------------


def recorded_cell(directory, state="complete", steps=3, cell_id="c1"):
    recorder = CellRecorder(directory)
    recorder.start({"cell_id": cell_id, "name": "x"}, "a: 1\n", attempt=1)
    for step in range(steps):
        recorder.record(step, {"train/reward": float(step)})
    if state == "complete":
        recorder.complete({"final_reward": 1.0})
    elif state == "failed":
        recorder.fail(RuntimeError("boom"), "traceback")
    elif state == "interrupted":
        recorder.fail(KeyboardInterrupt(), None, CellState.INTERRUPTED)
    return recorder


def test_every_state_of_a_cell_is_classified(tmp_path, stranger):
    assert inspect_cell(tmp_path / "never").state is CellState.NEW
    recorded_cell(tmp_path / "done")
    assert inspect_cell(tmp_path / "done", "c1").state is CellState.COMPLETE
    assert inspect_cell(tmp_path / "done", "other-id").state is CellState.NEW  # another config, same name
    recorded_cell(tmp_path / "failed", "failed")
    view = inspect_cell(tmp_path / "failed")
    assert (view.state, view.attempt, view.detail) == (CellState.FAILED, 1, "RuntimeError: boom")
    recorded_cell(tmp_path / "stopped", "interrupted")
    assert inspect_cell(tmp_path / "stopped").state is CellState.INTERRUPTED
    recorded_cell(tmp_path / "crashed", "running")
    assert inspect_cell(tmp_path / "crashed").state is CellState.UNFINISHED  # nobody holds it
    recorded_cell(tmp_path / "busy", "running")
    write_claim(tmp_path / "busy", {"host": socket.gethostname(), "pid": stranger.pid,
                                    "process_start": psutil.Process(stranger.pid).create_time()})
    view = inspect_cell(tmp_path / "busy")
    assert view.state is CellState.RUNNING and f"pid {stranger.pid}" in view.detail
    assert [s for s in CellState if not s.rerun] == [CellState.RUNNING, CellState.COMPLETE]


@pytest.mark.parametrize("damage, named", [
    (lambda d: (d / "status.json").write_text('{"status": "comp'), "status.json"),
    (lambda d: (d / "status.json").write_text('{"status": "paused"}'), "unknown status 'paused'"),
    (lambda d: (d / "cell.json").write_text("{"), "cell.json"),
    (lambda d: (d / "summary.json").unlink(), "summary.json: missing"),
    (lambda d: (d / "records.parquet").unlink(), "records.parquet: missing"),
    (lambda d: (d / "records.parquet").write_bytes((d / "records.parquet").read_bytes()[:-20]), "records.parquet"),
])
def test_a_damaged_complete_cell_is_corrupt_not_complete(tmp_path, damage, named):
    recorded_cell(tmp_path)
    damage(tmp_path)
    view = inspect_cell(tmp_path, "c1")
    assert view.state is CellState.CORRUPT and view.state.rerun
    assert named in view.detail


def test_the_recorder_returns_what_it_wrote(tmp_path):
    recorder = recorded_cell(tmp_path, "running", steps=4)
    assert recorder.records["step"].tolist() == [0, 1, 2, 3]
    recorder.complete({"final_reward": 1.0})
    pd.testing.assert_frame_equal(recorder.records, read_records(tmp_path))


def test_a_new_attempt_replaces_the_previous_attempts_results_and_wandb_run(tmp_path):
    recorded_cell(tmp_path, "failed", steps=5)
    (tmp_path / "wandb" / "offline-run-1-abc").mkdir(parents=True)
    recorder = CellRecorder(tmp_path)
    recorder.start({"cell_id": "c1"}, "a: 1\n", attempt=2)
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "records.parquet").exists()
    assert read_records(tmp_path).empty and read_json(tmp_path / "status.json")["attempt"] == 2


# --- a full disk ---------------------------------------------------------------------------


def no_tmp_files(directory):
    return [p.name for p in directory.rglob("*.tmp")] == []


def test_a_full_disk_while_closing_records_failed_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    recorder = recorded_cell(tmp_path, "running", steps=3)
    real_fsync = os.fsync

    def full_disk(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp") and "parquet" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        recorder.complete({"final_reward": 1.0})
    recorder.fail(OSError(errno.ENOSPC, "No space left on device"), "traceback")
    status = read_json(tmp_path / "status.json")
    assert status["status"] == "failed" and "No space left on device" in status["error"]
    assert no_tmp_files(tmp_path) and not (tmp_path / "summary.json").exists()
    assert read_records(tmp_path)["step"].tolist() == [0, 1, 2]  # the step log keeps every step
    assert inspect_cell(tmp_path).state.rerun
