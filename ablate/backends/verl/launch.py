"""From one ablation cell to a verl ``main_ppo`` launch.

Every policy runs R3 with :mod:`ablate.replay.hook` choosing per-(token, layer) masks
(``none`` an empty one, ``full`` every recorded route), in the training engine ``backend.engine``
names (:data:`ENGINES`: verl's ``model_engine`` and that engine's own R3 keys). The hook reaches
verl's Ray workers through verl's own extension point ``actor_rollout_ref.model.external_lib``;
the cell's policy, budget and seed reach it as one JSON environment variable of Ray's
``runtime_env``. verl's ``main_ppo`` merges ``ray_kwargs.ray_init.runtime_env`` into
``ray.init``, and Ray accepts only string values there, so every value is passed as a quoted
Hydra string.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ablate.backends.verl.config import ENGINES, VEOMNI_VERSION, VERL_VERSION, VerlEngineSpec
from ablate.backends.verl.cpu import ROLLOUT_NAME as CPU_ROLLOUT_NAME
from ablate.backends.verl.hook_settings import HookSettings
from ablate.config import ConfigError
from ablate.overrides import hydra_string

WORKER_MODULE = "ablate.backends.verl.worker"
ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."
ROLLOUT_ROUTES_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
LOG_PROBS_KEY = "actor_rollout_ref.rollout.calculate_log_probs"
DYNAMIC_CP_KEY = "actor_rollout_ref.actor.megatron.dynamic_context_parallel"
EPOCHS_KEY = "actor_rollout_ref.actor.ppo_epochs"
REMOVE_PADDING_KEY = "actor_rollout_ref.model.use_remove_padding"
#: Rollouts that return ``routed_experts``: vLLM, SGLang and the CPU rollout of ``backend=verl_cpu``.
ROUTE_RECORDING_ROLLOUTS = ("vllm", "sglang", CPU_ROLLOUT_NAME)


#: Model families whose VeOmni modeling calls verl's router replay with softmax routing scores
#: (``veomni.utils.moe_router_replay``, patched ``SparseMoeBlock.forward``), one router per decoder layer.
VEOMNI_R3_MODELS = ("qwen3_moe", "qwen3_5_moe")


class VerlLaunchError(ConfigError):
    """A cell that cannot run on verl, found before anything is launched or written.

    A :class:`~ablate.config.ConfigError`: the command ends with its one line and exit status 2.
    """


def engine_launch(engine) -> VerlEngineSpec:
    """The engine ``backend.engine`` names (a name or :class:`~ablate.backends.verl.config.VerlEngine`)."""
    name = getattr(engine, "value", engine)
    if name not in ENGINES:
        raise VerlLaunchError(f"backend.engine={name}: expected one of {', '.join(ENGINES)}")
    return ENGINES[name]


def seed_overrides(seed: int, engine: str = "megatron") -> list[str]:
    """Every place verl 0.9.1 seeds randomness from the config, set to the cell's seed.

    Without them each cell would sample its rollouts with vLLM's default seed 42 (plus the
    replica number) and shuffle its data and mini-batches with seed 42: seeds would not be
    replicates. SGLang's server takes its seed only through ``engine_kwargs``.
    """
    seed = int(seed)
    return [
        f"data.seed={seed}",
        f"{engine_launch(engine).seed_key}={seed}",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"++actor_rollout_ref.rollout.engine_kwargs.sglang.random_seed={seed}",
        f"reward.reward_model.rollout.seed={seed}",
    ]


def replay_mode(source: str) -> str:
    """verl's ``router_replay.mode`` of a ``replay.source``: R3 replays the rollout's routes, R2 the trainer's own."""
    return "R2" if source == "train" else "R3"


