"""The run store's claims, its one classification of cells and its crash safety, with real processes."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pandas as pd
import psutil
import pytest

from ablate.analysis.load import CorruptCellError, ExcludedCellsWarning, load_runs
from ablate.cell import cell_id_of
from ablate.store import (
    STALE_AFTER,
    CellBusy,
    CellRecorder,
    CellState,
    Claim,
    StoreError,
    claim,
    claim_holder,
    held,
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


def test_a_claim_of_another_host_with_a_heartbeat_far_in_the_future_is_not_waited_for(tmp_path, caplog):
    """Issue 18: such a claim used to keep every worker waiting, silently, until its time + 2 minutes."""
    holder = {"host": "another-host", "pid": 77, "process_start": 1.0, "since": "2030-01-01T00:00:00+00:00"}
    assert claim_holder(write_claim(tmp_path, holder, age_seconds=-STALE_AFTER / 2)) is not None  # clock skew
    write_claim(tmp_path, holder, age_seconds=-3600)
    assert claim_holder(tmp_path / "claim.json") is None
    with caplog.at_level("WARNING", logger="ablate.store"):
        claim(tmp_path).release()
    assert "taking over the stale claim of pid 77 on another-host since 2030-01-01T00:00:00+00:00: its heartbeat " \
           "is 3600 s in the future" in caplog.text


def test_a_claim_that_is_a_directory_or_a_cell_path_that_is_a_file_is_named(tmp_path):
    """Issue 18: these used to be swallowed and tallied as "killed or crashed ... a rerun runs it"."""
    cell = cell_dir(tmp_path, "x")
    (cell / "claim.json").mkdir(parents=True)
    view = inspect_cell(cell)
    assert view.state is CellState.CORRUPT and view.detail.startswith(f"{cell / 'claim.json'}: a directory where")
    with pytest.raises(StoreError, match="a directory where the cell's claim file should be; remove it"):
        claim(cell)
    squatted = cell_dir(tmp_path, "y")
    squatted.write_text("")
    assert inspect_cell(squatted).state is CellState.CORRUPT
    assert "a file where the cell's directory should be" in inspect_cell(squatted).detail
    with pytest.raises(StoreError, match=f"{squatted}: a file where the cell's directory should be"):
        with held(squatted):
            pass


def test_a_read_only_store_is_one_error_naming_the_directory(tmp_path):
    from tests.test_store_edges import read_only_mount

    with read_only_mount(tmp_path) as mount:
        with pytest.raises(StoreError, match=r"runs/s/x: cannot create the cell's directory \(Read-only file system\)"):
            with held(mount / "runs" / "s" / "x"):
                pass


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


#: A cell's resolved config and its identity as the runner writes them; a cell's directory is
#: ``<name>-<cell_id[:8]>``.
CONFIG = {"backend": {"name": "noop"}, "policy": {"name": "random"}, "budget": 0.5, "seed": 0}
CELL_ID = cell_id_of(CONFIG)


def cell_dir(parent, name):
    return parent / f"{name}-{CELL_ID[:8]}"


def identity(directory, cell_id=CELL_ID):
    return {"cell_id": cell_id, "name": directory.name.rsplit("-", 1)[0], "backend": "noop", "policy": "random",
            "budget": 0.5, "seed": 0}


def recorded_cell(directory, state="complete", steps=3, cell_id=CELL_ID):
    recorder = CellRecorder(directory)
    recorder.start(identity(directory, cell_id), json.dumps(CONFIG), attempt=1)
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
    recorded_cell(cell_dir(tmp_path, "done"))
    assert inspect_cell(cell_dir(tmp_path, "done"), CELL_ID).state is CellState.COMPLETE
    assert inspect_cell(cell_dir(tmp_path, "done"), "other-id").state is CellState.NEW  # another config, same name
    recorded_cell(cell_dir(tmp_path, "failed"), "failed")
    view = inspect_cell(cell_dir(tmp_path, "failed"))
    assert (view.state, view.attempt, view.detail) == (CellState.FAILED, 1, "RuntimeError: boom")
    recorded_cell(cell_dir(tmp_path, "stopped"), "interrupted")
    assert inspect_cell(cell_dir(tmp_path, "stopped")).state is CellState.INTERRUPTED
    recorded_cell(cell_dir(tmp_path, "crashed"), "running")
    assert inspect_cell(cell_dir(tmp_path, "crashed")).state is CellState.UNFINISHED  # nobody holds it
    recorded_cell(cell_dir(tmp_path, "busy"), "running")
    write_claim(cell_dir(tmp_path, "busy"), {"host": socket.gethostname(), "pid": stranger.pid,
                                    "process_start": psutil.Process(stranger.pid).create_time()})
    view = inspect_cell(cell_dir(tmp_path, "busy"))
    assert view.state is CellState.RUNNING and f"pid {stranger.pid}" in view.detail
    assert [s for s in CellState if not s.rerun] == [CellState.RUNNING, CellState.COMPLETE]


DAMAGE = [
    (lambda d: (d / "status.json").write_text('{"status": "comp'), "status.json"),
    (lambda d: (d / "status.json").write_text('{"status": "paused"}'), "unknown status 'paused'"),
    (lambda d: (d / "cell.json").write_text("{"), "cell.json"),
    (lambda d: (d / "summary.json").unlink(), "summary.json: missing"),
    (lambda d: (d / "records.parquet").unlink(), "records.parquet: missing"),
    (lambda d: (d / "records.parquet").write_bytes((d / "records.parquet").read_bytes()[:-20]), "records.parquet"),
    # Issue 18's rough edges: each of these is a corrupt cell, named as such.
    (lambda d: rewrite(d / "cell.json", budget="abc"), "cell.json: corrupt cell identity: budget='abc'; expected a number"),
    (lambda d: rewrite(d / "cell.json", policy=3), "policy=3; expected a policy name"),
    (lambda d: rewrite(d / "cell.json", policy=None), "no policy; expected a policy name"),
    (lambda d: rewrite(d / "cell.json", name="y"), f"names the cell y-{CELL_ID[:8]}, not the directory x-{CELL_ID[:8]}"),
    (lambda d: (d / "config.yaml").unlink(), "config.yaml: missing"),
    (lambda d: rewrite(d / "status.json", status=5), "unknown status 5"),
    (lambda d: (d / "status.json").write_text("[]"), "expected a JSON object, found list"),
]


def rewrite(path, **fields):
    """Change (or, with None, drop) fields of a JSON file of the store."""
    data = {**read_json(path), **fields}
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


@pytest.mark.parametrize("damage, named", DAMAGE)
def test_a_damaged_complete_cell_is_corrupt_not_complete(tmp_path, damage, named):
    directory = cell_dir(tmp_path, "x")
    recorded_cell(directory)
    damage(directory)
    view = inspect_cell(directory, CELL_ID)
    assert view.state is CellState.CORRUPT and view.state.rerun
    assert named in view.detail


# --- the analysis reads the store through the same classification ----------------------------


@pytest.mark.parametrize("damage, named", DAMAGE)
def test_the_analysis_loader_reads_a_damaged_cell_as_corrupt_and_names_it(tmp_path, damage, named):
    sweep = tmp_path / "sweep"
    recorded_cell(cell_dir(sweep, "good"))
    damaged = cell_dir(sweep, "x")
    recorded_cell(damaged)
    damage(damaged)
    with pytest.raises(CorruptCellError, match=re.escape(named)):
        load_runs(sweep)
    with pytest.warns(ExcludedCellsWarning, match="1 corrupt"):
        frame = load_runs(sweep, on_corrupt="exclude")
    assert frame["name"].tolist() == ["good"] and frame["policy"].tolist() == ["random"]  # no spurious arm
    assert frame.attrs["excluded"] == {"failed": 0, "interrupted": 0, "running": 0, "unfinished": 0, "corrupt": 1}
    assert named in frame.attrs["corrupt_files"][0]


def test_the_analysis_loader_counts_every_state_as_the_store_classifies_it(tmp_path, stranger):
    sweep = tmp_path / "sweep"
    for label, state in [("done", "complete"), ("failed", "failed"), ("stopped", "interrupted"),
                         ("crashed", "running"), ("busy", "running")]:
        recorded_cell(cell_dir(sweep, label), state)
    write_claim(cell_dir(sweep, "busy"), {"host": socket.gethostname(), "pid": stranger.pid,
                                          "process_start": psutil.Process(stranger.pid).create_time()})
    cell_dir(sweep, "claimed").mkdir()  # claimed, then killed before its first write: no cell yet
    with pytest.warns(ExcludedCellsWarning, match="1 failed, 1 interrupted, 1 running, 1 unfinished"):
        frame = load_runs(sweep)
    assert frame["name"].tolist() == ["done"]
    assert frame.attrs["excluded"] == {"failed": 1, "interrupted": 1, "running": 1, "unfinished": 1, "corrupt": 0}


def test_the_recorder_returns_what_it_wrote(tmp_path):
    recorder = recorded_cell(tmp_path, "running", steps=4)
    assert recorder.records["step"].tolist() == [0, 1, 2, 3]
    recorder.complete({"final_reward": 1.0})
    pd.testing.assert_frame_equal(recorder.records, read_records(tmp_path))


def test_whatever_the_records_write_raises_the_cell_ends_failed_with_its_error(tmp_path, monkeypatch):
    """A write that fails with anything (not only an OSError) must not leave the cell 'running'."""
    recorder = recorded_cell(tmp_path, "running", steps=2)
    monkeypatch.setattr(recorder, "_write_parquet", lambda: (_ for _ in ()).throw(ValueError("cannot hold 'high'")))
    recorder.fail(TypeError("step 1: train/reward='high'"), "traceback")
    status = read_json(tmp_path / "status.json")
    assert (status["status"], status["error"]) == ("failed", "TypeError: step 1: train/reward='high'")
    assert read_records(tmp_path)["step"].tolist() == [0, 1]  # the step log keeps them


def test_a_new_attempt_replaces_the_previous_attempts_results_and_wandb_run(tmp_path):
    recorded_cell(tmp_path, "failed", steps=5)
    (tmp_path / "wandb" / "offline-run-1-abc").mkdir(parents=True)
    recorder = CellRecorder(tmp_path)
    recorder.start(identity(tmp_path), "a: 1\n", attempt=2)
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
