"""The launch path through verl's own code: config composition, main_ppo's runtime_env merge, Ray.

Every policy's overrides are composed with verl's config, checked, and handed to verl's real
``run_ppo``, whose merge of ``ray_kwargs.ray_init.runtime_env`` must give a runtime env that Ray
accepts; one cell goes all the way through a local ``ray.init`` into a Ray worker. Where the hook
is installed (only in the Megatron actor) is checked in fresh processes.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")

from ablate.backends.verl.hook_settings import HookSettings  # noqa: E402
from ablate.replay import ReplaySpec  # noqa: E402
from ablate.backends.verl.launch import (  # noqa: E402
    ENV_PREFIX,
    VerlLaunchError,
    check_cell_config,
    check_verl,
    compose,
    hydra_string,
    update_epochs,
    verl_overrides,
)
from ablate.policies import PolicySpec  # noqa: E402

pytestmark = pytest.mark.verl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"
POLICIES = [("none", 0.0, {}), ("full", 1.0, {}), ("random", 0.3, {}), ("uniform", 0.5, {}), ("fisher", 0.25, {"tau": 0.5}),
            ("mismatch", 0.1, {"per_layer": True})]
MODEL = ["actor_rollout_ref.model.path=/tmp/unused"]


def settings_for(policy, budget, extra, seed=3) -> HookSettings:
    return HookSettings(ReplaySpec(PolicySpec(policy, extra, fisher_decay=0.8, fisher_normalize="layer"), budget, seed))


def composed(settings: HookSettings, *extra: str):
    return compose(EXAMPLES, "ablate_ppo", [*verl_overrides(settings), *MODEL, *extra])


class StopBeforeTaskRunner(Exception):
    """Raised by the stand-in for ray.init once the runtime env it was given has been validated."""


def runtime_env_of(config, monkeypatch) -> dict:
    """What verl's own run_ppo passes to ray.init for ``config``, validated by Ray's RuntimeEnv."""
    import ray
    from ray.runtime_env import RuntimeEnv

    from verl.trainer import main_ppo

    seen = {}

    def init(**kwargs):
        RuntimeEnv(**kwargs["runtime_env"])  # the validation that rejected float and int values
        seen.update(kwargs)
        raise StopBeforeTaskRunner

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(StopBeforeTaskRunner):
        main_ppo.run_ppo(config, task_runner_class=None)
    return seen["runtime_env"]


@pytest.mark.parametrize("value", ["0.3", "3", "{\"a\": 1}", "it's", "back\\slash", "ends\\", "\\'", "${oc.env:HOME}", ""])
def test_hydra_string_keeps_any_value_a_string(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(f"+a.b={hydra_string(value)}").value()
    assert parsed == value and isinstance(parsed, str)


@pytest.mark.parametrize("policy,budget,extra", POLICIES)
def test_every_policy_passes_verl_config_main_ppo_merge_and_ray_validation(policy, budget, extra, monkeypatch):
    from verl.utils.config import validate_config

    settings = settings_for(policy, budget, extra)
    config = composed(settings)
    validate_config(config, use_reference_policy=False, use_critic=False)
    check_cell_config(config, policy)
    mode = config.actor_rollout_ref.actor.megatron.router_replay.mode
    assert mode == "R3"  # every policy: none replays an empty mask, full every recorded route
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay
    env = runtime_env_of(config, monkeypatch)["env_vars"]
    assert all(isinstance(value, str) for value in env.values())
    assert config.actor_rollout_ref.model.external_lib == "ablate.backends.verl.worker"
    assert HookSettings.from_json(env[HookSettings.ENV]) == settings


def test_unquoted_values_are_what_ray_rejects(monkeypatch):
    """The defect this launch path had: Hydra types 0.3 as a float, and Ray refuses it."""
    config = compose(EXAMPLES, "ablate_ppo", [*MODEL, f"{ENV_PREFIX}ABLATE_BUDGET=0.3"])
    with pytest.raises(TypeError, match="must be of type Dict\\[str, str\\]"):
        runtime_env_of(config, monkeypatch)


@pytest.mark.slow
def test_a_cell_reaches_a_ray_worker_through_a_real_ray_init(tmp_path, monkeypatch):
    """verl's run_ppo with a real local ray.init: the hook's settings arrive in a Ray worker."""
    import ray

    from verl.trainer import main_ppo

    settings = settings_for("fisher", 0.3, {"tau": 1.0})
    config = composed(settings, "ray_kwargs.ray_init.num_cpus=1")
    out = tmp_path / "worker_env.json"
    monkeypatch.setenv("ABLATE_TEST_PROBE_OUT", str(out))

    @ray.remote(num_cpus=0)
    class Probe:
        """Stands in for verl's TaskRunner: reports what a Ray worker process sees."""

        def run(self, config):
            import os

            Path(os.environ["ABLATE_TEST_PROBE_OUT"]).write_text(os.environ[HookSettings.ENV])

    try:
        main_ppo.run_ppo(config, task_runner_class=Probe)
    finally:
        ray.shutdown()
    assert HookSettings.from_json(out.read_text()) == settings


