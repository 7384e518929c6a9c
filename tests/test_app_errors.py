"""Mistakes in a command or a ``--config-dir`` end in one line naming them, before any cell is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ablate.tracking import find_offline_runs, read_offline_run

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


def c_locale(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The command in the C locale with Python's UTF-8 mode off: the console takes ASCII only."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("LANG", None)
    return subprocess.run([sys.executable, "-m", "ablate", *args, "backend=noop", "tracking.mode=disabled"],
                          cwd=tmp_path, capture_output=True, env=env, timeout=300)


@pytest.mark.parametrize("override", ["sweep='é'", "store_dir='{tmp}/é'"])
def test_a_non_ascii_argument_without_utf8_mode_is_one_printable_line(tmp_path, override):
    """Python keeps such bytes as surrogates, which used to end the command in a UnicodeEncodeError."""
    argument = override.format(tmp=tmp_path)
    done = c_locale(tmp_path, argument)
    assert done.returncode == 2, done.stderr.decode("utf-8", "replace")
    stderr = done.stderr.decode("ascii")  # printable in this locale: nothing but ASCII
    shown = argument.encode().decode("ascii", "backslashreplace")
    assert stderr.strip().splitlines() == [
        f"ablate: {shown}: bytes that are not text in this locale's encoding (ascii); run ablate with a UTF-8 "
        "locale (LC_ALL=C.UTF-8) or Python's UTF-8 mode (PYTHONUTF8=1)"]
    assert not list(tmp_path.glob("**/cell.json"))


def test_a_non_ascii_store_from_a_config_file_without_utf8_mode_is_one_line(tmp_path):
    sweeps = tmp_path / "cfg" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "accent.yaml").write_text(f"# @package _global_\nsweep: accent\nstore_dir: {tmp_path}/é\n",
                                        encoding="utf-8")
    done = c_locale(tmp_path, "--config-dir", "cfg", "sweeps=accent")
    assert done.returncode == 1 and b"Traceback" not in done.stderr
    assert done.stderr.decode("ascii").strip().splitlines() == [
        f"ablate: {tmp_path}/\\xe9: cannot create the run store: its name is not text in this locale's encoding "
        "(ascii); run ablate with a UTF-8 locale (LC_ALL=C.UTF-8) or Python's UTF-8 mode (PYTHONUTF8=1)"]


#: A sweep file's analysis block with one mistake each; the analysis would meet it only after every cell ran.
ANALYSIS_MISTAKES = {
    "outcome": ("outcomes: [kl_k3, final_reward]", "analysis.outcomes=['kl_k3', 'final_reward']: 'kl_k3' is not an "
                "outcome (did you mean kl_k3_mean?); expected outcomes among final_reward, reward_auc"),
    "primary": ("primary: ['selection:fishr:random@pooled', replay]", "analysis.primary "
                "'selection:fishr:random@pooled': POLICY 'fishr' is not a policy (did you mean fisher?); expected one "
                "of fisher, full, mismatch, none, random, threshold, uniform"),
    "margin": ("margins: {final_rewards: 0.05}", "analysis.margins.final_rewards=0.05: 'final_rewards' is not an "
               "outcome (did you mean final_reward?); expected outcomes among final_reward, reward_auc"),
}


@pytest.mark.parametrize("mistake", list(ANALYSIS_MISTAKES))
def test_a_mistake_in_a_sweep_files_analysis_block_is_one_line_before_any_cell(tmp_path, mistake):
    block, said = ANALYSIS_MISTAKES[mistake]
    sweeps = tmp_path / "cfg" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "declared.yaml").write_text(f"# @package _global_\nsweep: declared\nanalysis:\n  {block}\n")
    line = one_line(ablate(tmp_path, "-m", "--config-dir", "cfg", "sweeps=declared", "policy=none,full", "seed=0,1"))
    assert line.startswith(f"ablate: {said}"), line
    assert not list((tmp_path / "runs").glob("*/*/cell.json"))


def test_a_value_read_from_the_environment_is_recorded_as_its_interpolation(tmp_path):
    """Neither config.yaml nor the W&B run's config hold the variable's value; the cell computes with it."""
    secret = "team-from-the-environment"
    env = {**os.environ, "ABLATE_TEST_ENTITY": secret, "WANDB_SILENT": "true", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "ablate", "backend=noop", "tracking.mode=offline",
                           "tracking.entity=${oc.env:ABLATE_TEST_ENTITY}", f"store_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    (cell,) = (tmp_path / "runs" / "adhoc").glob("full-s0-*")
    recorded = yaml.safe_load((cell / "config.yaml").read_text())
    assert recorded["tracking"]["entity"] == "${oc.env:ABLATE_TEST_ENTITY}"
    assert not [path for path in cell.rglob("*") if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl")
                and secret in path.read_text()]
    (run_dir,) = find_offline_runs(cell / "wandb")
    assert read_offline_run(run_dir).config["tracking.entity"] == "${oc.env:ABLATE_TEST_ENTITY}"


def test_a_value_read_from_the_environment_that_would_change_the_cell_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ablate", "backend=noop", "tracking.mode=disabled",
                           "backend.steps=${oc.env:ABLATE_TEST_STEPS}", f"store_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "ABLATE_TEST_STEPS": "3"},
                          timeout=300)
    assert one_line(done) == (
        "ablate: backend.steps=${oc.env:ABLATE_TEST_STEPS}: a value read from the environment, in a setting that "
        "changes what the cell computes; expected the value itself (on the command line: "
        "backend.steps=\"$ABLATE_TEST_STEPS\"), so that config.yaml and W&B record it and the cell's identity holds it")
    assert not list((tmp_path / "runs").glob("*/*/cell.json"))
