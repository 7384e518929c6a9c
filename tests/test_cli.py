"""The command line a user meets first: ``--help``, tab completion, and their own sweep folder.

``--help`` once walked every folder under the repository (``.venv/``, ``runs/``) and listed them
as config groups; these run it where that would hurt, with a timeout that such a walk exceeds.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The real groups: the YAML files of conf/backend, conf/policy and sweeps/, nothing else.
GROUPS = {
    group: ", ".join(sorted(path.stem for path in folder.glob("*.yaml")))
    for group, folder in (("backend", REPO / "conf" / "backend"), ("policy", REPO / "conf" / "policy"),
                          ("sweeps", REPO / "sweeps"))
}


@pytest.fixture(scope="module")
def used_checkout(tmp_path_factory):
    """A directory holding a ``.venv/`` (the real one, linked) and a ``runs/`` of 500 cells."""
    root = tmp_path_factory.mktemp("checkout")
    (root / ".venv").symlink_to(Path(sys.prefix))
    for number in range(500):
        cell = root / "runs" / f"sweep{number % 5}" / f"random-b0.1-s{number}-0123abcd"
        (cell / "wandb" / "offline-run-x").mkdir(parents=True)
        (cell / "cell.json").write_text("{}")
    (root / "tests").mkdir()
    return root


def listed_groups(help_text: str) -> dict[str, str]:
    section = help_text.split("== Config groups (group=option) ==\n", 1)[1].split("\n\n", 1)[0]
    return dict(line.split(": ", 1) for line in section.splitlines())


@pytest.mark.parametrize("where", ["used checkout", "repository root"])
def test_help_lists_only_the_real_config_groups(used_checkout, where):
    cwd = used_checkout if where == "used checkout" else REPO
    done = subprocess.run([sys.executable, "-m", "ablate", "--help"], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert listed_groups(done.stdout) == GROUPS
    assert "policy:\n  name: full" in done.stdout  # the composed config follows


def complete(line: str, cwd: Path) -> list[str]:
    """What ``ablate <TAB>`` offers for ``line``, through Hydra's bash completion."""
    script = Path(sys.executable).parent / "ablate"
    done = subprocess.run([str(script), "-sc", "query=bash"], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COMP_LINE": line})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_tab_completion_offers_only_real_choices(used_checkout):
    top = complete("ablate ", used_checkout)
    assert {"backend=", "policy=", "sweeps=", "budget=", "seed=", "tracking."} <= set(top)
    assert not [word for word in top if word.startswith((".", "runs", "tests", "base_"))]
    assert complete("ablate policy=", used_checkout) == [f"policy={p}" for p in GROUPS["policy"].split(", ")]
    assert complete("ablate backend=", used_checkout) == [f"backend={b}" for b in GROUPS["backend"].split(", ")]
    assert complete("ablate backend.st", used_checkout) == ["backend.steps="]


def test_a_sweep_folder_of_ones_own_joins_with_config_dir(tmp_path):
    sweeps = tmp_path / "my_sweeps" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "mine.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /backend: noop\n"
        "sweep: mine\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      policy: none,random\n      budget: 0.1\n"
        "      seed: range(2)\n"
    )
    command = [sys.executable, "-m", "ablate", "--config-dir", "my_sweeps"]
    helped = subprocess.run([*command, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert listed_groups(helped.stdout)["sweeps"].split(", ") == sorted([*GROUPS["sweeps"].split(", "), "mine"])
    done = subprocess.run([*command, "sweeps=mine", "tracking.mode=disabled", "store_dir=runs"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sweep mine: 4 complete, 0 failed, 0 skipped" in done.stdout
    assert sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "runs" / "mine").iterdir() if p.name[0] != "_") == [
        "none-s0", "none-s1", "random-b0.1-s0", "random-b0.1-s1"]