def test_the_cell_seed_reaches_every_seed_verl_samples_with():
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    config = composed(settings_for("random", 0.3, {}, seed=7))
    OmegaConf.resolve(config)  # as verl's TaskRunner does before building its workers' configs
    rollout = config.actor_rollout_ref.rollout
    assert rollout.seed == 7  # vLLM: seed = replica rank + rollout.seed
    assert rollout.engine_kwargs.sglang.random_seed == 7  # SGLang's ServerArgs.random_seed
    assert config.data.seed == 7  # prompt order
    assert config.actor_rollout_ref.actor.data_loader_seed == 7  # mini-batch shuffling
    assert config.actor_rollout_ref.actor.megatron.seed == 7
    assert config.actor_rollout_ref.ref.megatron.seed == 7  # follows the actor's by interpolation
    assert config.reward.reward_model.rollout.seed == 7
    assert omega_conf_to_dataclass(rollout, RolloutConfig).seed == 7


def test_mismatch_with_bypass_mode_is_refused_before_launch():
    bypass = "algorithm.rollout_correction.bypass_mode=True"
    with pytest.raises(VerlLaunchError, match="policy=mismatch with algorithm.rollout_correction.bypass_mode=True"):
        check_cell_config(composed(settings_for("mismatch", 0.2, {}), bypass), "mismatch")
    for policy, budget, extra in POLICIES:
        if policy != "mismatch":
            check_cell_config(composed(settings_for(policy, budget, extra), bypass), policy)


def test_dynamic_context_parallel_is_refused_for_hooked_policies():
    dcp = "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True"
    with pytest.raises(VerlLaunchError, match="dynamic_context_parallel=True with policy=random"):
        check_cell_config(composed(settings_for("random", 0.2, {}), dcp), "random")
    check_cell_config(composed(settings_for("full", 1.0, {}), dcp), "full")


@pytest.mark.parametrize("override,message", [
    ("algorithm.rollout_correction.bypass_mode=True", "probes run in the old-log-prob pass, which bypass mode skips"),
    ("actor_rollout_ref.rollout.calculate_log_probs=False", "probes compare with the rollout's log-probs"),
    ("actor_rollout_ref.actor.megatron.dynamic_context_parallel=True", "probe passes follow verl's static micro-batches"),
])
def test_probes_that_could_not_be_scored_are_refused_before_launch(override, message):
    for policy, budget, extra in POLICIES:
        config = composed(settings_for(policy, budget, extra), override)
        with pytest.raises(VerlLaunchError, match=rf"^probes=\[none,random@0.5\] with .*{message}"):
            check_cell_config(config, policy, probes=["none", "random@0.5"])
    check_cell_config(composed(settings_for("random", 0.2, {})), "random", probes=["none", "random@0.5"])


def test_update_epochs_come_from_the_composed_config():
    assert update_epochs(composed(settings_for("random", 0.2, {}), "actor_rollout_ref.actor.ppo_epochs=3")) == 3


def test_check_cell_config_rejects_fsdp_and_missing_rollout_routes():
    base = settings_for("random", 0.5, {})
    config = composed(base, "actor_rollout_ref.rollout.enable_rollout_routing_replay=False")
    with pytest.raises(VerlLaunchError, match="no routed_experts"):
        check_cell_config(config, "random")
    config.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    config.actor_rollout_ref.actor.strategy = "fsdp"
    with pytest.raises(VerlLaunchError, match="Megatron"):
        check_cell_config(config, "random")


