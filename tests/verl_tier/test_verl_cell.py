"""backend=verl through ablate's own app: a cell becomes a checked verl launch (dry run on CPU)."""

import math

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")

from hydra import compose, initialize_config_module  # noqa: E402

from ablate.backends.verl.backend import VERL_KEYS, build_command, split_metrics  # noqa: E402
from ablate.compose import cell_from_config  # noqa: E402
from ablate.runner import run_cell  # noqa: E402
from ablate.backends.verl.launch import VerlLaunchError  # noqa: E402

pytestmark = pytest.mark.verl


def verl_cell_config(tmp_path, *overrides):
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        return compose("config", overrides=["backend=verl", "tracking.mode=disabled", f"store_dir={tmp_path}",
                                            *overrides])


def test_split_metrics_maps_verl_training_metrics_and_keeps_native_names():
    record, native = split_metrics({
        "critic/score/mean": 0.5, "actor/pg_loss": -0.1, "actor/replay/override_rate": 0.2, "rollout_corr/k3_kl": 0.01,
        "timing_s/step": 3.0, "response_length/mean": 100, "note": "text", "flag": True,
    })
    assert record == {"train/reward": 0.5, "train/loss": -0.1, "replay/override_rate": 0.2, "mismatch/kl_k3": 0.01}
    assert native == {"critic/score/mean": 0.5, "actor/pg_loss": -0.1, "rollout_corr/k3_kl": 0.01,
                      "timing_s/step": 3.0, "response_length/mean": 100.0}
    from ablate.diagnostics import SCHEMA

    assert set(VERL_KEYS.values()) <= set(SCHEMA)
    record, _ = split_metrics({"actor/replay/fisher_mass": None, "actor/other": None})  # verl logs NaN as null
    assert list(record) == ["replay/fisher_mass"] and math.isnan(record["replay/fisher_mass"])
    # a probed step's keys come back under their schema names, NaN ones (none's override rate) too
    record, native = split_metrics({"actor/probe/random@0.5/mismatch/kl_k3": 0.02,
                                    "actor/probe/none/replay/override_rate": None, "actor/probe/x": 1.0})
    assert record["probe/random@0.5/mismatch/kl_k3"] == 0.02 and math.isnan(record["probe/none/replay/override_rate"])
    assert native == {"actor/probe/x": 1.0}


@pytest.mark.parametrize("policy, budget, mode", [
    ("none", None, "R3"), ("full", None, "R3"), ("fisher", 0.25, "R3"), ("mismatch", 0.1, "R3"),
])
def test_cell_becomes_a_checked_verl_command(tmp_path, policy, budget, mode):
    overrides = [f"policy={policy}"] + ([f"budget={budget}"] if budget is not None else [])
    cell = cell_from_config(verl_cell_config(tmp_path, *overrides))
    command, env = build_command(cell, tmp_path / "metrics.jsonl")
    assert command[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert f"actor_rollout_ref.actor.megatron.router_replay.mode={mode}" in command
    assert "trainer.logger=[console,file]" in command and f"trainer.experiment_name='{cell.name}'" in command
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "metrics.jsonl")
    assert "actor_rollout_ref.model.external_lib=ablate.backends.verl.worker" in command


def test_dry_run_prints_the_checked_command_and_writes_nothing(tmp_path, capsys):
    from ablate.runner import run_cell_from_cli

    run_cell_from_cli(verl_cell_config(tmp_path, "policy=random", "budget=0.5", "backend.dry_run=true"))
    printed = capsys.readouterr().out.splitlines()
    assert "-m verl.trainer.main_ppo" in printed[0] and "router_replay.mode=R3" in printed[0]
    assert printed[1] == "random-b0.5-s0: dry run, nothing run or written"
    assert not (tmp_path / "adhoc").exists()
    with pytest.raises(VerlLaunchError, match="Megatron"):  # checked as a launch is
        run_cell(verl_cell_config(tmp_path, "policy=random", "budget=0.5", "backend.dry_run=true",
                                  "backend.overrides=['actor_rollout_ref.actor.strategy=fsdp']"))


def test_fsdp_engine_is_refused_before_launch(tmp_path):

    cell = cell_from_config(verl_cell_config(
        tmp_path, "policy=random", "budget=0.5", "backend.overrides=['actor_rollout_ref.actor.strategy=fsdp']"))
    with pytest.raises(VerlLaunchError):
        build_command(cell, tmp_path / "m.jsonl")


def test_expert_estimators_are_refused_on_verl_before_anything_is_written(tmp_path):
    from ablate.config import ConfigError

    with pytest.raises(ConfigError, match="policy.fisher.estimator=expert_outputs: expected router_logits with backend=verl"):
        run_cell(verl_cell_config(tmp_path, "policy=fisher", "budget=0.5", "policy.fisher.estimator=expert_outputs"))
    assert not (tmp_path / "adhoc").exists()


def test_a_launch_verl_refuses_fails_before_the_cell_is_written(tmp_path):
    with pytest.raises(VerlLaunchError, match="Megatron"):
        run_cell(verl_cell_config(tmp_path, "policy=random", "budget=0.5",
                                  "backend.overrides=['actor_rollout_ref.actor.strategy=fsdp']"))
    assert not (tmp_path / "adhoc").exists()


