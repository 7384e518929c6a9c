"""The environment and verl overrides of a CPU cell's ``main_ppo``.

verl reads ``VERL_USE_EXTERNAL_MODULES`` at ``import verl`` in each of its processes, before it
chooses a platform; Ray's workers inherit the environment of the ``main_ppo`` process that
starts Ray, so setting it there reaches all of them. ``VERL_ENGINE_DEVICE=cuda`` makes verl pick
its Megatron or VeOmni engine, registered for "cuda" (and "npu") only, with the CPU platform
underneath; ``ABLATE_VERL_CPU_ENGINE`` tells the plugin which engine's stand-ins to apply.
"""

from __future__ import annotations

from pathlib import Path

from ablate.backends.verl.cpu import ENGINE_ENV, PLUGIN_MODULE, ROUTER_NOISE_ENV, assets, reward
from ablate.backends.verl.config import VerlCpuConfig


def environment(settings: VerlCpuConfig, engine: str = "megatron") -> dict[str, str]:
    return {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE, "VERL_ENGINE_DEVICE": "cuda",
            ROUTER_NOISE_ENV: repr(float(settings.router_noise)), ENGINE_ENV: engine}


def overrides(settings: VerlCpuConfig, *, make_assets: bool) -> list[str]:
    """verl overrides naming the CPU cell's model, prompts and reward; makes the assets if asked."""
    from ablate.backends.verl.launch import hydra_string

    folder = Path(settings.assets_dir).expanduser() if settings.assets_dir else assets.default_dir()
    where = assets.ensure(folder) if make_assets else assets.paths(folder)
    return [
        f"data.train_files={hydra_string(str(where['train']))}",
        f"data.val_files={hydra_string(str(where['val']))}",
        f"actor_rollout_ref.model.path={hydra_string(str(where['model']))}",
        f"reward.custom_reward_function.path={hydra_string(reward.__file__)}",
        "reward.custom_reward_function.name=compute_score",
    ]
