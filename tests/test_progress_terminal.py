"""A sweep on a terminal: its progress bar stays one line, and a stopped sweep's bar stays where it was.

The sweep runs on a pseudo-terminal, as in a user's shell, so that tqdm draws its bar; the raw
output is read back. Between the plan and the tally nothing but bar updates (carriage returns)
may reach the terminal: no launcher line per job, no job log line.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

GRID = ["-m", "backend=noop", "backend.steps=20", "backend.step_seconds=0.1", "policy=random", "budget=0.1,0.3,0.5",
        "seed=0,1", "sweep=bar", "tracking.mode=disabled", "hydra.sweeper.progress_interval=0.2"]


def on_terminal(tmp_path: Path, *arguments: str, interrupt_when=None, timeout: float = 300) -> tuple[str, int]:
    """Run ``python -m ablate`` on a 100-column pseudo-terminal; Ctrl-C (to its process group) once
    ``interrupt_when()`` holds. Returns everything it wrote and its exit status."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "ablate", *arguments, f"store_dir={tmp_path / 'runs'}"],
                               stdin=slave, stdout=slave, stderr=slave, cwd=tmp_path, start_new_session=True,
                               env={**os.environ, "COLUMNS": "100", "TERM": "xterm"})
    os.close(slave)
    output, deadline, sent = b"", time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        if interrupt_when is not None and not sent and interrupt_when():
            os.killpg(process.pid, signal.SIGINT)
            sent = True
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            output += chunk
        elif process.poll() is not None:
            break
    process.wait(timeout=60)
    os.close(master)
    return output.decode(errors="replace"), process.returncode


def bar_region(output: str) -> str:
    """What the terminal got between the plan line and the tally line."""
    start = output.index("sweep bar: 6 cells:")
    start = output.index("\n", start) + 1
    end = re.search(r"sweep bar: \d+ complete", output).start()
    return output[start:end]


def test_the_bar_is_one_line_from_the_plan_to_the_tally(tmp_path):
    output, status = on_terminal(tmp_path, *GRID)
    assert status == 0, output[-2000:]
    region = bar_region(output)
    assert "#0 :" not in output and "Launching" not in output  # the launcher's lines went to launches.log
    assert region.count("\r") > 3 and region.rstrip("\r\n").count("\n") == 0, region[-2000:]
    assert "6/6" in region
    (launches,) = (tmp_path / "runs" / "bar" / "_hydra").glob("multirun-*/launches.log")
    assert "#5 :" in launches.read_text()


def test_a_stopped_joblib_sweep_bar_shows_what_ended_not_everything(tmp_path):
    sweep = tmp_path / "runs" / "bar"

    def two_running() -> bool:
        return len([p for p in sweep.glob("*/claim.json")]) >= 2

    output, status = on_terminal(tmp_path, *GRID, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                                 interrupt_when=two_running)
    assert status == 130, output[-2000:]
    tally = re.search(r"sweep bar: (\d+) complete, (\d+) failed", output)
    ended = int(tally.group(1)) + int(tally.group(2))
    last_bar = re.findall(r"\| (\d+)/6 \[", bar_region(output))[-1]
    assert int(last_bar) == ended < 6
