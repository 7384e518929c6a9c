"""Every launcher the docs list keeps a sweep's promises when it is stopped or loses a worker.

Each test runs the CLI as a user types it (``python -m ablate -m ...``) on four short noop cells,
then sends SIGINT to the whole process group (what Ctrl-C in a terminal does), sends SIGTERM to
the sweep (what SLURM and ``timeout`` send) or SIGHUP (what a closed terminal or a dropped ssh
session sends; to the sweep's process alone, the case where its workers hear nothing), or SIGKILLs the process running one cell (what the
OOM killer does). It checks the store's records, the tally, the exit status, and that no process
the sweep started outlives it.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from ablate.store import read_json, read_records

#: One xdist worker runs every test here (``--dist loadgroup``): the Ray clusters start one at a time.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

GRID = ["-m", "backend=noop", "policy=random", "budget=0.1,0.5", "seed=0,1", "backend.steps=20",
        "backend.step_seconds=0.3", "tracking.mode=disabled", "sweep=g"]
LAUNCHERS = ["in_process", "joblib", "ray", "ray_cluster", "submitit_local"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_using(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture
def ray_dir():
    """A private Ray temp dir, short enough for Ray's socket paths; Ray processes using it end after."""
    path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    yield path
    stop_processes(processes_using(str(path)))
    shutil.rmtree(path, ignore_errors=True)


def stop_processes(processes: list[psutil.Process]) -> None:
    for process in processes:
        with suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=10)
    for process in alive:
        with suppress(psutil.Error):
            process.kill()


