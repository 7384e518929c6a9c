"""Rough edges of the run store (issues 18 and 37), through the command line as a user meets them."""

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ablate.store import read_json

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def read_only_mount(tmp_path):
    """A read-only 64 KiB tmpfs under ``tmp_path`` for the body of the ``with`` (skips where mounting is refused)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def ablate(cwd: Path, *args: str, module: str = "ablate") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_budgets_that_differ_past_six_digits_get_distinct_cell_names_and_table_rows(tmp_path):
    done = ablate(tmp_path, "-m", "backend=noop", "backend.steps=3", "policy=random",
                  "budget=0.999999999,0.9999999999999999,1.0", "seed=0", "tracking.mode=disabled")
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.parent.name.rsplit("-", 1)[0] for p in (tmp_path / "runs" / "adhoc").glob("*/cell.json"))
    assert names == ["random-b0.999999999-s0", "random-b0.9999999999999999-s0", "random-b1-s0"]
    analysed = ablate(tmp_path, "runs/adhoc", "--no-plots", "--reps", "50", "--out", "out", module="ablate.analysis")
    assert analysed.returncode == 0, analysed.stderr[-3000:]
    rows = [line for line in (tmp_path / "out" / "table_final_reward.md").read_text().splitlines()[2:]]
    budgets = [row.split("|")[2].strip() for row in rows]
    assert budgets == ["0.999999999", "0.9999999999999999", "1"]


def test_a_claim_that_is_a_directory_fails_its_cell_with_what_is_wrong(tmp_path):
    grid = ["-m", "backend=noop", "backend.steps=3", "policy=none", "seed=0,1", "tracking.mode=disabled"]
    assert ablate(tmp_path, *grid).returncode == 0
    (cell,) = (tmp_path / "runs" / "adhoc").glob("none-s1-*")
    (cell / "status.json").unlink()
    (cell / "claim.json").mkdir()
    done = ablate(tmp_path, *grid)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert (f"failed: none-s1: {cell / 'claim.json'}: a directory where the cell's claim file should be; remove it, "
            "then run again") in done.stdout
    assert "killed or crashed" not in done.stdout and "a rerun" not in done.stdout.split("failed: none-s1")[1]
    shutil.rmtree(cell / "claim.json")
    assert ablate(tmp_path, *grid).returncode == 0
    assert read_json(cell / "status.json")["status"] == "complete"


def test_a_read_only_store_ends_a_sweep_with_one_line(tmp_path):
    with read_only_mount(tmp_path) as mount:
        done = ablate(tmp_path, "-m", "backend=noop", "policy=none", "seed=0,1", "tracking.mode=disabled",
                      f"store_dir={mount / 'runs'}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ablate: {mount / 'runs'}") and "Read-only file system" in lines[0]


def test_a_read_only_store_ends_a_single_cell_with_one_line(tmp_path):
    # Hydra makes the run's own folder inside the store before the app starts: checked before that.
    with read_only_mount(tmp_path) as mount:
        done = ablate(tmp_path, "backend=noop", "policy=none", "seed=0", "tracking.mode=disabled",
                      f"store_dir={mount / 'runs'}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"ablate: {mount / 'runs'}: cannot create the run store (Read-only file system); "
                                   "expected a writable directory")


def test_an_analysis_into_a_read_only_folder_ends_with_one_line(tmp_path):
    assert ablate(tmp_path, "-m", "backend=noop", "backend.steps=3", "policy=none", "seed=0,1",
                  "tracking.mode=disabled").returncode == 0
    with read_only_mount(tmp_path) as mount:
        done = ablate(tmp_path, "runs/adhoc", "--no-plots", "--out", str(mount / "out"), module="ablate.analysis")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"ablate-analyze: {mount / 'out'}: cannot create the analysis output folder "
                                   "(Read-only file system); expected a writable directory")


#: A grid of noop cells: quick, and enough for a store with two arms of one policy.
NOOP_GRID = ["-m", "backend=noop", "backend.steps=3", "policy=random", "budget=0.25", "seed=0,1",
             "tracking.mode=disabled"]


@pytest.mark.parametrize(("field", "value", "true"), [("policy", "fisher", "random"), ("budget", 0.5, 0.25)])
def test_a_cell_json_that_names_another_arm_is_refused_by_the_analysis_and_rerun_by_the_sweep(tmp_path, field, value,
                                                                                             true):
    assert ablate(tmp_path, *NOOP_GRID).returncode == 0
    (cell,) = (tmp_path / "runs" / "adhoc").glob("random-b0.25-s0-*")
    identity = read_json(cell / "cell.json")
    (cell / "cell.json").write_text(json.dumps({**identity, field: value}))
    analysed = ablate(tmp_path, "runs/adhoc", "--no-plots", "--reps", "50", module="ablate.analysis")
    assert analysed.returncode == 1 and "Traceback" not in analysed.stderr
    where = cell.relative_to(tmp_path) / "cell.json"
    assert analysed.stderr.strip() == (f"ablate-analyze: {where}: corrupt cell identity: {field}={value!r}, but its "
                                       f"config.yaml says {true!r} (--skip-corrupt analyses the other cells)")
    again = ablate(tmp_path, *NOOP_GRID)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "sweep adhoc: 2 cells: 1 complete (skipped), 0 failed (rerun), 0 unfinished (rerun), 0 new, 1 damaged " \
           "(rerun)" in again.stdout + again.stderr
    assert read_json(cell / "cell.json")[field] == true and read_json(cell / "status.json")["attempt"] == 2


def test_a_complete_cell_whose_records_hold_no_row_is_refused_and_rerun(tmp_path):
    assert ablate(tmp_path, *NOOP_GRID).returncode == 0
    (cell,) = (tmp_path / "runs" / "adhoc").glob("random-b0.25-s1-*")
    records = pq.read_table(cell / "records.parquet")
    pq.write_table(pa.Table.from_batches([], schema=records.schema), cell / "records.parquet")
    analysed = ablate(tmp_path, "runs/adhoc", "--no-plots", "--reps", "50", module="ablate.analysis")
    assert analysed.returncode == 1
    assert analysed.stderr.strip() == (f"ablate-analyze: {cell.relative_to(tmp_path) / 'records.parquet'}: no step "
                                       "record, but the cell's status is 'complete' (--skip-corrupt analyses the "
                                       "other cells)")
    again = ablate(tmp_path, *NOOP_GRID)
    assert again.returncode == 0 and "1 damaged (rerun)" in again.stdout + again.stderr
    assert pq.read_table(cell / "records.parquet").num_rows == 3


def test_a_negative_zero_budget_is_the_cell_of_budget_zero(tmp_path):
    grid = ["-m", "backend=noop", "backend.steps=3", "policy=random", "budget=0,-0.0", "seed=0", "tracking.mode=disabled"]
    done = ablate(tmp_path, *grid)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sweep adhoc: 1 cells:" in done.stdout + done.stderr
    assert [p.parent.name.rsplit("-", 1)[0] for p in (tmp_path / "runs" / "adhoc").glob("*/cell.json")] == [
        "random-b0-s0"]
    alone = ablate(tmp_path, "backend=noop", "backend.steps=3", "policy=random", "budget=-0.0", "seed=0",
                   "tracking.mode=disabled")
    assert alone.returncode == 0 and "random-b0-s0" in alone.stdout and "already complete, skipped" in alone.stdout