def test_check_verl_version():
    assert check_verl() == "0.9.1"
    with pytest.raises(VerlLaunchError, match=r"verl==0.9.1 is installed .*: expected verl==0.8.0 \(REQUIRED_VERL.txt\)"):
        check_verl("0.8.0")


# ------------------------------------------------------------------------------------------ R2
def r2_settings(policy="random", budget=0.3, engine="megatron") -> HookSettings:
    return HookSettings(ReplaySpec(PolicySpec(policy), budget, 3, source="train"), engine=engine)


@pytest.mark.parametrize("engine", ["megatron", "veomni"])
def test_an_r2_cell_sets_verls_r2_without_rollout_routes_and_passes_verls_validation(engine, monkeypatch):
    from verl.utils.config import validate_config

    for policy, budget in (("full", 1.0), ("fisher", 0.25), ("random", 0.5)):
        settings = r2_settings(policy, budget, engine)
        config = composed(settings)
        validate_config(config, use_reference_policy=False, use_critic=False)
        check_cell_config(config, policy, engine=engine, source="train")
        actor = config.actor_rollout_ref.actor
        assert getattr(actor, engine).router_replay.mode == "R2"
        assert not config.actor_rollout_ref.rollout.enable_rollout_routing_replay  # verl refuses both at once
        env = runtime_env_of(config, monkeypatch)["env_vars"]
        assert HookSettings.from_json(env[HookSettings.ENV]) == settings


def test_what_verl_refuses_of_r2_is_refused_before_launch_in_one_line():
    from verl.utils.config import validate_config

    bypass = composed(r2_settings(), "algorithm.rollout_correction.bypass_mode=True")
    with pytest.raises(ValueError, match="router_replay.mode='R2' requires algorithm.rollout_correction.bypass_mode"):
        validate_config(bypass, use_reference_policy=False, use_critic=False)  # verl's own refusal, at its start
    with pytest.raises(VerlLaunchError, match=r"^replay.source=train with algorithm.rollout_correction.bypass_mode="
                                              r"True: R2 records the trainer's routes in the old-log-prob pass"):
        check_cell_config(bypass, "random", source="train")
    both = composed(r2_settings(), "actor_rollout_ref.rollout.enable_rollout_routing_replay=True")
    with pytest.raises(VerlLaunchError, match="enable_rollout_routing_replay=True with replay.source=train"):
        check_cell_config(both, "random", source="train")
    with pytest.raises(VerlLaunchError, match="router_replay.mode=R3 with replay.source=train"):
        check_cell_config(composed(settings_for("random", 0.3, {})), "random", source="train")
    with pytest.raises(VerlLaunchError, match=r"^probes=\[none\] with replay.source=train"):
        check_cell_config(composed(r2_settings()), "random", probes=["none"], source="train")


# ------------------------------------------------------------------ where the hook is installed
INSTALL_PROBE = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist

    os.environ["ABLATE_VERL_CELL"] = {cell!r}
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ablate.backends.verl.worker")  # what HFModelConfig does in every process
    from ablate.backends.verl import engines

    report = {{"megatron_after_import": sorted(m for m in sys.modules if m.startswith("megatron"))[:3],
              "installed_after_import": engines.active_hook() is not None}}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29671")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from verl.workers.config import McoreEngineConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.megatron import transformer_impl

    report["installed_after_engine_import"] = engines.active_hook() is not None
    for name, (engine, mode, forward_only) in {engines!r}.items():
        getattr(transformer_impl, engine)(
            None, McoreEngineConfig(router_replay=EngineRouterReplayConfig(mode=mode), forward_only=forward_only),
            None, None)
        report[name] = engines.active_hook() is not None
    print("REPORT" + json.dumps(report))