def verl_overrides(settings: HookSettings) -> list[str]:
    """Hydra overrides that make verl's ``ppo_trainer`` config run one ablation cell. Pure.

    Every policy runs R3 with the hook, ``none`` (an empty mask: every route native) and ``full``
    (every recorded route) too, so that each cell measures its routes the same way: the
    ``routing/`` keys of ``none`` are the mismatch replay starts from, and ``full``'s residual
    mismatch shows that replay reached every route. A cell with ``replay.source=train`` runs R2
    instead: the routes the trainer records in its old-log-prob pass are what the hook chooses
    among, and the rollout records none (verl refuses its routes beside R2's).
    """
    engine = engine_launch(settings.engine)
    mode = replay_mode(settings.replay.source)
    return [f"model_engine={engine.name}"] + seed_overrides(settings.seed, engine.name) + [
        f"{engine.mode_key}={mode}", f"{ROLLOUT_ROUTES_KEY}={mode == 'R3'}", *engine.required,
        f"actor_rollout_ref.model.external_lib={WORKER_MODULE}",
        f"{ENV_PREFIX}{HookSettings.ENV}={hydra_string(settings.to_json())}",
    ]


def check_verl(wanted: str = VERL_VERSION) -> str:
    """The installed verl version, or a clear error when it is missing or not the pinned one."""
    return check_package("verl", wanted, "backend=verl")


def check_package(name: str, wanted: str, needed_by: str) -> str:
    """The installed version of ``name``, or one line when it is missing or not ``wanted``."""
    try:
        found = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise VerlLaunchError(
            f"{needed_by} needs {name} {wanted} (REQUIRED_VERL.txt), but {name} is not installed in {sys.executable}: "
            f"install it as REQUIRED_VERL.txt's PIP_INSTALL line says (.ci/verl-env.sh builds such an environment)"
        ) from None
    if found != wanted:
        raise VerlLaunchError(f"{name}=={found} is installed in {sys.executable}: expected {name}=={wanted} "
                              f"(REQUIRED_VERL.txt)")
    return found


def check_engine(engine: str, *, cpu: bool = False) -> None:
    """The engine's own package at its pinned version, and every entry point of the hook where it expects it.

    The entry points are read from the installed sources without importing them
    (:func:`ablate.backends.verl.entry_points.check_sources`): a verl whose function moved fails
    here in one line, before anything is launched or written.
    """
    from ablate.backends.verl.entry_points import EntryPointMissing, check_sources

    launch = engine_launch(engine)
    if launch.name == "veomni":
        check_package("veomni", VEOMNI_VERSION, "backend.engine=veomni")
    try:
        check_sources(launch.name, cpu=cpu)
    except EntryPointMissing as missing:
        raise VerlLaunchError(str(missing)) from None


def check_cell_config(config, policy: str, plugins: Sequence[str] = (), probes: Sequence[str] = (),
                      engine: str = "megatron", source: str = "rollout") -> None:
    """Reject a composed verl config that cannot run ``policy`` as ablate means it on ``engine``.

    ``source`` is the cell's ``replay.source``: ``train`` runs verl's R2 (:func:`check_r2_config`).

    Replay needs the engine ``backend.engine`` names (verl's FSDP, torchtitan and automodel
    engines carry a ``router_replay`` block but replay nothing in verl 0.9.1) and routes recorded
    by a vLLM, SGLang or CPU rollout; VeOmni needs what its R3 needs (:func:`check_veomni_config`).
    The hook needs verl's static micro-batching (not dynamic context parallelism). ``mismatch``
    takes its native routes from a native pass the hook runs in the old-log-prob call, which
    bypass mode skips: with one PPO epoch every
    sequence would first be seen in the update pass and route natively, so the cell would be
    ``none`` under another name. The same holds for every policy that ``needs_native_routes``.
    ``plugins`` are the cell's modules to import before ``policy`` is looked up. ``probes`` (their
    ids) run in the old-log-prob call against the rollout's log-probs (docs/probes.md): they need
    both, and the static micro-batches.
    """
    from omegaconf import OmegaConf

    from ablate.policies import PolicySpec

    traits = PolicySpec(policy, plugins=tuple(plugins)).policy_class
    launch = engine_launch(engine)
    actor = config.actor_rollout_ref.actor
    mode = OmegaConf.select(config, launch.mode_key, default="disabled")
    if mode == "disabled":
        return
    check_strategy(actor.strategy, launch, OmegaConf.select(config, "trainer.device", default="cuda"))
    if source == "train":
        check_r2_config(config, launch, mode, probes)
    elif mode != "R3":
        raise VerlLaunchError(
            f"{launch.mode_key}={mode}: ablate's masks choose among the routes the rollout recorded, which verl "
            f"replays in R3; set {launch.mode_key}=R3")
    elif not config.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        raise VerlLaunchError(
            f"{launch.mode_key}=R3 but {ROLLOUT_ROUTES_KEY}=False: the rollout engine would return no routed_experts"
        )
    elif config.actor_rollout_ref.rollout.name not in ROUTE_RECORDING_ROLLOUTS:
        raise VerlLaunchError(
            f"actor_rollout_ref.rollout.name={config.actor_rollout_ref.rollout.name}: only "
            f"{', '.join(ROUTE_RECORDING_ROLLOUTS)} return routed_experts for R3"
        )
    if launch.name == "veomni":
        check_veomni_config(config)
    if probes:
        check_probe_config(config, probes)
    if traits.fixed_budget is not None:  # a fixed mask (no route, or every route): nothing to select per micro-batch
        return
    if OmegaConf.select(config, DYNAMIC_CP_KEY, default=False):
        raise VerlLaunchError(
            f"{DYNAMIC_CP_KEY}=True with policy={policy}: the replay-mask hook follows verl's static "
            f"micro-batches; set {DYNAMIC_CP_KEY}=False"
        )
    if traits.needs_native_routes and OmegaConf.select(config, BYPASS_KEY, default=False):
        raise VerlLaunchError(
            f"policy={policy} with {BYPASS_KEY}=True: {policy} selects on the native routes of the "
            "old-log-prob pass, which bypass mode skips, so it would replay nothing; set "
            f"{BYPASS_KEY}=False or choose another policy"
        )


