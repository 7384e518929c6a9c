"""From one ablation cell to a verl ``main_ppo`` launch.

Every policy runs R3 with :mod:`ablate.backends.verl.hook` choosing per-(token, layer) masks
(``none`` an empty one, ``full`` every recorded route). The hook reaches
verl's Ray workers through verl's own extension point ``actor_rollout_ref.model.external_lib``;
the cell's policy, budget and seed reach it as one JSON environment variable of Ray's
``runtime_env``. verl's ``main_ppo`` merges ``ray_kwargs.ray_init.runtime_env`` into
``ray.init``, and Ray accepts only string values there, so every value is passed as a quoted
Hydra string.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path

from ablate.backends.verl.cpu import ROLLOUT_NAME as CPU_ROLLOUT_NAME
from ablate.backends.verl.hook import HookSettings
from ablate.config import ConfigError
from ablate.overrides import hydra_string

#: The verl release the hook is written against. REQUIRED_VERL.txt, at the top of the repository,
#: declares the same pin in verl-recipe's format (a test keeps the two equal); the constant is
#: what an installed package, which carries no repository files, checks against.
VERL_VERSION = "0.9.1"
WORKER_MODULE = "ablate.backends.verl.worker"
ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."
MODE_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"
ROLLOUT_ROUTES_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
LOG_PROBS_KEY = "actor_rollout_ref.rollout.calculate_log_probs"
DYNAMIC_CP_KEY = "actor_rollout_ref.actor.megatron.dynamic_context_parallel"
EPOCHS_KEY = "actor_rollout_ref.actor.ppo_epochs"
#: Rollouts that return ``routed_experts``: vLLM, SGLang and the CPU rollout of ``backend=verl_cpu``.
ROUTE_RECORDING_ROLLOUTS = ("vllm", "sglang", CPU_ROLLOUT_NAME)


class VerlLaunchError(ConfigError):
    """A cell that cannot run on verl, found before anything is launched or written.

    A :class:`~ablate.config.ConfigError`: the command ends with its one line and exit status 2.
    """


def seed_overrides(seed: int) -> list[str]:
    """Every place verl 0.9.1 seeds randomness from the config, set to the cell's seed.

    Without them each cell would sample its rollouts with vLLM's default seed 42 (plus the
    replica number) and shuffle its data and mini-batches with seed 42: seeds would not be
    replicates. SGLang's server takes its seed only through ``engine_kwargs``.
    """
    seed = int(seed)
    return [
        f"data.seed={seed}",
        f"actor_rollout_ref.actor.megatron.seed={seed}",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"++actor_rollout_ref.rollout.engine_kwargs.sglang.random_seed={seed}",
        f"reward.reward_model.rollout.seed={seed}",
    ]


def verl_overrides(settings: HookSettings) -> list[str]:
    """Hydra overrides that make verl's ``ppo_trainer`` config run one ablation cell. Pure.

    Every policy runs R3 with the hook, ``none`` (an empty mask: every route native) and ``full``
    (every recorded route) too, so that each cell measures its routes the same way: the
    ``routing/`` keys of ``none`` are the mismatch replay starts from, and ``full``'s residual
    mismatch shows that replay reached every route.
    """
    return seed_overrides(settings.seed) + [
        f"{MODE_KEY}=R3", f"{ROLLOUT_ROUTES_KEY}=True",
        f"actor_rollout_ref.model.external_lib={WORKER_MODULE}",
        f"{ENV_PREFIX}{HookSettings.ENV}={hydra_string(settings.to_json())}",
    ]


def check_verl(wanted: str = VERL_VERSION) -> str:
    """The installed verl version, or a clear error when it is missing or not the pinned one."""
    try:
        found = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise VerlLaunchError(
            f"backend=verl needs verl {wanted} (REQUIRED_VERL.txt), but verl is not installed in {sys.executable}: "
            f"install it as REQUIRED_VERL.txt's PIP_INSTALL line says (.ci/verl-env.sh builds such an environment)"
        ) from None
    if found != wanted:
        raise VerlLaunchError(
            f"verl=={found} is installed in {sys.executable}: expected verl=={wanted} (REQUIRED_VERL.txt)"
        )
    return found


def check_cell_config(config, policy: str, plugins: Sequence[str] = (), probes: Sequence[str] = ()) -> None:
    """Reject a composed verl config that cannot run ``policy`` as ablate means it.

    Replay needs the Megatron engine and routes recorded by a vLLM, SGLang or CPU rollout. The hook
    needs verl's static micro-batching (not dynamic context parallelism). ``mismatch`` takes its
    native routes from a native pass the hook runs in the old-log-prob call, which bypass mode
    skips: with one PPO epoch every
    sequence would first be seen in the update pass and route natively, so the cell would be
    ``none`` under another name. The same holds for every policy that ``needs_native_routes``.
    ``plugins`` are the cell's modules to import before ``policy`` is looked up. ``probes`` (their
    ids) run in the old-log-prob call against the rollout's log-probs (docs/probes.md): they need
    both, and the static micro-batches.
    """
    from omegaconf import OmegaConf

    from ablate.policies import PolicySpec

    traits = PolicySpec(policy, plugins=tuple(plugins)).policy_class

    actor = config.actor_rollout_ref.actor
    mode = OmegaConf.select(config, MODE_KEY, default="disabled")
    if mode == "disabled":
        return
    if actor.strategy != "megatron":
        raise VerlLaunchError(
            f"actor_rollout_ref.actor.strategy={actor.strategy}: routing replay needs the Megatron engine "
            "(verl's FSDP engine has no router replay); set actor_rollout_ref.actor.strategy=megatron"
        )
    if mode == "R3" and not config.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        raise VerlLaunchError(
            f"{MODE_KEY}=R3 but {ROLLOUT_ROUTES_KEY}=False: the rollout engine would return no routed_experts"
        )
    if config.actor_rollout_ref.rollout.name not in ROUTE_RECORDING_ROLLOUTS:
        raise VerlLaunchError(
            f"actor_rollout_ref.rollout.name={config.actor_rollout_ref.rollout.name}: only "
            f"{', '.join(ROUTE_RECORDING_ROLLOUTS)} return routed_experts for R3"
        )
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
    """verl's config extended by ``config_dir/config_name`` with ``overrides``, as main_ppo sees it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    # Inside ``python -m ablate`` Hydra's global state belongs to the running app, and
    # initialize_config_dir refuses to start a second one: set the app's state aside for the
    # length of this compose and give it back after, as Hydra's own initialize contexts do.
    running_app = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    finally:
        restore_gh_from_backup(running_app)


__all__ = [
    "VERL_VERSION",
    "VerlLaunchError",
    "check_cell_config",
    "check_verl",
    "compose",
    "hydra_string",
    "seed_overrides",
    "update_epochs",
    "verl_overrides",
]
