"""Mistakes in a command or a ``--config-dir`` end in one line naming them, before any cell is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SWEEP_FILES = {
    "badyaml": "# @package _global_\nsweep: badyaml\nbudget: [0.1, 0.5\n",
    "badinterp": "# @package _global_\nsweep: badinterp\nbudget: ${nosuch.key}\n",
    "envmiss": "# @package _global_\nsweep: envmiss\nseed: ${oc.env:ABLATE_NO_SUCH_VARIABLE}\n",
    # Hydra resolves the sweeper's own config when it builds the sweeper, before any sweeper code.
    "studyinterp": ("# @package _global_\ndefaults:\n  - override /hydra/sweeper: ablate_optuna\nsweep: studyinterp\n"
                    "hydra:\n  sweeper:\n    n_trials: ${nosuch.trials}\n    params:\n      budget: interval(0.1, 0.9)\n"),
}


def ablate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ablate", *args, "backend=noop", "tracking.mode=disabled",
               f"store_dir={tmp_path / 'runs'}"]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("ablate: ")
    return line


def test_a_misspelt_backend_name_is_refused_before_any_cell_is_written(tmp_path):
    line = one_line(ablate(tmp_path, "-m", "backend.name=synthetik", "seed=0,1"))
    assert "backend.name=synthetik: expected one of noop, synthetic, verl" in line
    assert not list((tmp_path / "runs").glob("*/*/cell.json"))


@pytest.mark.parametrize(
    ("sweep", "problem"),
    [
        ("badyaml", "badyaml.yaml: not valid YAML at line 4, column 1: expected ',' or ']'"),
        ("badinterp", "badinterp.yaml: budget: Interpolation key 'nosuch.key' not found"),
        ("envmiss", "envmiss.yaml: seed: KeyError raised while resolving interpolation: "
                    "\"Environment variable 'ABLATE_NO_SUCH_VARIABLE' not found\""),
        ("studyinterp", "studyinterp.yaml: hydra.sweeper.n_trials: Interpolation key 'nosuch.trials' not found"),
    ],
)
def test_a_broken_config_dir_file_is_named_in_one_line(tmp_path, sweep, problem):
    sweeps = tmp_path / "cfg" / "sweeps"
    sweeps.mkdir(parents=True)
    for name, text in SWEEP_FILES.items():  # the other broken files are not selected: not reported
        (sweeps / f"{name}.yaml").write_text(text)
    line = one_line(ablate(tmp_path, "-m", "--config-dir", "cfg", f"sweeps={sweep}"))
    assert problem in line
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/*/cell.json"))