def check_r2_config(config, launch: VerlEngineSpec, mode: str, probes: Sequence[str]) -> None:
    """What verl refuses of R2 (``replay.source=train``), and what the hook cannot do in it, refused in one line."""
    from omegaconf import OmegaConf

    if mode != "R2":
        raise VerlLaunchError(
            f"{launch.mode_key}={mode} with replay.source=train: R2 replays the routes the trainer records in its "
            f"old-log-prob pass, which verl does in router_replay.mode=R2; set {launch.mode_key}=R2")
    if OmegaConf.select(config, BYPASS_KEY, default=False):
        raise VerlLaunchError(
            f"replay.source=train with {BYPASS_KEY}=True: R2 records the trainer's routes in the old-log-prob pass, "
            f"which bypass mode skips (verl refuses router_replay.mode=R2 with bypass mode); set {BYPASS_KEY}=False "
            "or replay.source=rollout")
    if config.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        raise VerlLaunchError(
            f"{ROLLOUT_ROUTES_KEY}=True with replay.source=train: verl refuses the rollout's routes beside the ones "
            "R2 records (they would meet in one batch); set it False")
    if probes:
        raise VerlLaunchError(
            f"probes=[{','.join(probes)}] with replay.source=train: probes replay masks of the rollout's routes, "
            "which the rollout does not record under R2; drop the probes or use replay.source=rollout")


def check_strategy(strategy: str, launch: VerlEngineSpec, device: str) -> None:
    """The actor's strategy must be the engine ablate launches: the others replay no route."""
    if strategy == launch.strategy and not (launch.name == "megatron" and device == "npu"):
        return
    if strategy == launch.strategy:  # Megatron on NPU is verl's MindSpeed engine
        raise VerlLaunchError(
            "trainer.device=npu with backend.engine=megatron: verl's MindSpeed engine is not one ablate's hook "
            "replays through (Megatron on CUDA and VeOmni only); run the cell on CUDA")
    other = next((name for name, known in ENGINES.items() if known.strategy == strategy), None)
    if other is not None:
        raise VerlLaunchError(
            f"actor_rollout_ref.actor.strategy={strategy} with backend.engine={launch.name}: set "
            f"backend.engine={other} to run the {ENGINES[other].title} engine")
    raise VerlLaunchError(
        f"actor_rollout_ref.actor.strategy={strategy}: verl 0.9.1's {strategy} engine carries the router_replay "
        "block but replays no route; ablate replays through the Megatron engine (backend.engine=megatron) or "
        "the VeOmni engine (backend.engine=veomni), which set the strategy themselves")


