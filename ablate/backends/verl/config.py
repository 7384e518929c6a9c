"""The verl backend as the registry sees it: its settings, its training engines and its :class:`Backend` object.

The launch it makes is :mod:`ablate.backends.verl.backend`, imported when a cell runs or is
checked: composing a config imports this module only (no torch, no verl).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ablate.backends import Backend, deferred
from ablate.config import BackendConfig, Estimator, is_number, require


@dataclass
class VerlCpuConfig:
    """``backend=verl_cpu``: verl's ``main_ppo`` on a CPU (``ablate/backends/verl/cpu``, docs/verl-cpu.md)."""

    #: Standard deviation of the noise on the CPU rollout's router logits (logit units): how far
    #: its routes are from the trainer's. 0 makes them agree up to float rounding.
    router_noise: float = 0.03
    #: Where the tiny model, tokenizer and prompts are made; null: a cache folder in the user's home.
    assets_dir: Optional[str] = None


#: The verl release the hook is written against. REQUIRED_VERL.txt, at the top of the repository,
#: declares the same pin in verl-recipe's format (a test keeps the two equal); the constant is
#: what an installed package, which carries no repository files, checks against.
VERL_VERSION = "0.9.1"
#: The VeOmni release the VeOmni engine is run with. verl 0.9.1's own ``veomni-sft`` extra names
#: 0.1.11, whose Qwen3-MoE modeling (generated against transformers 5.2) fails under the
#: transformers verl 0.9.1 needs (create_causal_mask() got an unexpected keyword argument
#: 'cache_position'); 0.1.12's, generated against transformers 5.9, runs.
VEOMNI_VERSION = "0.1.12"


@dataclass(frozen=True)
class VerlEngineSpec:
    """One of verl's training engines that ablate replays through: what launch, config and worker need of it."""

    name: str
    #: verl's ``actor.strategy`` of the engine.
    strategy: str
    #: what the refusal of another strategy calls the engine.
    title: str
    #: ``module:Class`` of its seam (:class:`ablate.replay.seams.EngineSeam`), imported in verl's actor only.
    seam: str
    #: further keys verl's R3 needs on this engine.
    required: tuple[str, ...] = ()

    @property
    def mode_key(self) -> str:
        return f"actor_rollout_ref.actor.{self.strategy}.router_replay.mode"

    @property
    def seed_key(self) -> str:
        return f"actor_rollout_ref.actor.{self.strategy}.seed"


#: ``backend.engine`` -> its engine: the one table config, launch, the worker and the entry points read.
#: VeOmni's R3 packs routes like ``input_ids`` without padding.
ENGINES = {engine.name: engine for engine in (
    VerlEngineSpec("megatron", "megatron", "Megatron", "ablate.backends.verl.engines.megatron:MegatronSeam"),
    VerlEngineSpec("veomni", "veomni", "VeOmni (FSDP2)", "ablate.backends.verl.engines.veomni:VeOmniSeam",
                   required=("actor_rollout_ref.model.use_remove_padding=True",)),
)}

#: ``backend.engine``'s choices, for Hydra.
VerlEngine = Enum("VerlEngine", {name: name for name in ENGINES}, type=str)


@dataclass
class VerlConfig(BackendConfig):
    """The verl backend: one verl ``main_ppo`` run per cell (see ``ablate/backends/verl``)."""

    name: str = "verl"
    #: verl's training engine (its ``model_engine``): Megatron, or VeOmni (FSDP2).
    engine: VerlEngine = VerlEngine["megatron"]
    config_dir: Optional[str] = None
    config_name: str = "ablate_ppo"
    overrides: list[str] = field(default_factory=list)
    dry_run: bool = False
    #: Set: the cell runs on the CPU stand-in instead of GPUs.
    cpu: Optional[VerlCpuConfig] = None

    def check(self) -> None:
        k = self.KEY
        if self.cpu is not None:
            require(is_number(self.cpu.router_noise) and self.cpu.router_noise >= 0, f"{k}.cpu.router_noise",
                    self.cpu.router_noise, "a finite standard deviation >= 0 (logit units)")
        require(bool(self.config_name), f"{k}.config_name", self.config_name, "the name of a verl config file")
        for override in self.overrides:
            require("=" in override or override.startswith("~"), f"{k}.overrides", list(self.overrides),
                    f"Hydra overrides of verl's config such as trainer.total_training_steps=100, not {override!r}")


BACKEND = Backend(
    name="verl", config=VerlConfig, run=deferred("ablate.backends.verl.backend:run"),
    preflight=deferred("ablate.backends.verl.backend:dry_run_command"),
    # The worker hook measures router-logit gradients only.
    fisher_estimators=(Estimator.router_logits.value,),
    scores_probes=True,   # in the old-log-prob call (ablate/backends/verl/probe_passes.py)
    replay_sources=("rollout", "train"),  # verl's R3 and R2 (router_replay.mode)
    gate_refusal=("ablate's verl seams do not do: verl replays whole routes, and a gate would have to rewrite the "
                  "replayed ids slot by slot where Megatron's RouterReplay.get_replay_topk and VeOmni's "
                  "maybe_replay_indices see the scores"),
)