""")


def test_the_hook_installs_itself_only_with_an_r3_megatron_actor():
    """verl imports external_lib in the trainer, agent-loop and rollout-server processes too:
    there, importing the worker module must neither import Megatron nor install anything."""
    engines = {  # built in this order in one process; the actor comes last
        "reference": ("MegatronEngineWithLMHead", "R3", True),
        "critic": ("MegatronEngineWithValueHead", "R3", False),
        "actor_without_replay": ("MegatronEngineWithLMHead", "disabled", False),
        "actor": ("MegatronEngineWithLMHead", "R3", False),
    }
    code = INSTALL_PROBE.format(cell=settings_for("random", 0.3, {}).to_json(), engines=engines)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("REPORT"))[6:])
    assert report == {
        "megatron_after_import": [], "installed_after_import": False, "installed_after_engine_import": False,
        "reference": False, "critic": False, "actor_without_replay": False, "actor": True,
    }


def test_the_hook_installs_itself_in_an_r2_megatron_actor_too():
    engines = {"reference": ("MegatronEngineWithLMHead", "R2", True),
               "actor": ("MegatronEngineWithLMHead", "R2", False)}
    code = INSTALL_PROBE.format(cell=r2_settings().to_json(), engines=engines)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("REPORT"))[6:])
    assert report["reference"] is False and report["actor"] is True


# ----------------------------------------------------------------------------- the VeOmni engine
def veomni_settings(policy="random", budget=0.3, seed=4) -> HookSettings:
    return HookSettings(ReplaySpec(PolicySpec(policy), budget, seed), engine="veomni")


@pytest.mark.parametrize("policy,budget,extra", POLICIES)
def test_a_veomni_cell_sets_verls_own_veomni_keys_and_passes_verls_validation(policy, budget, extra, monkeypatch):
    from verl.utils.config import validate_config
    from verl.workers.config import VeOmniActorConfig

    settings = HookSettings(ReplaySpec(PolicySpec(policy, extra), budget, 4), engine="veomni")
    config = composed(settings)
    actor = config.actor_rollout_ref.actor
    assert actor.strategy == "veomni" and actor.veomni.router_replay.mode == "R3" and actor.veomni.seed == 4
    assert "megatron" not in actor  # verl's model_engine group: the VeOmni actor config, not Megatron's
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay and actor.use_remove_padding
    validate_config(config, use_reference_policy=False, use_critic=False)
    from verl.utils.config import omega_conf_to_dataclass

    assert isinstance(omega_conf_to_dataclass(actor), VeOmniActorConfig)  # its __post_init__ checks R3's padding
    check_cell_config(config, policy, engine="veomni")
    env = runtime_env_of(config, monkeypatch)["env_vars"]
    assert HookSettings.from_json(env[HookSettings.ENV]).engine == "veomni"


@pytest.mark.parametrize("engine,override,message", [
    ("megatron", "actor_rollout_ref.actor.strategy=fsdp", "verl 0.9.1's fsdp engine carries the router_replay block but replays no route"),
    ("veomni", "actor_rollout_ref.actor.strategy=torchtitan", "torchtitan engine carries the router_replay block"),
    ("megatron", "actor_rollout_ref.actor.strategy=veomni", "set backend.engine=veomni to run the VeOmni"),
    ("megatron", "trainer.device=npu", "verl's MindSpeed engine is not one ablate's hook replays through"),
    ("veomni", "actor_rollout_ref.model.use_remove_padding=False", "use_remove_padding=False with backend.engine=veomni"),
    ("veomni", "actor_rollout_ref.actor.veomni.router_replay.mode=R2", "router_replay.mode=R2: ablate's masks choose"),
    ("megatron", "actor_rollout_ref.actor.megatron.router_replay.mode=R2", "router_replay.mode=R2: ablate's masks"),
    ("veomni", "actor_rollout_ref.actor.veomni.ulysses_parallel_size=2",
     "ulysses_parallel_size=2 with attn_implementation=flash_attention_2: VeOmni's Ulysses sequence parallelism needs"),
])
def test_what_an_engine_would_refuse_later_is_refused_in_one_line(engine, override, message):
    config = composed(HookSettings(ReplaySpec(PolicySpec("random"), 0.3, 4), engine=engine), override)
    with pytest.raises(VerlLaunchError, match=message) as raised:
        check_cell_config(config, "random", engine=engine)
    assert "\n" not in str(raised.value)


def model_folder(tmp_path, **fields) -> str:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    model = {"model_type": "qwen3_moe", "num_experts_per_tok": 2, "mlp_only_layers": [], "decoder_sparse_step": 1}
    (folder / "config.json").write_text(json.dumps({**model, **fields}))
    return str(folder)


@pytest.mark.parametrize("fields,message", [
    ({"model_type": "deepseek_v3"}, r"model_type=deepseek_v3\): ablate replays through VeOmni's R3 for qwen3_moe, qwen3_5_moe only"),
    ({"mlp_only_layers": [0]}, r"has dense decoder layers \(mlp_only_layers=\[0\]"),
    ({"num_experts_per_tok": 1}, "routes top-1: VeOmni's R3 tells unrecorded routes"),
])
def test_a_model_veomnis_r3_does_not_cover_is_refused(tmp_path, fields, message):
    path = model_folder(tmp_path, **fields)
    config = composed(veomni_settings(), f"actor_rollout_ref.model.path={path}")
    with pytest.raises(VerlLaunchError, match=message):
        check_cell_config(config, "random", engine="veomni")
    covered = model_folder(tmp_path / "covered")
    check_cell_config(composed(veomni_settings(), f"actor_rollout_ref.model.path={covered}"), "random", engine="veomni")


def test_one_veomni_rank_on_a_cpu_is_refused():
    config = compose(EXAMPLES, "ablate_ppo_cpu", [*verl_overrides(veomni_settings()), *MODEL, "trainer.n_gpus_per_node=1"])
    with pytest.raises(VerlLaunchError, match="VeOmni shards with FSDP2 from two data-parallel ranks on"):
        check_cell_config(config, "random", engine="veomni")
    check_cell_config(compose(EXAMPLES, "ablate_ppo_cpu", [*verl_overrides(veomni_settings()), *MODEL]), "random",
                      engine="veomni")


def test_the_engines_package_is_checked_before_launch(monkeypatch):
    import importlib.metadata

    from ablate.backends.verl.launch import check_engine

    check_engine("megatron")
    check_engine("veomni")
    real = importlib.metadata.version

    def version(name):
        if name == "veomni":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(VerlLaunchError, match=r"^backend.engine=veomni needs veomni 0.1.12 \(REQUIRED_VERL.txt\), but "
                                              r"veomni is not installed"):
        check_engine("veomni")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.11" if name == "veomni" else real(name))
    with pytest.raises(VerlLaunchError, match=r"^veomni==0.1.11 is installed .*: expected veomni==0.1.12 \(REQUIRED_VERL"):
        check_engine("veomni")


VEOMNI_INSTALL_PROBE = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace
    import torch.distributed as dist

    os.environ["ABLATE_VERL_CELL"] = {cell!r}
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ablate.backends.verl.worker")
    from ablate.backends.verl import engines

    report = {{"engines_after_import": sorted(m for m in sys.modules if m.startswith(("veomni", "megatron")))[:3],
              "installed_after_import": engines.active_hook() is not None}}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29673")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from verl.workers.config import VeOmniEngineConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.veomni import transformer_impl

    for name, (engine, mode, forward_only) in {engines!r}.items():
        getattr(transformer_impl, engine)(
            SimpleNamespace(use_remove_padding=True, lora_rank=0),
            VeOmniEngineConfig(router_replay=EngineRouterReplayConfig(mode=mode), forward_only=forward_only), None, None)
        report[name] = engines.active_hook() is not None
    print("REPORT" + json.dumps(report))
""")


def test_the_hook_installs_itself_only_with_an_r3_veomni_actor():
    pytest.importorskip("veomni", reason="VeOmni is not installed here: build the environment with .ci/verl-env.sh")
    engines = {  # built in this order in one process; the actor comes last
        "reference": ("VeOmniEngineWithLMHead", "R3", True),
        "critic": ("VeOmniEngineWithValueHead", "R3", False),
        "actor_without_replay": ("VeOmniEngineWithLMHead", "disabled", False),
        "actor": ("VeOmniEngineWithLMHead", "R3", False),
    }
    code = VEOMNI_INSTALL_PROBE.format(cell=veomni_settings().to_json(), engines=engines)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("REPORT"))[6:])
    assert report == {
        "engines_after_import": [], "installed_after_import": False,
        "reference": False, "critic": False, "actor_without_replay": False, "actor": True,
    }
