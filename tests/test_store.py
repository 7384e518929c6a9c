"""The run store's claims and crash safety, with real processes."""

import json
import subprocess
import sys
import textwrap

import pytest

from ablate.store import CellBusy, CellRecorder, claim, read_records, read_json


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
