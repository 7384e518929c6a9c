"""Policies of your own: found by module (``plugins=[...]``) or entry point, typed, checked, run.

The policy module is written into ``tmp_path`` as a user would write it, imported through the
config key, composed with Hydra like a built-in (its settings typed by its own dataclass), and run
in a real cell of the synthetic backend. The installed-package path (entry point, joblib workers,
verl router tests) is ``test_margin_example.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from ablate.app import plugins_from_arguments
from ablate.arms import arm_name, arm_policy
from ablate.compose import ConfigError, cell_from_config
from ablate.policies import (
    PolicyError,
    ReplayPolicy,
    load_plugins,
    policy_class,
    register_policy,
    register_policy_options,
)
from ablate.routes import Routes, native_margin
from ablate.runner import run_cell
from synthetic_configs import compose_config

REPO = Path(__file__).resolve().parents[1]

#: A policy module as a user writes it: its settings dataclass, its traits, its ranking.
LAST_LAYERS_MODULE = '''
from dataclasses import dataclass

from ablate.config import PolicyConfig
from ablate.policies import ReplayPolicy, register_policy


@dataclass
class LastLayersSettings(PolicyConfig):
    name: str = "last_layers"
    depth_weight: float = 1.0


@register_policy("last_layers")
class LastLayersReplay(ReplayPolicy):
    """Deeper layers first, ties at random."""

    Settings = LastLayersSettings

    def __init__(self, *, depth_weight: float = 1.0) -> None:
        super().__init__()
        if depth_weight <= 0:
            raise ValueError(f"depth_weight={depth_weight} in policy=last_layers: expected a weight > 0")
        self.depth_weight = depth_weight

    def route_keys(self, routes, rows, draws):
        import torch

        depth = torch.arange(routes.num_layers, dtype=torch.float32, device=routes.device)
        return (self.depth_weight * depth).expand(len(rows), -1).clone()
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """The module on the path, imported and offered as a ``policy`` option; all of it undone after."""
    from hydra.core.config_store import ConfigStore

    from ablate.policies import base

    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "last_layers_policy.py").write_text(LAST_LAYERS_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.delitem(sys.modules, "last_layers_policy", raising=False)
    load_plugins(["last_layers_policy"])
    register_policy_options()
    yield folder
    sys.modules.pop("last_layers_policy", None)
    ConfigStore.instance().repo["policy"].pop("last_layers.yaml", None)


def test_a_module_named_in_plugins_composes_typed_checks_and_runs_like_a_builtin(user_module, tmp_path):
    cfg = compose_config("plugins=[last_layers_policy]", "policy=last_layers", "budget=0.5", "policy.depth_weight=2",
                         "tracking.mode=disabled", store=tmp_path / "runs")
    assert cfg.policy.depth_weight == 2.0  # typed by the policy's own dataclass
    cell = cell_from_config(cfg)
    assert (cell.policy, cell.policy_settings, cell.variant) == ("last_layers", {"depth_weight": 2.0}, "depth_weight=2.0")
    assert cell.name == "last_layers+depth_weight=2.0-b0.5-s0"
    summary = run_cell(cfg)
    assert summary["steps"] == 6
    # The policy replays the deepest layer first: at budget 0.5 with 2 layers, all of layer 1.
    assert cell.replay.policy.build(2, 4)[0].select(
        Routes(rollout=torch.tensor([[[0, 1], [2, 3]]] * 4), valid=torch.ones(4, dtype=torch.bool), num_experts=4), 0.5,
    ).tolist() == [[False, True]] * 4


def test_a_plugin_setting_of_the_wrong_type_or_an_unknown_key_fails_at_composition(user_module):
    with pytest.raises(ConfigCompositionException) as error:
        compose_config("policy=last_layers", "budget=0.5", "policy.depth_weight=heavy")
    assert isinstance(error.value.__cause__, ValidationError)
    with pytest.raises(ConfigCompositionException, match="Could not override 'policy.tau'"):
        compose_config("policy=last_layers", "budget=0.5", "policy.tau=1")


def test_a_plugin_value_its_policy_refuses_fails_before_anything_is_written(user_module, tmp_path):
    cfg = compose_config("plugins=[last_layers_policy]", "policy=last_layers", "budget=0.5",
                         "policy.depth_weight=-1", store=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"depth_weight=-1.0 in policy=last_layers: expected a weight > 0"):
        run_cell(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_missing_plugin_module_or_policy_is_one_clear_line(tmp_path):
    with pytest.raises(PolicyError, match=r"plugins=\[no_such_policies\]: the module cannot be imported"):
        load_plugins(["no_such_policies"])
    with pytest.raises(PolicyError, match=r"unknown policy 'nope': expected one of .*entry point in group ablate\.policies"):
        policy_class("nope")


def test_a_policy_whose_settings_disagree_with_its_keywords_is_refused_at_registration():
    from dataclasses import dataclass

    from ablate.config import PolicyConfig

    @dataclass
    class Mismatched(PolicyConfig):
        threshold: float = 0.5

    class Disagreeing(ReplayPolicy):
        Settings = Mismatched

        def __init__(self, *, threshold: float = 0.7) -> None:
            super().__init__()

        def route_keys(self, routes, rows, draws):
            return None

    with pytest.raises(PolicyError, match=r"Settings\.threshold=0\.5 has no keyword setting .*threshold=0\.5"):
        register_policy("disagreeing")(Disagreeing)


def test_plugins_on_the_command_line_are_read_before_hydra_composes():
    assert plugins_from_arguments(["-m", "plugins=[a.b,c]", "policy=x", "--config-dir", "d"]) == ["a.b", "c"]
    assert plugins_from_arguments(["+plugins=one"]) == ["one"]
    assert plugins_from_arguments(["policy=fisher", "budget=0.1,0.5"]) == []


@pytest.mark.slow
def test_the_cli_imports_a_plugin_module_and_refuses_a_missing_one_in_one_line(user_module, tmp_path):
    env = {"PYTHONPATH": str(user_module), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "ablate", "plugins=[last_layers_policy]", "policy=last_layers", "budget=0.5",
         "tracking.mode=disabled", f"store_dir={tmp_path / 'runs'}", "backend.steps=2", "backend.layers=2",
         "backend.experts=4", "backend.d_model=16", "backend.expert_hidden=16", "backend.prompts_per_step=4",
         "backend.group_size=4"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "last_layers-b0.5-s0" in done.stdout and "complete" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "ablate", "plugins=[not_there]", "policy=none"],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "ablate: plugins=[not_there]: the module cannot be imported (No module named 'not_there'): expected an "
        "importable module that registers policies with @register_policy"
    ]


def test_native_margin_is_the_gap_between_the_kth_and_next_score():
    scores = torch.tensor([[3.0, 1.0, 2.5, 0.0], [1.0, 1.0, 1.0, 1.0]])
    native = scores.topk(2, dim=-1).indices
    assert native_margin(scores, native).tolist() == [1.5, 0.0]
    assert native_margin(scores, scores.topk(4, dim=-1).indices).tolist() == [float("inf")] * 2


def test_the_example_margin_policy_replays_the_closest_ties_and_needs_native_routes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples" / "margin_policy"))
    from margin_policy import MarginReplay

    monkeypatch.setattr(MarginReplay, "name", "margin", raising=False)  # its entry point names it when installed
    assert MarginReplay.needs_native_routes and MarginReplay.fixed_budget is None and not MarginReplay.reads_fisher
    rollout = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]])
    margins = torch.tensor([[0.9], [0.01], [0.5], [0.02]])
    routes = Routes(rollout=rollout, valid=torch.ones(4, dtype=torch.bool), num_experts=4, native=rollout,
                    native_margin=margins)
    assert MarginReplay().select(routes, 0.5, generator=torch.Generator().manual_seed(0)).squeeze(1).tolist() == [
        False, True, False, True]
    with pytest.raises(PolicyError, match="policy=margin needs native router margins"):
        MarginReplay().select(Routes(rollout=rollout, valid=routes.valid, num_experts=4), 0.5)


def test_no_code_outside_the_policies_package_compares_policy_names():
    """Traits and roles replace name tests: a new policy touches no file of ablate."""
    names = "none|full|random|uniform|fisher|mismatch"
    comparison = re.compile(rf"""(==|!=|\bin\b)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "ablate").rglob("*.py")) if "policies" not in path.relative_to(REPO / "ablate").parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if comparison.search(line) and "normalize" not in line and "adjust" not in line and "method" not in line
    ]
    assert found == []


