"""The W&B tracker and the offline run reader, against real wandb 0.31 (no mocks of wandb).

Only failures are injected (a closed port for the server, a raising ``log``); every run here is
a real offline run written by ``wandb-core`` and read back from its ``.wandb`` file.
"""

from __future__ import annotations

import math
import shutil
import socket
import time
from pathlib import Path

import psutil
import pytest
from ablate.tracking import (
    WandbTracker,
    find_offline_runs,
    history_frame,
    read_offline_run,
    start_tracker,
)

CONFIG = {
    "policy": "fisher",
    "budget": 0.25,
    "seed": 3,
    "backend": "synthetic",
    "schema_version": 1,
    "fisher/tau": 0.0,
    "train.lr": 1e-3,
    "tags_list": [1, 2],
}


@pytest.fixture(autouse=True)
def isolated_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep wandb away from the user's home, account and server."""
    home = tmp_path / "wandb_home"
    for name, sub in [
        ("WANDB_DIR", "dir"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ]:
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(name, str(home / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def start(
    cell_dir: Path, name: str = "fisher-b0.25-s3", mode: str = "offline", **overrides: object
) -> WandbTracker:
    options = dict(
        mode=mode,
        project="ablate",
        entity=None,
        tags=["smoke", "fisher"],
        run_dir=cell_dir,
        group="smoke",
        job_type="fisher",
        name=name,
        config=CONFIG,
        init_timeout=30.0,
    )
    options.update(overrides)
    return start_tracker(**options)


def metrics_at(step: int) -> dict[str, float]:
    return {
        "train/reward": 0.1 * step,
        "routing/route_mismatch_rate": 1.0 / (step + 1),
        "replay/valid_routes": 100 + step,
    }


def run_cell(cell_dir: Path, name: str, steps: int = 5) -> WandbTracker:
    tracker = start(cell_dir, name)
    for step in range(steps):
        tracker.log(metrics_at(step), step=step)
    tracker.finish(summary={"final_reward": 0.4}, exit_code=0)
    return tracker


def test_offline_runs_back_to_back_read_back_whole(tmp_path: Path) -> None:
    first = run_cell(tmp_path / "cell-a", "fisher-b0.25-s3")
    second = run_cell(tmp_path / "cell-b", "random-b0.25-s3", steps=3)

    assert first.warnings == [] and second.warnings == []
    assert first.run_path.parent == tmp_path / "cell-a" / "wandb"
    assert find_offline_runs(tmp_path) == sorted([first.run_path, second.run_path])

    run = read_offline_run(first.run_path)
    assert run.complete and run.exit_code == 0 and run.problem is None
    assert (run.name, run.group, run.job_type, run.project) == (
        "fisher-b0.25-s3",
        "smoke",
        "fisher",
        "ablate",
    )
    assert run.tags == ["smoke", "fisher"]
    assert run.config == CONFIG
    assert [row["step"] for row in run.history] == list(range(5))
    for row in run.history:
        assert row == {"step": row["step"], **metrics_at(row["step"])}
    assert run.summary["final_reward"] == 0.4
    assert run.summary["train/reward"] == pytest.approx(0.4)  # W&B's last-value summary

    frame = history_frame(run)
    assert list(frame.columns) == ["step", *sorted(metrics_at(0))]
    assert frame["replay/valid_routes"].tolist() == [100, 101, 102, 103, 104]

    other = read_offline_run(next(second.run_path.glob("run-*.wandb")))  # the file itself
    assert other.complete and other.name == "random-b0.25-s3" and len(other.history) == 3
    assert other.run_id != run.run_id


def test_finish_is_idempotent_and_records_the_exit_code(tmp_path: Path) -> None:
    tracker = start(tmp_path)
    tracker.log({"train/loss": float("nan")}, step=0)
    tracker.finish(exit_code=1)
    tracker.finish(exit_code=0)
    tracker.log({"train/loss": 1.0}, step=1)  # after finish: dropped, not an error

    run = read_offline_run(tracker.run_path)
    assert run.complete and run.exit_code == 1
    assert len(run.history) == 1 and math.isnan(run.history[0]["train/loss"])


def test_history_frame_merges_logs_of_the_same_step(tmp_path: Path) -> None:
    tracker = start(tmp_path)
    tracker.log({"train/reward": 1.0}, step=0)
    tracker.log({"train/loss": 2.0}, step=0)
    tracker.log({"train/reward": 3.0, "train/loss": 4.0}, step=1)
    tracker.finish()
    frame = history_frame(read_offline_run(tracker.run_path))
    assert frame.to_dict("records") == [
        {"step": 0, "train/loss": 2.0, "train/reward": 1.0},
        {"step": 1, "train/loss": 4.0, "train/reward": 3.0},
    ]


def test_records_longer_than_a_block_survive_the_framing(tmp_path: Path) -> None:
    long_text = "x" * 100_000  # longer than wandb's 32 KiB blocks: one record split over several
    tracker = start(tmp_path, config={"note": long_text})
    tracker.log({"train/reward": 1.0}, step=0)
    tracker.finish()
    run = read_offline_run(tracker.run_path)
    assert run.config["note"] == long_text and run.complete


def test_truncated_log_gives_the_whole_records_and_is_incomplete(tmp_path: Path) -> None:
    tracker = start(tmp_path / "cell")
    for step in range(40):
        tracker.log(metrics_at(step), step=step)
    tracker.finish()
    assert tracker.warnings == []
    full = read_offline_run(tracker.run_path)
    data = full.path.read_bytes()

    cut = tmp_path / "cut.wandb"
    seen = []  # (rows read, complete) per cut, in order of cut size
    for size in range(7, len(data), max(1, len(data) // 60)):
        cut.write_bytes(data[:size])
        run = read_offline_run(cut)
        assert run.complete == (run.exit_code is not None)
        assert run.history == full.history[: len(run.history)]  # a prefix, never garbage
        seen.append((len(run.history), run.complete))
    assert seen[0] == (0, False)
    assert any(0 < rows < 40 and not complete for rows, complete in seen)
    assert [complete for _, complete in seen] == sorted(complete for _, complete in seen)

    cut.write_bytes(data[: len(data) // 2 + 3])  # most likely mid-chunk, surely before the exit
    run = read_offline_run(cut)
    assert not run.complete and run.exit_code is None and 0 < len(run.history) < 40


def test_the_exit_record_is_found_in_process_where_wandbs_reader_finds_it(tmp_path: Path) -> None:
    """The tracker's wait after finish reads the log's framing itself (a process per cell cost more than the
    run): at every length a log passes through as it is written, it must agree with wandb's own reader."""
    from ablate.tracking.transaction_log import exit_record_found

    short = run_cell(tmp_path / "short", "fisher-b0.25-s3", steps=3)
    long = start(tmp_path / "long", config={"note": "x" * 100_000})  # one record over four 32 KiB blocks
    long.log({"train/reward": 1.0}, step=0)
    long.finish()
    cut = tmp_path / "cut.wandb"
    for tracker in (short, long):
        data = read_offline_run(tracker.run_path).path.read_bytes()
        assert exit_record_found(read_offline_run(tracker.run_path).path) is True
        answers = []
        for size in sorted({0, 3, 7, *range(7, len(data), max(1, len(data) // 40)), len(data) - 1}):
            cut.write_bytes(data[:size])
            found = exit_record_found(cut)
            assert found == (read_offline_run(cut).complete if size >= 7 else False), size
            answers.append(found)
        assert answers[0] is False and answers == sorted(answers)  # once there, it stays in every longer prefix
    other = tmp_path / "other.wandb"
    other.write_bytes(b":W&B\xe1\xbe\x01" + data[7:])  # a format version this reader does not know
    assert exit_record_found(other) is None


def test_a_corrupt_chunk_is_skipped_and_named(tmp_path: Path) -> None:
    tracker = run_cell(tmp_path / "cell", "fisher-b0.25-s3", steps=10)
    data = bytearray(read_offline_run(tracker.run_path).path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt = tmp_path / "corrupt.wandb"
    corrupt.write_bytes(bytes(data))

    run = read_offline_run(corrupt)
    assert "checksum mismatch" in run.problem
    whole = read_offline_run(tracker.run_path).history
    assert len(run.history) < len(whole) and all(row in whole for row in run.history)


def test_a_file_that_is_not_a_wandb_log_is_rejected_by_path(tmp_path: Path) -> None:
    garbage = tmp_path / "run-garbage.wandb"
    garbage.write_bytes(b"this is not a W&B transaction log at all")
    with pytest.raises(ValueError, match="not a readable W&B transaction log") as error:
        read_offline_run(garbage)
    assert str(garbage) in str(error.value)

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"expected exactly one \*\.wandb file"):
        read_offline_run(empty_dir)


def test_disabled_mode_writes_nothing(tmp_path: Path) -> None:
    cell_dir = tmp_path / "cell"
    cell_dir.mkdir()
    tracker = start(cell_dir, mode="disabled")
    tracker.log(metrics_at(0), step=0)
    tracker.finish(summary={"final_reward": 0.4})
    assert tracker.run_path is None and tracker.warnings == [] and not tracker.active
    assert list(cell_dir.iterdir()) == []


def test_unknown_mode_and_reserved_key_are_caller_bugs(tmp_path: Path) -> None:
    expected = r"mode='dryrun': expected one of offline, online, disabled"
    with pytest.raises(ValueError, match=expected):
        start(tmp_path, mode="dryrun")
    tracker = start(tmp_path, mode="disabled")
    with pytest.raises(ValueError, match="reserved key 'step'"):
        tracker.log({"step": 3}, step=3)


def test_an_unreachable_server_is_bounded_then_the_cell_logs_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setattr("ablate.tracking.wandb_run._server_unreachable", [])

    began = time.monotonic()
    tracker = start(tmp_path / "a", mode="online", init_timeout=2.0, run_id="unreachable1")
    tracker.log(metrics_at(0), step=0)
    tracker.finish(summary={"final_reward": 0.4})
    first = time.monotonic() - began
    assert first < 30  # init_timeout bounds the wait (wandb retries within it)
    assert len(tracker.warnings) == 1
    assert "W&B online start failed within init_timeout=2 s" in tracker.warnings[0]
    assert "logs offline; upload it later with wandb sync" in tracker.warnings[0]
    run = read_offline_run(tracker.run_path)  # the cell's W&B run is kept, offline, same id
    assert run.complete and run.run_id == "unreachable1" and [row["step"] for row in run.history] == [0]
    assert tracker.run_path.name.startswith("offline-run-")

    # Later cells of the process do not wait for the server again.
    began = time.monotonic()
    second = start(tmp_path / "b", mode="online", init_timeout=2.0)
    second.finish()
    assert time.monotonic() - began < first
    assert "unreachable earlier in this process" in second.warnings[0]
    assert read_offline_run(second.run_path).complete


def test_a_failing_log_stops_logging_but_still_closes_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = start(tmp_path)
    tracker.log(metrics_at(0), step=0)

    def broken_log(*args: object, **kwargs: object) -> None:
        raise ConnectionError("wandb-core went away")

    monkeypatch.setattr(tracker._run, "log", broken_log)
    tracker.log(metrics_at(1), step=1)
    tracker.log(metrics_at(2), step=2)
    tracker.finish(summary={"final_reward": 0.4})

    assert len(tracker.warnings) == 1
    assert "step 1" in tracker.warnings[0] and "wandb-core went away" in tracker.warnings[0]
    assert "wandb-core went away" in caplog.text
    run = read_offline_run(tracker.run_path)
    assert run.complete and [row["step"] for row in run.history] == [0]


def test_a_failing_finish_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = start(tmp_path)
    real_finish = tracker._run.finish

    def broken_finish(*args: object, **kwargs: object) -> None:
        real_finish(*args, **kwargs)  # close the real run so it does not leak into later tests
        raise TimeoutError("Timed out finishing run.")

    monkeypatch.setattr(tracker._run, "finish", broken_finish)
    tracker.finish()
    tracker.finish()
    assert len(tracker.warnings) == 1 and "W&B finish failed" in tracker.warnings[0]


def test_find_offline_runs_ignores_unrelated_files(tmp_path: Path) -> None:
    tracker = run_cell(tmp_path / "sweep" / "cell", "fisher-b0.25-s3", steps=1)
    (tmp_path / "sweep" / "notes.txt").write_text("not a run")
    copy = tmp_path / "archive" / "run-copy"
    shutil.copytree(tracker.run_path, copy)
    assert find_offline_runs(tmp_path) == sorted([copy, tracker.run_path])


def test_a_log_that_never_completes_is_a_bounded_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ablate.tracking.wandb_run.is_complete", lambda path: False)
    tracker = start(tmp_path, flush_timeout=0.2)
    began = time.monotonic()
    tracker.finish()
    assert time.monotonic() - began < 10
    assert (
        len(tracker.warnings) == 1
        and "has no exit record 0.2 s after finish" in tracker.warnings[0]
    )


def core_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb-core" in " ".join(p.cmdline())]


def test_a_dead_wandb_core_costs_only_the_current_cell_its_wandb_run(tmp_path: Path) -> None:
    tracker = start(tmp_path / "a")
    tracker.log(metrics_at(0), step=0)
    for process in core_processes():
        process.kill()
        process.wait(10)
    tracker.log(metrics_at(1), step=1)
    tracker.finish(summary={"final_reward": 0.4})
    assert tracker.warnings and not tracker.active

    following = run_cell(tmp_path / "b", "random-b0.25-s3", steps=3)
    assert following.warnings == []
    run = read_offline_run(following.run_path)
    assert run.complete and [row["step"] for row in run.history] == [0, 1, 2]


def test_every_attempt_of_a_cell_logs_to_its_one_run_id(tmp_path: Path) -> None:
    for attempt in ("first", "second"):
        tracker = start(tmp_path / attempt, run_id="cellrun0001")
        tracker.log(metrics_at(0), step=0)
        tracker.finish()
        assert tracker.warnings == []
        assert read_offline_run(tracker.run_path).run_id == "cellrun0001"


def test_runs_record_the_repository_commit_with_git_asked_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B asks git for the repository's root, remote and commit in four subprocesses per run
    unless told them; the tracker reads them once per process and working directory."""
    import subprocess

    from ablate.tracking.offline_reader import read_records
    from ablate.tracking.wandb_run import _git_state

    repo = tmp_path / "repo"
    repo.mkdir()
    for command in (["init", "-q"], ["remote", "add", "origin", "https://example.org/lab/ablate.git"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *command], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.chdir(repo)
    monkeypatch.delenv("WANDB_DISABLE_GIT", raising=False)  # the tests' default: W&B records no git
    _git_state.cache_clear()
    # W&B asks git for the root once per process, when its settings first load (for the program's
    # path): load them before counting, as an earlier cell of a worker would have.
    import wandb

    wandb.setup()
    gits: list[list[str]] = []
    popen = subprocess.Popen.__init__

    def counting(self, args, *rest, **kwargs):
        if isinstance(args, (list, tuple)) and args and Path(str(args[0])).name == "git":
            gits.append(list(args))
        popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", counting)
    trackers = [run_cell(tmp_path / f"cell-{i}", f"fisher-b0.25-s{i}", steps=1) for i in range(3)]

    assert len(gits) <= 3, gits  # root, remote and commit, once for the three runs
    for tracker in trackers:
        assert tracker.warnings == []
        (run,) = [r["run"] for r in read_records(tracker.run_path)[1] if "run" in r]
        assert run["git"] == {"commit": commit, "remote_url": "https://example.org/lab/ablate.git"}

    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")  # the user's choice stands
    gits.clear()
    tracker = run_cell(tmp_path / "cell-off", "fisher-b0.25-s9", steps=1)
    assert gits == [] and tracker.warnings == []
    assert all("git" not in r["run"] for r in read_records(tracker.run_path)[1] if "run" in r)
    _git_state.cache_clear()
