"""Plugins that break the rules, run through the command line as their author would.

A policy module of a careless author: one that replays every route or none whatever the budget
(by overriding ``select`` or ``choose``), one whose ranking has the wrong shape, modules that
raise or do not parse on import. Each ends the cell or the command in one line that names the
plugin and what was expected; none completes a cell with a broken budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: The issue's shrunken backend (docs/reliability.md): four layers, so budgets 0.25 are exact counts.
TINY = ["backend.steps=3", "backend.layers=4", "backend.experts=8", "backend.d_model=24", "backend.expert_hidden=24",
        "backend.prompts_per_step=8", "backend.group_size=8", "backend.digits=4", "tracking.mode=disabled"]

ROGUE_MODULE = '''
import os

import torch

from ablate.policies import ReplayPolicy, register_policy


@register_policy("greedy")
class Greedy(ReplayPolicy):
    """Replays every valid route, whatever the budget."""

    def select(self, routes, budget=None, *, generator=None, per_sequence=False):
        return routes.valid_routes().clone()

    def route_keys(self, routes, rows, draws):
        return None


@register_policy("shy")
class Shy(ReplayPolicy):
    """Replays nothing, whatever the budget."""

    def choose(self, routes, rows, quotas, draws):
        return torch.zeros(len(rows), routes.num_layers, dtype=torch.bool, device=routes.device)

    def route_keys(self, routes, rows, draws):
        return None


@register_policy("lopsided")
class Lopsided(ReplayPolicy):
    """Ranks one number per token where one per route is expected."""

    def route_keys(self, routes, rows, draws):
        return torch.zeros(len(rows))


@register_policy("ghost")
class Ghost(ReplayPolicy):
    """Ranks on the meta device, where a tensor has a shape and no values."""

    def route_keys(self, routes, rows, draws):
        return torch.zeros(len(rows), routes.num_layers, device="meta")


@register_policy("stuck")
class Stuck(ReplayPolicy):
    """Never returns: a loop with no way out."""

    def route_keys(self, routes, rows, draws):
        while True:
            pass


@register_policy("exiter")
class Exiter(ReplayPolicy):
    """Ends the program from inside a cell, as code that calls sys.exit or raises what a signal would."""

    def route_keys(self, routes, rows, draws):
        raise {"SystemExit": SystemExit(0), "KeyboardInterrupt": KeyboardInterrupt(),
               "GeneratorExit": GeneratorExit()}[os.environ["EXITER_RAISES"]]
'''


def ablate(tmp_path: Path, *arguments: str, raises: str = "SystemExit") -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(tmp_path / "code"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "WANDB_SILENT": "true", "EXITER_RAISES": raises}
    return subprocess.run([sys.executable, "-m", "ablate", *arguments], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


@pytest.fixture()
def code(tmp_path: Path) -> Path:
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "rogue.py").write_text(ROGUE_MODULE)
    return folder


def only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(("policy", "realized"), [("greedy", 2304), ("shy", 0)])
def test_a_policy_that_breaks_its_budget_fails_its_cell_in_one_line(tmp_path, code, policy, realized):
    done = ablate(tmp_path, "plugins=[rogue]", f"policy={policy}", "budget=0.25", *TINY)
    assert done.returncode == 1
    line = only_line(done.stderr)
    assert f"policy={policy}" in line and "budget=0.25" in line
    assert f"replayed {realized} of 2304 valid routes: expected exactly 576" in line
    (status_file,) = (tmp_path / "runs" / "adhoc").glob(f"{policy}-b0.25-s0-*/status.json")
    status = json.loads(status_file.read_text())
    assert status["status"] == "failed" and "BudgetViolation" in status["error"]


def test_a_policy_that_breaks_its_budget_is_never_analysed_beside_random(tmp_path, code):
    done = ablate(tmp_path, "-m", "plugins=[rogue]", "policy=greedy,random", "budget=0.25", "seed=0", "sweep=rogue",
                  *TINY)
    assert done.returncode == 1
    assert "1 complete, 1 failed" in done.stdout
    analysed = subprocess.run([sys.executable, "-m", "ablate.analysis", str(tmp_path / "runs" / "rogue"),
                               "--no-plots", "--reps", "200"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300)
    table = (tmp_path / "runs" / "rogue" / "analysis" / "table_final_reward.csv").read_text()
    assert analysed.returncode == 0, analysed.stderr
    assert "random" in table and "greedy" not in table


def test_a_ranking_of_the_wrong_shape_names_the_plugin_and_both_shapes(tmp_path, code):
    done = ablate(tmp_path, "plugins=[rogue]", "policy=lopsided", "budget=0.25", *TINY)
    assert done.returncode == 1
    line = only_line(done.stderr)
    assert "policy=lopsided (Lopsided.route_keys) returned shape (576,)" in line
    assert "expected a float tensor [valid tokens, layers]=[576, 4]" in line


def test_a_ranking_on_the_meta_device_names_the_plugin_and_both_devices(tmp_path, code):
    done = ablate(tmp_path, "plugins=[rogue]", "policy=ghost", "budget=0.25", *TINY)
    assert done.returncode == 1
    line = only_line(done.stderr)
    assert "policy=ghost (Ghost.route_keys) returned a ranking on device meta: expected it on the routes' device, cpu" in line
    assert "Tensor.item()" not in line


def test_a_policy_that_never_returns_ends_failed_at_the_cell_timeout(tmp_path, code):
    done = ablate(tmp_path, "plugins=[rogue]", "policy=stuck", "budget=0.25", "cell_timeout=3", *TINY)
    assert done.returncode == 1, done.stdout + done.stderr
    line = only_line(done.stderr)
    assert "stuck-b0.25-s0" in line and "CellTimeout: timeout: the cell ran past cell_timeout=3 s" in line
    (status_file,) = (tmp_path / "runs" / "adhoc").glob("stuck-b0.25-s0-*/status.json")
    status = json.loads(status_file.read_text())
    assert status["status"] == "failed" and "cell_timeout=3" in status["error"]


#: What ends a program, raised by a plugin's own code rather than by a signal.
PROGRAM_ENDS = ["SystemExit", "KeyboardInterrupt", "GeneratorExit"]


@pytest.mark.parametrize("raises", PROGRAM_ENDS)
def test_a_plugin_that_ends_the_program_fails_its_cell_in_one_line(tmp_path, code, raises):
    done = ablate(tmp_path, "plugins=[rogue]", "policy=exiter", "budget=0.25", *TINY, raises=raises)
    assert done.returncode == 1, done.stdout + done.stderr
    line = only_line(done.stderr)
    assert "exiter-b0.25-s0" in line and f"CellExit: {raises}" in line and "ends this cell, not the program" in line
    (status_file,) = (tmp_path / "runs" / "adhoc").glob("exiter-b0.25-s0-*/status.json")
    status = json.loads(status_file.read_text())
    assert status["status"] == "failed" and raises in status["error"] and raises in status["traceback"]


@pytest.mark.slow
@pytest.mark.parametrize("raises", PROGRAM_ENDS)
def test_a_plugin_that_ends_the_program_in_a_sweep_fails_its_cells_and_the_sweep_goes_on(tmp_path, code, raises):
    """The issue's sweep: in process, SystemExit(0) used to end it at its first cell with exit status 0."""
    done = ablate(tmp_path, "-m", "plugins=[rogue]", "policy=exiter,random", "budget=0.25", "seed=0,1", *TINY,
                  raises=raises)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sweep adhoc: 2 complete, 2 failed, 0 skipped" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("  failed: ")]
    assert len(failed) == 2 and all(f"CellExit: {raises}" in line for line in failed)
    assert "2 of 4 cells did not complete; the other cells ran to the end" in done.stderr
    again = ablate(tmp_path, "-m", "plugins=[rogue]", "policy=exiter,random", "budget=0.25", "seed=0,1", *TINY,
                   raises=raises)
    assert again.returncode == 1 and "0 complete, 2 failed, 2 skipped" in again.stdout  # the rerun goes past them too