@pytest.fixture
def launcher(request, tmp_path, ray_dir):
    """The overrides and environment of one launcher; ``ray_cluster`` starts a head node first."""
    kind = request.param
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    overrides = {
        "in_process": [],
        "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
        "ray": ["hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                f"+hydra.launcher.ray.init._temp_dir={ray_dir}", "+hydra.launcher.ray.init.include_dashboard=false"],
        "ray_cluster": ["hydra/launcher=ray", "+hydra.launcher.ray.init.address=auto"],
        "submitit_local": ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"],
    }[kind]
    if kind == "ray_cluster":
        port = free_port()
        ray = Path(sys.executable).parent / "ray"
        # Free ports for what `ray start` otherwise binds to fixed defaults (the client server's
        # 10001, the dashboard agent's 52365), which another Ray on the machine may hold.
        ports = [f"--{name}={free_port()}" for name in ("ray-client-server-port", "dashboard-agent-listen-port",
                                                         "dashboard-agent-grpc-port", "metrics-export-port",
                                                         "runtime-env-agent-port")]
        started = subprocess.run([str(ray), "start", "--head", "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
                                  "--port", str(port), "--temp-dir", str(ray_dir), "--include-dashboard=false",
                                  "--disable-usage-stats", *ports], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    return kind, overrides, env


class Sweep:
    """The CLI in its own process group, with every process it starts noted while it runs."""

    def __init__(self, tmp_path: Path, overrides: list[str], env: dict[str, str]) -> None:
        self.store = tmp_path / "runs"
        self.overrides, self.env = overrides, env
        self.seen: dict[int, float] = {}
        self.process = subprocess.Popen([sys.executable, "-m", "ablate", *GRID, *overrides, f"store_dir={self.store}"],
                                        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)

    def note_children(self) -> None:
        with suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with suppress(psutil.Error):
                    self.seen[child.pid] = child.create_time()

    def cells(self) -> list[Path]:
        sweep = self.store / "g"
        return sorted(p for p in sweep.iterdir() if not p.name.startswith("_")) if sweep.exists() else []

    def statuses(self) -> dict[str, str]:
        found = {}
        for cell in self.cells():
            try:
                found[cell.name.rsplit("-", 1)[0]] = read_json(cell / "status.json")["status"]
            except Exception:
                pass
        return found

    def wait_running(self, steps: int = 3, timeout: float = 300) -> Path:
        """Until a cell has logged ``steps`` steps; returns that cell's directory."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read()[-3000:]
            self.note_children()
            for cell in self.cells():
                log = cell / "records.jsonl"
                if (cell / "claim.json").exists() and log.exists() and log.read_text().count("\n") >= steps:
                    return cell
            time.sleep(0.2)
        raise AssertionError("no cell started")

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            self.note_children()
            time.sleep(0.2)
        out, _ = self.process.communicate(timeout=30)
        return self.process.returncode, out

    def left_behind(self, grace: float = 15) -> list[str]:
        """Processes the sweep started that still run ``grace`` seconds after it ended."""
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for pid, started in self.seen.items():
                with suppress(psutil.Error):
                    process = psutil.Process(pid)
                    if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{pid} {' '.join(process.cmdline())[:120]}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


def tally_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("sweep g: ") and " skipped in " in line]
    assert lines, out[-3000:]
    return lines[-1]


@pytest.mark.parametrize("launcher", LAUNCHERS, indirect=True)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_ends_running_cells_interrupted_prints_the_tally_and_leaves_no_process(tmp_path, launcher, signum):
    kind, overrides, env = launcher
    sweep = Sweep(tmp_path, overrides, env)
    sweep.wait_running()
    if signum == signal.SIGINT:
        os.killpg(sweep.process.pid, signum)  # Ctrl-C in a terminal: the whole process group
    else:
        sweep.process.send_signal(signum)
    status, out = sweep.finish()
    assert status == 128 + signum, out[-3000:]
    statuses = sweep.statuses()
    assert "interrupted" in statuses.values() and "running" not in statuses.values(), (statuses, out[-3000:])
    line = tally_line(out)
    interrupted = list(statuses.values()).count("interrupted")
    complete = list(statuses.values()).count("complete")
    assert f"{complete} complete, 0 failed, {interrupted} interrupted" in line, (line, statuses)
    assert f"{4 - complete - interrupted} not run" in line or complete + interrupted == 4, line
    assert f"interrupted by {signal.Signals(signum).name}" in out
    assert out.count("Traceback") == 0, out[-3000:]
    assert sweep.left_behind() == []


@pytest.mark.parametrize("launcher", LAUNCHERS, indirect=True)
def test_a_killed_worker_fails_its_cell_only_and_the_others_run(tmp_path, launcher):
    kind, overrides, env = launcher
    if kind.startswith("ray"):
        overrides = [*overrides, "+hydra.launcher.ray.remote.max_retries=0"]  # the worker dies for good
    sweep = Sweep(tmp_path, overrides, env)
    victim = sweep.wait_running()
    os.kill(read_json(victim / "claim.json")["pid"], signal.SIGKILL)
    status, out = sweep.finish()
    statuses = sweep.statuses()
    killed = victim.name.rsplit("-", 1)[0]
    assert statuses[killed] == "running"  # its process died: the store keeps what it logged
    if kind == "in_process":  # the worker is the sweep: the next run completes the rest
        assert status == -signal.SIGKILL
        assert sweep.left_behind() == []
        again = Sweep(tmp_path, overrides, env)
        status, out = again.finish()
        assert status == 0, out[-3000:]
        assert set(again.statuses().values()) == {"complete"}
        return
    assert status == 1, out[-3000:]
    assert {name: s for name, s in statuses.items() if name != killed} == {
        name: "complete" for name in statuses if name != killed} and len(statuses) == 4, statuses
    line = tally_line(out)
    assert "3 complete, 1 failed, 0 skipped" in line, line
    assert f"failed: {killed}: no live worker holds it (killed or crashed)" in out
    assert "Traceback" not in out, out[-3000:]
    assert sweep.left_behind() == []


@pytest.mark.parametrize("launcher", LAUNCHERS, indirect=True)
def test_a_cell_past_its_time_limit_ends_failed_with_its_steps_under_every_launcher(tmp_path, launcher):
    kind, overrides, env = launcher
    sweep = Sweep(tmp_path, [*overrides, "cell_timeout=2"], env)  # a cell needs 6 s: 20 steps of 0.3 s
    status, out = sweep.finish()
    assert status == 1, out[-3000:]
    assert list(sweep.statuses().values()) == ["failed"] * 4, (sweep.statuses(), out[-3000:])
    for cell in sweep.cells():
        status_file = read_json(cell / "status.json")
        assert "CellTimeout: timeout: the cell ran past cell_timeout=2 s" in status_file["error"]
        assert 1 <= len(read_records(cell)) < 20  # the steps it logged before the limit are kept
    assert "0 complete, 4 failed, 0 skipped" in tally_line(out)
    assert "Traceback" not in out, out[-3000:]
    assert sweep.left_behind() == []
