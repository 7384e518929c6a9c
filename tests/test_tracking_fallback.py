"""One cell, one W&B run, through the CLI: after an online start falls back offline, when ``wandb/``
is a link to another disk, and a process whose server never answers ends with its last cell.

Servers are local: a closed port (connection refused) and a socket that accepts and never answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ablate.analysis import load_runs
from ablate.tracking import find_offline_runs, read_offline_run

DUMMY_KEY = "0123456789abcdef0123456789abcdef01234567"
NOOP = ["backend=noop", "policy=none", "tracking.progress=false"]


def ablate(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None, multirun: bool = False,
           **popen: object) -> subprocess.Popen:
    command = [sys.executable, "-m", "ablate", *(["-m"] if multirun else []), *NOOP, f"store_dir={tmp_path / 'runs'}",
               *overrides]
    return subprocess.Popen(command, cwd=tmp_path, env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def finished(process: subprocess.Popen, timeout: float = 240) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def closed_port() -> int:
    with socket.socket() as probe:  # nobody listens on it once the probe is closed
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_folders(wandb_dir: Path) -> list[str]:
    return sorted(p.name for p in wandb_dir.iterdir() if p.is_dir() and not p.is_symlink())


@pytest.mark.slow
def test_an_online_start_that_falls_back_offline_leaves_one_run_per_cell(tmp_path):
    server = {"WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}", "WANDB_API_KEY": DUMMY_KEY}
    output = finished(ablate(tmp_path, "seed=0,1", "backend.steps=5", "tracking.mode=online",
                             "tracking.init_timeout=3", env=server, multirun=True))
    assert "this cell logs offline" in output and "2 complete" in output

    cells = sorted((tmp_path / "runs" / "adhoc").glob("none-s*"))
    assert len(cells) == 2
    for cell in cells:
        (folder,) = run_folders(cell / "wandb")  # no aborted online run-*, no empty offline-run-*
        assert folder.startswith("offline-run-")
    frame = load_runs(tmp_path / "runs", source="wandb-offline")
    assert sorted(frame["seed"]) == [0, 1]
    assert frame["final_reward"].notna().all()
    for run_dir in find_offline_runs(tmp_path / "runs"):
        assert [row["step"] for row in read_offline_run(run_dir).history] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_wandb_folder_linked_elsewhere_keeps_one_run_per_cell(tmp_path):
    """Ctrl-C a cell, move its ``wandb/`` to another disk behind a link, run it again."""
    cell_args = ("seed=0", "backend.steps=20", "backend.step_seconds=0.25", "tracking.mode=offline")
    first = ablate(tmp_path, *cell_args)
    store = tmp_path / "runs" / "adhoc"
    deadline = time.monotonic() + 120
    while not list(store.glob("none-s0-*/records.jsonl")) or not list(store.glob("none-s0-*/wandb/offline-run-*")):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.2)
    time.sleep(1.5)
    first.send_signal(signal.SIGINT)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 130, output
    (cell,) = store.glob("none-s0-*")
    elsewhere = tmp_path / "other-disk" / "wandb"
    elsewhere.parent.mkdir()
    (cell / "wandb").rename(elsewhere)
    (cell / "wandb").symlink_to(elsewhere, target_is_directory=True)
    (earlier,) = run_folders(elsewhere)

    finished(ablate(tmp_path, *cell_args))
    assert (cell / "wandb").is_symlink()
    (folder,) = run_folders(elsewhere)  # the interrupted attempt's run is gone, not piled up
    assert folder != earlier
    run = read_offline_run(elsewhere / folder)
    assert run.complete and [row["step"] for row in run.history] == list(range(20))


class BlackHole:
    """A W&B server that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.connections.append(connection)

    def close(self) -> None:
        self.socket.close()
        for connection in self.connections:
            connection.close()


@pytest.mark.slow
def test_a_server_that_never_answers_does_not_hold_the_process_after_its_cell(tmp_path):
    server = BlackHole()
    try:
        process = ablate(tmp_path, "seed=0", "backend.steps=3", "tracking.mode=online", "tracking.init_timeout=3",
                         env={"WANDB_BASE_URL": f"http://127.0.0.1:{server.port}", "WANDB_API_KEY": DUMMY_KEY})
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if ": complete in " in line:
                completed = time.monotonic()
                break
        else:
            raise AssertionError("".join(lines))
        rest, _ = process.communicate(timeout=120)
        lingered = time.monotonic() - completed
    finally:
        server.close()
    assert process.returncode == 0, "".join(lines) + rest
    assert "this cell logs offline" in "".join(lines)
    assert lingered < 8, f"the process ended {lingered:.1f} s after its cell completed"


@pytest.mark.slow
def test_a_home_that_cannot_hold_wandbs_logs_costs_one_line(tmp_path):
    """wandb-core logs to the console when it cannot make its log folder: about 18 lines a process."""
    home = tmp_path / "home"
    home.write_text("a file where the home folder should be")
    env = {"HOME": str(home), "WANDB_SILENT": "true"}
    env_without_cache = {key: value for key, value in os.environ.items() if key != "XDG_CACHE_HOME"}
    said = "W&B's service cannot keep its logs in"

    def output(*overrides: str, multirun: bool = False) -> str:
        command = [sys.executable, "-m", "ablate", *(["-m"] if multirun else []), *NOOP,
                   f"store_dir={tmp_path / 'runs'}", "tracking.mode=offline", *overrides]
        done = subprocess.run(command, cwd=tmp_path, env={**env_without_cache, **env}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    alone = output("seed=0").splitlines()
    assert len(alone) == 2 and said in alone[0] and "(Not a directory)" in alone[0], alone
    assert alone[1].startswith("none-s0 (")
    sweep = output("seed=1,2,3", "sweep=s", multirun=True)
    assert sweep.count(said) == 1 and " INFO " not in sweep and "ERROR main" not in sweep, sweep
    assert "3 complete, 0 failed" in sweep
    for cell in (tmp_path / "runs" / "s").glob("none-s*"):
        assert read_offline_run(find_offline_runs(cell / "wandb")[0]).complete