@pytest.mark.parametrize(("source", "said"), [
    ("raise RuntimeError('no GPU here')\n", "importing the module raised RuntimeError: no GPU here"),
    ("def broken(:\n    pass\n", "importing the module raised SyntaxError: invalid syntax"),
    ("import sys\nsys.exit(3)\n", "importing the module raised SystemExit: 3"),
])
def test_a_plugin_module_that_fails_on_import_is_one_line_exit_2(tmp_path, code, source, said):
    (code / "fragile.py").write_text(source)
    done = ablate(tmp_path, "plugins=[fragile]", "policy=none", *TINY)
    assert done.returncode == 2
    assert only_line(done.stderr).startswith(f"ablate: plugins=[fragile]: {said}")
    assert not (tmp_path / "runs" / "adhoc").exists()


@pytest.mark.parametrize(("length", "said"), [
    (300, "expected a name of at most 250 bytes (it names a config file)"),  # refused before Hydra reads it
    (245, "expected a cell name of at most 255 bytes"),  # a file name, but not once the budget and seed join it
])
def test_a_policy_name_too_long_for_a_directory_is_one_line(tmp_path, code, length, said):
    name = "p" * length
    (code / "long_name.py").write_text(
        "from ablate.policies import ReplayPolicy, register_policy\n\n\n"
        f"@register_policy({name!r})\nclass Long(ReplayPolicy):\n    def route_keys(self, routes, rows, draws):\n"
        "        return None\n")
    done = ablate(tmp_path, "plugins=[long_name]", f"policy={name}", "budget=0.25", *TINY)
    assert done.returncode == 2
    line = only_line(done.stderr)
    assert said in line and len(line) < 400
    assert not (tmp_path / "runs" / "adhoc").exists()


@pytest.mark.parametrize("override", ["sweep=café", "policy=fïsher"])
def test_an_unquoted_non_ascii_value_is_one_line_with_its_quoting(tmp_path, override):
    done = ablate(tmp_path, override, *TINY)
    assert done.returncode == 2
    key, value = override.split("=")
    assert only_line(done.stderr) == (f"ablate: {override}: Hydra cannot read this override "
                                      f"(LexerNoViableAltException) (quote the value: {key}='{value}')")


@pytest.mark.parametrize("override", ["+backend.stepz=3", "+policy.tauu=1"])
def test_a_key_the_typed_settings_do_not_have_is_refused_with_the_closest(tmp_path, override):
    done = ablate(tmp_path, "policy=fisher", "budget=0.25", override, *TINY)
    assert done.returncode == 2
    line = only_line(done.stderr)
    key = override.lstrip("+").split("=")[0]
    closest = {"backend.stepz": "backend.steps", "policy.tauu": "policy.tau"}[key]
    assert line.startswith(f"ablate: {override.lstrip('+')}: ") and f"did you mean {closest}?" in line
    assert not list((tmp_path / "runs").glob("*/*/cell.json"))


@pytest.mark.parametrize("group", ["ablate.backends", "ablate.policies"])
def test_a_broken_installed_entry_point_makes_help_one_line(tmp_path, code, group):
    info = code / "broken_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\nbroken = not_installed_module:THING\n")
    done = ablate(tmp_path, "--help")
    assert done.returncode == 2
    line = only_line(done.stderr)
    assert "broken" in line and "not_installed_module" in line and "cannot be loaded" in line
