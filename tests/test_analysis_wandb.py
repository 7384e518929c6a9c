"""W&B side of the analysis, offline: workspace spec, summary-table run, offline runs as a source."""

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("wandb_workspaces")
offline_reader = pytest.importorskip("ablate.tracking.offline_reader")

import wandb  # noqa: E402
from synthetic_configs import TINY  # noqa: E402

from ablate.analysis.dashboard import (  # noqa: E402
    build_workspace,
    log_summary_table,
    save_workspace,
    summary_run_id,
    workspace_spec,
    write_workspace_spec,
)
from ablate.analysis.load import load_runs  # noqa: E402


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """No account anywhere: a fresh HOME and config dir, no API key, offline mode."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def _wait_complete(run_dir, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not offline_reader.is_complete(run_dir):
        assert time.monotonic() < deadline, f"{run_dir}: no exit record after {timeout}s"
        time.sleep(0.05)


def test_workspace_spec_groups_by_the_arm_and_filters_the_sweep(tmp_path):
    workspace = build_workspace("my-team", "ablate", "toy", arm_keys=["backend.router_noise"])
    spec = workspace_spec(workspace)
    text = json.dumps(spec)
    sections = [s["name"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]]
    assert sections == ["Outcomes", "Routing and mismatch", "Load and drift"]
    run_set = spec["spec"]["section"]["runSets"][0]
    # Settings variants (fisher[tau=1.0]) and every varied config key stay apart, as in the local tables.
    assert run_set["grouping"] == [{"section": "config", "name": "policy.value"},
                                   {"section": "config", "name": "variant.value"},
                                   {"section": "config", "name": "budget.value"},
                                   {"section": "config", "name": "backend.router_noise.value"}]
    assert run_set["filters"]["filters"][0]["key"] == {"section": "run", "name": "group"}
    assert run_set["filters"]["filters"][0]["value"] == "toy"
    assert "mismatch/kl_k3" in text and "routing/residual_mismatch_rate" in text
    assert json.loads(write_workspace_spec(workspace, tmp_path / "ws.json").read_text()) == spec
    assert "panelBankConfig" in write_workspace_spec(workspace, tmp_path / "ws.yaml").read_text()


def test_save_workspace_without_login_says_how(offline_env):
    with pytest.raises(RuntimeError, match="not logged in to W&B"):
        save_workspace(build_workspace("my-team", "ablate", "toy"))


def test_log_summary_table_offline_run_in_the_sweep_group(offline_env):
    table = pd.DataFrame({"policy": ["none", "fisher"], "budget": [0.0, 0.5], "mean": [0.1, 0.4]})
    run_dir = log_summary_table(table.set_index(["policy", "budget"]), project="ablate", group="toy",
                                dir=offline_env)
    _wait_complete(run_dir)
    run = offline_reader.read_offline_run(run_dir)
    assert (run.group, run.job_type, run.name) == ("toy", "summary", "toy-summary")
    assert run.summary["summary._type"] == "table-file"
    logged = json.loads((Path(run_dir) / "files" / run.summary["summary.path"]).read_text())
    assert logged["columns"] == ["policy", "budget", "mean"]
    assert logged["data"] == [["none", 0.0, 0.1], ["fisher", 0.5, 0.4]]


def test_summary_run_has_one_identity_per_sweep_and_logging_again_replaces_it(offline_env):
    table = pd.DataFrame({"policy": ["none"], "budget": [0.0], "mean": [0.1]})
    first = log_summary_table(table, project="ablate", group="toy", dir=offline_env)
    _wait_complete(first)
    second = log_summary_table(table.assign(mean=0.2), project="ablate", group="toy", dir=offline_env)
    _wait_complete(second)
    other = log_summary_table(table, project="ablate", group="other", dir=offline_env)
    _wait_complete(other)
    runs = sorted(p.name for p in (offline_env / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs  # one per sweep: the second call replaced the first
    assert offline_reader.read_offline_run(second).run_id == summary_run_id("toy")
    assert summary_run_id("toy") != summary_run_id("other")
    assert not Path(first).exists() or Path(first) == Path(second)


def test_load_runs_from_wandb_offline_runs(offline_env):
    run_dirs = []
    cells = [("none", 0.0, 0, "toy", 0.07), ("fisher", 0.5, 0, "toy", 0.07), ("fisher", 0.5, 0, "toy", 0.0),
             ("none", 0.0, 0, "other", 0.07)]
    for policy, budget, seed, group, noise in cells:
        # The flattened config the cell runner gives W&B: identity keys plus the resolved config's dotted keys.
        config = {"policy": policy, "budget": budget, "seed": seed, "backend": "synthetic", "schema_version": "1.0",
                  "backend.name": "synthetic", "backend.router_noise": noise, "policy.name": policy,
                  "tracking.mode": "offline", "sweep": group}
        run = wandb.init(project="ablate", group=group, job_type=policy, name=f"{policy}-b{budget:g}-s{seed}",
                         dir=offline_env, mode="offline", reinit="create_new", config=config)
        for step in range(5):
            run.log({"step": step, "train/reward": 0.1 * step + budget, "mismatch/kl_k3": 0.01}, step=step)
        run.finish()
        run_dirs.append(run.dir)
    for run_dir in run_dirs:
        _wait_complete(run_dir.rsplit("/files", 1)[0])
    df = load_runs(offline_env / "wandb", "toy", source="wandb-offline", where={"backend.router_noise": 0.07})
    assert sorted(df["policy"]) == ["fisher", "none"] and df.attrs["config_keys"] == []
    assert load_runs(offline_env / "wandb", "toy", source="wandb-offline").attrs["config_keys"] == ["backend.router_noise"]
    assert set(df["schema_version"]) == {"1.0"}
    fisher = df[df.policy == "fisher"].iloc[0]
    assert (fisher["budget"], fisher["seed"], fisher["backend"]) == (0.5, 0, "synthetic")
    assert fisher["final_reward"] == pytest.approx(0.4 + 0.5)
    assert np.isclose(fisher["train/reward"], 0.9)
    assert df.attrs["excluded"] == {"failed": 0, "interrupted": 0, "running": 0, "unfinished": 0, "corrupt": 0}


def test_dashboard_from_the_cli_twice_leaves_one_summary_run(offline_env, capsys):
    from test_analysis_store import write_cell

    from ablate.analysis.cli import main

    sweep_dir = offline_env / "runs" / "toy"
    for seed in (0, 1):
        for noise in (0.0, 0.07):
            write_cell(sweep_dir, "none", 0.0, seed, backend={"router_noise": noise})
            write_cell(sweep_dir, "random", 0.5, seed, backend={"router_noise": noise})
    out = offline_env / "analysis"
    for _ in range(2):
        assert main([str(sweep_dir), "--out", str(out), "--no-plots", "--reps", "50", "--dashboard"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(summary_run_id("toy"))
    grouping = json.loads((out / "workspace.json").read_text())["spec"]["section"]["runSets"][0]["grouping"]
    assert {"section": "config", "name": "backend.router_noise.value"} in grouping
    assert "workspace not saved: pass --entity" in capsys.readouterr().out


def _screen_of(command: list[str], seconds: float = 8.0) -> str:
    """What a terminal program shows in a 160x50 pseudo-terminal within ``seconds``, then ``q`` to quit."""
    import fcntl
    import os
    import pty
    import re
    import select
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: the program, on the pseudo-terminal
        os.environ["TERM"] = "xterm-256color"
        os.execvp(command[0], command)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    shown, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                shown += os.read(fd, 1 << 16)
            except OSError:
                break
    os.write(fd, b"q")
    for _ in range(50):
        if os.waitpid(pid, os.WNOHANG)[0]:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    os.close(fd)
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", shown.decode(errors="replace"))


def test_wandb_leet_shows_an_offline_run_ablate_wrote(offline_env):
    """docs/outputs.md: ``wandb leet <run dir>`` opens a cell's offline run in W&B's terminal viewer, no login."""
    import subprocess
    import sys

    wandb_cli = Path(sys.executable).with_name("wandb")
    if not wandb_cli.exists():
        pytest.skip("no wandb command beside this python")
    done = subprocess.run([sys.executable, "-m", "ablate", "policy=fisher", "budget=0.25", "seed=3", *TINY,
                           f"store_dir={offline_env / 'runs'}"], capture_output=True, text=True, timeout=300,
                          cwd=offline_env)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (offline_env / "runs" / "adhoc").glob("fisher-b0.25-s3-*/wandb/offline-run-*")
    _wait_complete(run_dir)
    screen = _screen_of([str(wandb_cli), "leet", str(run_dir)])
    assert "final_reward" in screen and "kl_k3_mean" in screen, screen[-2000:]  # the summary ablate logged
    summary = subprocess.run([str(wandb_cli), "leet", "inspect", "--summary", str(run_dir)], capture_output=True,
                             text=True, timeout=60)
    assert summary.returncode == 0 and "final_reward" in summary.stdout, summary.stderr[-2000:]
