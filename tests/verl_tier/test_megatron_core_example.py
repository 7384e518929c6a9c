"""The worked example, as a user runs it: examples/megatron_core/loop.py, a Megatron-core RL loop on a CPU."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

pytestmark = [pytest.mark.verl, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port no process listens on now: the example's gloo rendezvous, apart from any of this process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_example_loop_replays_the_budget_of_the_recorded_routes_every_step(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "examples" / "megatron_core" / "loop.py"), "--policy", "random",
                           "--budget", "0.25", "--steps", "3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MASTER_PORT": str(free_port())})
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 0", "step 1", "step 2"]
    for line in steps:
        values = dict(re.findall(r"(\S+)=(\S+)", line))
        # 4 sequences of 12 tokens, 2 MoE layers: floor(0.25 * 24 + 0.5) = 6 routes of each sequence
        assert values["replay/valid_routes"] == "96" and values["replay/replayed_routes"] == "24", line
        assert values["replay/budget_realized"] == "0.25", line
        assert 0 <= float(values["replay/effective_budget"]) <= float(values["routing/route_mismatch_rate"]), line
        assert float(values["mismatch/kl_k3"]) >= 0 and 0 <= float(values["reward"]) <= 1, line
