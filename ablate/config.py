"""Structured configs: the schema of every Hydra config, registered in the ConfigStore.

YAML files under ``conf/`` extend these (``defaults: [base_fisher]``), so a misspelt key or a
value of the wrong type fails when Hydra composes the config, before any cell starts. Enums
turn a bad choice (``tracking.mode=ofline``) into an error listing the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


def choice_value(choice: Enum | str) -> str:
    """The string behind a config choice: an enum member from a typed node, or a plain string."""
    return choice.value if isinstance(choice, Enum) else choice


class TrackingMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class Estimator(str, Enum):
    router_logits = "router_logits"
    expert_outputs = "expert_outputs"
    expert_params = "expert_params"


# "global" is a Python keyword, so this enum is built functionally: OmegaConf matches members by
# name, and ``policy.fisher.normalize=global`` must work.
Normalization = Enum("Normalization", {"none": "none", "layer": "layer", "global": "global"}, type=str)


class ReplayTokens(str, Enum):
    all = "all"
    response = "response"


# --- policies -----------------------------------------------------------------------------


@dataclass
class FisherEstimateConfig:
    """How the per-(layer, expert) Fisher estimate is built (every policy logs its mass)."""

    estimator: Estimator = Estimator.router_logits
    decay: float = 0.9
    normalize: Normalization = Normalization["none"]  # type: ignore[valid-type]


@dataclass
class PolicyConfig:
    """Fields every policy has. ``name`` is the registered policy name."""

    name: str = MISSING
    fisher: FisherEstimateConfig = field(default_factory=FisherEstimateConfig)


@dataclass
class BudgetedPolicyConfig(PolicyConfig):
    per_layer: bool = False


@dataclass
class FisherPolicyConfig(BudgetedPolicyConfig):
    name: str = "fisher"
    tau: float = 0.0


# --- backends -----------------------------------------------------------------------------


@dataclass
class BackendConfig:
    name: str = MISSING


@dataclass
class SyntheticConfig(BackendConfig):
    """The synthetic MoE RL backend (``ablate/backends/synthetic.py``); defaults are calibrated."""

    name: str = "synthetic"
    steps: int = 200
    # Task: prompt = a task token and `digits` random digits; the response must transform them.
    vocab_digits: int = 8
    digits: int = 5
    tasks: int = 4
    # Policy model.
    d_model: int = 32
    heads: int = 2
    layers: int = 6
    experts: int = 8
    topk: int = 2
    expert_hidden: int = 32
    router_temperature: float = 1.0
    # Rollout engine: the same weights, other numerics.
    rollout_dtype: str = "bfloat16"
    router_noise: float = 0.07
    # RL.
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 3e-3
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    replay_tokens: ReplayTokens = ReplayTokens.all
    extreme_threshold: float = 2.0
    threads: int = 1


@dataclass
class NoopConfig(BackendConfig):
    """A backend that does no work (``ablate/backends/noop.py``): overhead benchmarks, sweep tests."""

    name: str = "noop"
    steps: int = 1
    reward: float = 0.0
    fail_seeds: list[int] = field(default_factory=list)
    fail_at_step: int = 0


@dataclass
class VerlConfig(BackendConfig):
    """The verl backend: one verl ``main_ppo`` run per cell (see ``ablate/backends/verl``)."""

    name: str = "verl"
    config_dir: Optional[str] = None
    config_name: str = "ablate_ppo"
    overrides: list[str] = field(default_factory=list)
    dry_run: bool = False


# --- tracking and the whole app -----------------------------------------------------------


@dataclass
class TrackingConfig:
    mode: TrackingMode = TrackingMode.offline
    project: str = "ablate"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 30.0
    progress: bool = True


@dataclass
class AppConfig:
    backend: BackendConfig = MISSING
    policy: PolicyConfig = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    #: Fraction of valid routes replayed; ``null`` for none/full, which have fixed budgets.
    budget: Optional[float] = None
    seed: int = 0
    #: Name of the sweep: the run store's sub-directory and the W&B group.
    sweep: str = "adhoc"
    #: Root of the run store, relative to the directory the command was started in.
    store_dir: str = "runs"
    #: Outcome returned to Hydra sweepers (see ablate.analysis.outcomes): a summary key, or a list
    #: of keys for a multi-objective study. ``Any``: OmegaConf 2.3 has no Union[str, list[str]].
    objective: Any = "final_reward"
    device: str = "cpu"
    #: Optuna trial number when the cell is a trial of a study.
    trial: Optional[int] = None


def register_configs() -> None:
    """Register the schemas under ``base_*`` names (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=AppConfig)
    store.store(group="policy", name="base_policy", node=PolicyConfig)
    store.store(group="policy", name="base_budgeted_policy", node=BudgetedPolicyConfig)
    store.store(group="policy", name="base_fisher", node=FisherPolicyConfig)
    store.store(group="backend", name="base_synthetic", node=SyntheticConfig)
    store.store(group="backend", name="base_verl", node=VerlConfig)
    store.store(group="backend", name="base_noop", node=NoopConfig)