def check_veomni_config(config) -> None:
    """What verl's VeOmni engine or VeOmni itself would refuse later, refused before anything is written."""
    from omegaconf import OmegaConf

    actor = config.actor_rollout_ref.actor
    if not OmegaConf.select(actor, "use_remove_padding", default=False):
        raise VerlLaunchError(
            f"{REMOVE_PADDING_KEY}=False with backend.engine=veomni: verl's VeOmni engine replays routes in the "
            "packed order of input_ids only (VeOmniActorConfig refuses R3 without it); set it True")
    ulysses = int(OmegaConf.select(actor, "veomni.ulysses_parallel_size", default=1))
    attention = str(OmegaConf.select(actor, "veomni.attn_implementation", default=""))
    if ulysses > 1 and not attention.endswith("_with_sp"):
        raise VerlLaunchError(
            f"actor_rollout_ref.actor.veomni.ulysses_parallel_size={ulysses} with attn_implementation={attention}: "
            "VeOmni's Ulysses sequence parallelism needs a veomni_*_with_sp attention; each rank would attend "
            "to its own slice of the sequence only")
    ranks = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if OmegaConf.select(config, "trainer.device", default="cuda") == "cpu" and ranks // ulysses < 2:
        raise VerlLaunchError(
            f"trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} with backend.engine=veomni on a CPU: VeOmni "
            "shards with FSDP2 from two data-parallel ranks on, and builds one rank as DDP, which needs CUDA "
            "(init_device=meta); use two ranks")
    check_veomni_model(str(config.actor_rollout_ref.model.path))


def check_veomni_model(path: str) -> None:
    """A local model VeOmni's R3 does not cover, refused; a hub id is checked by VeOmni when it loads it."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        return
    model = json.loads(config_file.read_text())
    text = model.get("text_config") or model
    model_type = model.get("model_type")
    named = f"actor_rollout_ref.model.path={path} (model_type={model_type})"
    if model_type not in VEOMNI_R3_MODELS:
        raise VerlLaunchError(
            f"{named}: ablate replays through VeOmni's R3 for {', '.join(VEOMNI_R3_MODELS)} only (their MoE "
            "blocks hand verl's router replay softmax routing scores, one router per decoder layer)")
    dense = text.get("mlp_only_layers") or []
    if dense or int(text.get("decoder_sparse_step") or 1) != 1:
        raise VerlLaunchError(
            f"{named} has dense decoder layers (mlp_only_layers={dense}, decoder_sparse_step="
            f"{text.get('decoder_sparse_step')}): VeOmni's R3 gives route slot i to the i-th router to fire, "
            "so with dense layers every later layer would replay another layer's routes (verl stops such a "
            "run after its first forward)")
    if int(text.get("num_experts_per_tok") or 0) < 2:
        raise VerlLaunchError(
            f"{named} routes top-{text.get('num_experts_per_tok')}: VeOmni's R3 tells unrecorded routes (zeros) "
            "from recorded ones by duplicate ids, which top-1 cannot have")


def check_probe_config(config, probes: Sequence[str]) -> None:
    from omegaconf import OmegaConf

    named = f"probes=[{','.join(probes)}]"
    if OmegaConf.select(config, BYPASS_KEY, default=False):
        raise VerlLaunchError(f"{named} with {BYPASS_KEY}=True: probes run in the old-log-prob pass, which bypass mode "
                              f"skips, so none would be scored; set {BYPASS_KEY}=False or drop the probes")
    if not OmegaConf.select(config, LOG_PROBS_KEY, default=False):
        raise VerlLaunchError(f"{named} with {LOG_PROBS_KEY}=False: probes compare with the rollout's log-probs, which "
                              f"the rollout then does not return; set {LOG_PROBS_KEY}=True")
    if OmegaConf.select(config, DYNAMIC_CP_KEY, default=False):
        raise VerlLaunchError(f"{named} with {DYNAMIC_CP_KEY}=True: probe passes follow verl's static micro-batches; "
                              f"set {DYNAMIC_CP_KEY}=False")


def update_epochs(config) -> int:
    """How many update passes verl makes over each sequence of a step (``ppo_epochs``)."""
    epochs = config.actor_rollout_ref.actor.ppo_epochs
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise VerlLaunchError(f"{EPOCHS_KEY}={epochs!r}: expected a positive integer")
    return epochs


def compose(config_dir: str | Path, config_name: str, overrides: Sequence[str]):
    """verl's config extended by ``config_dir/config_name`` with ``overrides``, as main_ppo sees it.

    An override verl's config refuses (a key it does not have, a choice it does not offer, text
    Hydra cannot read) is a :class:`VerlLaunchError` naming the override and verl's reason.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup
    from omegaconf.errors import OmegaConfBaseException

    # Inside ``python -m ablate`` Hydra's global state belongs to the running app, and
    # initialize_config_dir refuses to start a second one: set the app's state aside for the
    # length of this compose and give it back after, as Hydra's own initialize contexts do.
    running_app = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise VerlLaunchError(refused_override(error, overrides, config_name)) from None
    finally:
        restore_gh_from_backup(running_app)