def test_arm_names_round_trip_in_both_spellings():
    assert arm_name("fisher", "tau=1.0") == "fisher[tau=1.0]"
    assert arm_name("fisher", "tau=1.0", in_path=True) == "fisher+tau=1.0"
    assert arm_name("random") == "random"
    assert arm_policy("fisher[tau=1.0]") == arm_policy("fisher+tau=1.0") == arm_policy("fisher") == "fisher"
    assert arm_policy("my_policy[k=v]") == "my_policy"


def test_policies_of_your_own_get_distinct_colours_in_one_figure():
    pytest.importorskip("matplotlib")
    from ablate.analysis.plots import policy_color
    from ablate.policies import policy_look

    builtin = {policy_look(name).color for name in ("none", "full", "random", "uniform", "fisher", "mismatch")}

    mine = ["margin", "last_layers", "depth", "near_tie", "other"]
    shown = ["random", "none", *mine, "margin[per_layer=True]"]
    colours = [policy_color(p, shown) for p in mine]
    assert len(set(colours)) == len(mine)
    assert not set(colours) & builtin
    assert policy_color("margin[per_layer=True]", shown) == policy_color("margin", shown)
    # Alone in a figure, a policy keeps the colour its name hashes to.
    assert policy_color("margin") == policy_color("margin", ["margin", "random"])