def test_the_hook_settings_carry_the_cell_and_verl_update_epochs(tmp_path):
    from ablate.backends.verl.hook_settings import HookSettings

    cell = cell_from_config(verl_cell_config(
        tmp_path, "policy=fisher", "budget=0.25", "seed=4", "policy.tau=0.5", "policy.fisher.decay=0.7",
        "backend.overrides=['actor_rollout_ref.actor.ppo_epochs=2']", "probes=[none,random@0.5]", "probe_every=3"))
    command, _ = build_command(cell, tmp_path / "m.jsonl")
    (override,) = [part for part in command if HookSettings.ENV in part]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    settings = HookSettings.from_json(OverridesParser.create().parse_override(override).value())
    assert settings == HookSettings(cell.replay, update_epochs=2) and cell.replay.probe_every == 3
    assert [probe.id for probe in settings.replay.probes] == ["none", "random@0.5"]
    assert settings.replay.policy.settings == {"per_layer": False, "tau": 0.5} and settings.replay.policy.fisher_decay == 0.7
    assert "actor_rollout_ref.rollout.seed=4" in command
    # The variant puts '=' and ',' into the cell name; verl's composition keeps it whole.
    from ablate.backends.verl.backend import default_config_dir
    from ablate.backends.verl.launch import compose

    assert cell.name == "fisher+tau=0.5,fisher.decay=0.7-b0.25-s4"
    assert compose(default_config_dir(), "ablate_ppo", command[5:]).trainer.experiment_name == cell.name


def test_dry_run_from_the_command_line_as_a_user_types_it(tmp_path):
    """The verl config is composed inside the running Hydra app (a second Hydra must not clash)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ablate", "backend=verl", "policy=fisher", "budget=0.25", "seed=0",
         "backend.dry_run=true", "tracking.mode=disabled", f"store_dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "-m verl.trainer.main_ppo" in lines[-2] and "router_replay.mode=R3" in lines[-2]
    assert lines[-1] == "fisher-b0.25-s0: dry run, nothing run or written"
    assert "GlobalHydra" not in done.stderr


@pytest.mark.parametrize("policy", ["none", "full", "random", "uniform", "fisher", "mismatch"])
def test_the_cpu_config_passes_the_launch_checks_for_every_policy(tmp_path, policy):
    """backend=verl_cpu composes to a config check_cell_config accepts; a dry run makes no assets."""
    from ablate.backends.verl.cpu import PLUGIN_MODULE, ROLLOUT_NAME
    from ablate.backends.verl.launch import compose as compose_verl

    overrides = [f"policy={policy}"] + ([] if policy in ("none", "full") else ["budget=0.5"])
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cfg = compose("config", overrides=["backend=verl_cpu", "tracking.mode=disabled", f"store_dir={tmp_path}",
                                           f"backend.cpu.assets_dir={tmp_path / 'assets'}", *overrides])
    cell = cell_from_config(cfg)
    command, env = build_command(cell, tmp_path / "metrics.jsonl", launch=False)
    assert env["VERL_USE_EXTERNAL_MODULES"] == PLUGIN_MODULE and env["VERL_PLATFORM"] == "cpu"
    assert f"actor_rollout_ref.model.path='{tmp_path / 'assets' / 'model'}'" in command
    assert not (tmp_path / "assets").exists()
    config_dir = command[3].removeprefix("--config-path=")
    composed = compose_verl(config_dir, "ablate_ppo_cpu", command[5:])
    assert composed.actor_rollout_ref.rollout.name == ROLLOUT_NAME
    assert composed.ray_kwargs.ray_init.include_dashboard is False


def verl_command_line(tmp_path, *overrides):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ablate", "backend=verl", "policy=fisher", "budget=0.25", "seed=0",
                           "tracking.mode=disabled", f"store_dir={tmp_path}", *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "launch"])
def test_an_override_verls_config_refuses_is_one_line_exit_2_and_nothing_written(tmp_path, dry_run):
    done = verl_command_line(tmp_path, *(["backend.dry_run=true"] if dry_run else []),
                             "backend.overrides=['no.such.key=1']")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "ablate: backend.overrides: no.such.key=1: verl's config ablate_ppo refuses it (Could not override "
        "'no.such.key'. To append to your config use +no.such.key=1)"]
    assert not (tmp_path / "adhoc").exists()


@pytest.mark.parametrize(("override", "said"), [
    ("actor_rollout_ref.model.path=/no/such/model",
     "actor_rollout_ref.model.path=/no/such/model: no such folder; expected a local model folder or a hub id "
     "(org/name) that verl downloads"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
     "actor_rollout_ref.actor.megatron: tensor (3) x pipeline (1) x context (1) parallel sizes = 3 do not divide the "
     "8 GPUs of trainer.n_gpus_per_node x trainer.nnodes; Megatron would refuse the layout once the workers start"),
], ids=["model_path", "tensor_parallel"])
def test_a_dry_run_refuses_a_missing_model_and_a_layout_megatron_refuses(tmp_path, override, said):
    done = verl_command_line(tmp_path, "backend.dry_run=true", f"backend.overrides=['{override}']")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [f"ablate: {said}"]
    assert not (tmp_path / "adhoc").exists()
