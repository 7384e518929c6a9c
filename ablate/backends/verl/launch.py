"""From one ablation cell to a verl ``main_ppo`` launch.

``none`` runs verl with router replay disabled, ``full`` runs verl's plain R3, every other policy
runs R3 with :mod:`ablate.backends.verl.hook` choosing per-(token, layer) masks. The hook reaches
verl's Ray workers through verl's own extension point ``actor_rollout_ref.model.external_lib``
(imported by every process that builds the model config); policy, budget, seed and settings reach
it as environment variables of Ray's ``runtime_env``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ablate.budget import FIXED_BUDGETS, check_budget

REQUIRED_VERL = Path(__file__).resolve().parents[3] / "REQUIRED_VERL.txt"
WORKER_MODULE = "ablate.backends.verl.worker"
ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."
MODE_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"
ROLLOUT_ROUTES_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


class VerlLaunchError(RuntimeError):
    """A cell that cannot run on verl, found before anything is launched."""


def verl_overrides(policy: str, budget: float | None, seed: int, settings: Mapping[str, Any] | None = None) -> list[str]:
    """Hydra overrides that make verl's ``ppo_trainer`` config run one ablation cell. Pure."""
    budget = check_budget(budget, policy)
    overrides = [f"actor_rollout_ref.actor.megatron.seed={int(seed)}", f"data.seed={int(seed)}"]
    if policy == "none":
        return overrides + [f"{MODE_KEY}=disabled", f"{ROLLOUT_ROUTES_KEY}=False"]
    overrides += [f"{MODE_KEY}=R3", f"{ROLLOUT_ROUTES_KEY}=True"]
    if policy == "full":
        return overrides
    return overrides + [
        f"actor_rollout_ref.model.external_lib={WORKER_MODULE}",
        f"{ENV_PREFIX}ABLATE_VERL_POLICY={policy}",
        f"{ENV_PREFIX}ABLATE_VERL_BUDGET={budget!r}",
        f"{ENV_PREFIX}ABLATE_VERL_SEED={int(seed)}",
        f"{ENV_PREFIX}ABLATE_VERL_SETTINGS='{json.dumps(dict(settings or {}), sort_keys=True)}'",
    ]


def required_verl(path: Path = REQUIRED_VERL) -> dict[str, str]:
    """The ``KEY=VALUE`` pairs of ``REQUIRED_VERL.txt`` (comments and blank lines skipped)."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def check_verl(path: Path = REQUIRED_VERL) -> str:
    """The installed verl version, or a clear error when it is missing or not the pinned one."""
    wanted = required_verl(path)["TAG"].lstrip("v")
    try:
        found = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise VerlLaunchError(
            f"backend=verl needs verl {wanted} (REQUIRED_VERL.txt), but verl is not installed in {sys.executable}: "
            "run .ci/verl-env.sh or follow PIP_INSTALL in REQUIRED_VERL.txt"
        ) from None
    if found != wanted:
        raise VerlLaunchError(f"verl=={found} is installed in {sys.executable}: expected verl=={wanted} from {path}")
    return found


def check_cell_config(config) -> None:
    """Reject a composed verl config the hook cannot serve (Megatron engine, R3 routes from rollout)."""
    from omegaconf import OmegaConf

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
    if config.actor_rollout_ref.rollout.name not in ("vllm", "sglang"):
        raise VerlLaunchError(
            f"actor_rollout_ref.rollout.name={config.actor_rollout_ref.rollout.name}: only vllm and sglang "
            "return routed_experts for R3"
        )


def compose(config_dir: str | Path, config_name: str, overrides: Sequence[str]):
    """verl's config extended by ``config_dir/config_name`` with ``overrides``, as main_ppo sees it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


__all__ = [
    "FIXED_BUDGETS",
    "VerlLaunchError",
    "check_cell_config",
    "check_verl",
    "compose",
    "required_verl",
    "verl_overrides",
]