def refused_override(error: Exception, overrides: Sequence[str], config_name: str) -> str:
    """One line for a composition of verl's config that failed: the override it names, and why."""
    # Hydra's reason runs over several lines, and a missing choice lists the search path after it.
    reason = " ".join(str(error).split("\nConfig search path")[0].split())
    by_key = [o for o in overrides if f"'{o.lstrip('+~').split('=', 1)[0]}" in reason]
    by_text = [o for o in overrides if o.partition("=")[2] and o.partition("=")[2] in reason]
    named = by_key or by_text  # the user's overrides come after ablate's own: the last one is the likelier
    where = f"backend.overrides: {named[-1]}" if named else f"backend.overrides={list(overrides)}"
    return f"{where}: verl's config {config_name} refuses it ({reason})"


def check_resources(config, *, model_made_by_ablate: bool) -> None:
    """What the cell's GPUs and disk must hold, which neither verl's config nor a dry run checks.

    The model: a path written as a path (``/``, ``./``, ``../``, ``~``) must be a folder here; a
    hub id (``org/name``) is verl's to download. Megatron's parallel layout: the GPUs
    (``trainer.n_gpus_per_node`` x ``trainer.nnodes``) must be a multiple of tensor x pipeline x
    context parallel sizes, and of expert-tensor x expert x pipeline sizes
    (``megatron.core.parallel_state.initialize_model_parallel``), which verl checks only without
    dynamic batch sizes, and Megatron on the GPUs once the model is built.
    """
    from omegaconf import OmegaConf

    path = str(config.actor_rollout_ref.model.path)
    if not model_made_by_ablate and path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise VerlLaunchError(f"actor_rollout_ref.model.path={path}: no such folder; expected a local model folder "
                              "or a hub id (org/name) that verl downloads")
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    for role in ("actor", "ref"):
        key = f"actor_rollout_ref.{role}.megatron"
        if OmegaConf.select(config, f"actor_rollout_ref.{role}.strategy", default=None) != "megatron":
            continue
        sizes = {name: OmegaConf.select(config, f"{key}.{name}", default=None) for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "expert_tensor_parallel_size")}
        tp, pp, cp = (int(sizes[name] or 1) for name in list(sizes)[:3])
        ep, etp = int(sizes["expert_model_parallel_size"] or 1), int(sizes["expert_tensor_parallel_size"] or tp)
        for group, product in ((f"tensor ({tp}) x pipeline ({pp}) x context ({cp})", tp * pp * cp),
                               (f"expert tensor ({etp}) x expert ({ep}) x pipeline ({pp})", etp * ep * pp)):
            if gpus % product:
                raise VerlLaunchError(
                    f"{key}: {group} parallel sizes = {product} do not divide the {gpus} GPUs of trainer.n_gpus_per_node"
                    f" x trainer.nnodes; Megatron would refuse the layout once the workers start")


__all__ = [
    "VERL_VERSION",
    "VerlLaunchError",
    "ENGINES",
    "check_cell_config",
    "check_engine",
    "check_resources",
    "check_verl",
    "compose",
    "hydra_string",
    "seed_overrides",
    "update_epochs",
    "verl_overrides",
]
