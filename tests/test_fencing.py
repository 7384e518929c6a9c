"""Issue 18, defects 2 and 3: a worker that lost its claim writes nothing; a dead writer's temporary files go.

The fast tests drive the store's claim and recorder directly; the slow ones are the issue's
reproductions on real processes (another hostname through ``unshare --uts``, ``kill -STOP``,
``kill -9`` the moment a temporary file appears).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ablate.store import CellRecorder, CellState, ClaimLost, claim, held, inspect_cell, read_json

# --- fast: the fence ------------------------------------------------------------------------


def take_over(cell_dir: Path) -> dict:
    """What a worker on another host does to a claim it found stale: replace it with its own."""
    other = {"host": "elsewhere", "pid": 4242, "process_start": 1.0, "since": "2026-01-01T00:00:00+00:00"}
    (cell_dir / "claim.json").write_text(json.dumps(other))
    return other


def test_a_recorder_whose_claim_was_taken_over_writes_nothing_and_says_who_holds_it(tmp_path):
    cell_dir = tmp_path / "random-b0.5-s0-abcdef12"
    with held(cell_dir) as mine:
        recorder = CellRecorder(cell_dir, mine)
        recorder.start({"cell_id": "abc"}, "seed: 0\n", attempt=1)
        recorder.record(0, {"train/reward": 1.0})
        take_over(cell_dir)
        before = {p.name: p.read_bytes() for p in cell_dir.iterdir() if p.is_file()}
        with pytest.raises(ClaimLost, match=r"random-b0.5-s0-abcdef12: this worker \(pid \d+ on .*\) lost its claim on "
                                            r"the cell, now held by pid 4242 on elsewhere since 2026-01-01"):
            recorder.complete({"final_reward": 1.0})
        recorder.fail(RuntimeError("late"), None)  # recording the failure is fenced too
        recorder.fail(KeyboardInterrupt(), None, CellState.INTERRUPTED)
        after = {p.name: p.read_bytes() for p in cell_dir.iterdir() if p.is_file()}
        assert after == before and "records.parquet" not in after and "summary.json" not in after
        assert mine.lost
    assert read_json(cell_dir / "claim.json")["host"] == "elsewhere"  # release leaves the other's claim


def test_the_heartbeat_stops_at_a_lost_claim_and_the_next_step_is_refused(tmp_path):
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    mine = claim(cell_dir)
    mine.release()
    mine = type(mine)(cell_dir / "claim.json", mine.identity, heartbeat_every=0.05)
    (cell_dir / "claim.json").write_text(json.dumps(mine.identity))
    recorder = CellRecorder(cell_dir, mine)
    recorder.start({"cell_id": "abc"}, "seed: 0\n", attempt=1)
    take_over(cell_dir)
    aged = time.time() - 300
    os.utime(cell_dir / "claim.json", (aged, aged))
    deadline = time.monotonic() + 10
    while not mine.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mine.lost
    assert abs((cell_dir / "claim.json").stat().st_mtime - aged) < 1  # the other's claim was not touched
    with pytest.raises(ClaimLost):
        recorder.record(0, {"train/reward": 1.0})
    mine.release()


def test_whoever_takes_a_cell_over_removes_the_temporary_files_a_dead_writer_left(tmp_path):
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    left = [cell_dir / ".records.parquet.999999.1.tmp", cell_dir / ".cell.json.999999.2.tmp"]
    for tmp in left:
        tmp.write_bytes(b"half")
    (cell_dir / "keep.txt").write_text("not a temporary file")
    with held(cell_dir):
        assert not any(tmp.exists() for tmp in left)
    assert (cell_dir / "keep.txt").exists()


# --- slow: the reproductions on real processes ---------------------------------------

NOOP = ["backend=noop", "policy=random", "budget=0.5", "tracking.mode=disabled"]


def ablate_command(store: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ablate", *NOOP, *args, f"store_dir={store}"]


def only_cell(store: Path) -> Path:
    found = sorted(p.parent for p in (store / "adhoc").glob("*/cell.json"))
    assert len(found) == 1, found
    return found[0]


def wait_for(condition, timeout: float = 120.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def logged_steps(store: Path) -> int:
    cells = list((store / "adhoc").glob("*/records.jsonl")) if (store / "adhoc").exists() else []
    return len(cells[0].read_text().splitlines()) if cells else 0


def unshare_prefix() -> list[str]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    prefix = ["unshare", "--uts"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow a UTS namespace (unshare --uts)")
    return prefix


@pytest.mark.slow
def test_a_worker_paused_past_the_stale_limit_backs_off_and_leaves_the_other_workers_cell_intact(tmp_path):
    """Defect 2 as the issue writes it: another hostname, kill -STOP, the claim aged 5 minutes, a rerun to
    completion, kill -CONT."""
    store = tmp_path / "runs"
    steps = ["backend.steps=40", "backend.step_seconds=0.1"]
    inner = " ".join(f"'{a}'" for a in ablate_command(store, *steps))
    first = subprocess.Popen([*unshare_prefix(), "sh", "-c", f"hostname paused-host && exec {inner}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: logged_steps(store) >= 3, what="the first worker's first steps")
        os.killpg(first.pid, signal.SIGSTOP)
        cell = only_cell(store)
        assert read_json(cell / "claim.json")["host"] == "paused-host"
        aged = time.time() - 300
        os.utime(cell / "claim.json", (aged, aged))

        second = subprocess.run(ablate_command(store, *steps), capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-3000:]
        status = read_json(cell / "status.json")
        assert status["status"] == "complete" and status["attempt"] == 2
        files = ("status.json", "records.parquet", "summary.json", "cell.json", "config.yaml", "records.jsonl")
        result = {name: (cell / name).read_bytes() for name in files}
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)

    assert first.returncode == 1, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "lost its claim on the cell" in lines[0] and "stops without writing" in lines[0], err
    assert "Traceback" not in err
    assert {name: (cell / name).read_bytes() for name in files} == result  # attempt 2 stands, whole
    assert inspect_cell(cell).state is CellState.COMPLETE
    assert not list(cell.glob(".*.tmp")) and not (cell / "claim.json").exists()


@pytest.mark.slow
def test_kill_9_during_the_records_write_leaves_no_temporary_file_after_the_rerun(tmp_path):
    """Defect 3 as the issue writes it: SIGKILL the moment ``.records.parquet.*.tmp`` appears, then rerun."""
    store = tmp_path / "runs"
    cell_args = ["backend.steps=200000"]
    process = subprocess.Popen(ablate_command(store, *cell_args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (store / "adhoc").exists() and list((store / "adhoc").glob("*/cell.json")),
                 what="the cell's directory")
        cell = only_cell(store)
        wait_for(lambda: next(cell.glob(".records.parquet.*.tmp"), None) is not None or process.poll() is not None,
                 timeout=600, what="the temporary Parquet file")
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    left = list(cell.glob(".*.tmp"))
    if not left:
        pytest.skip("the write ended before the kill landed: nothing to clean")
    assert inspect_cell(cell).state is CellState.UNFINISHED

    rerun = subprocess.run(ablate_command(store, *cell_args), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert inspect_cell(cell).state is CellState.COMPLETE
    assert not list(cell.glob(".*.tmp"))
