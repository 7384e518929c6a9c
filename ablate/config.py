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


class RolloutIS(str, Enum):
    """verl's ``algorithm.rollout_correction.rollout_is``: the level of truncated IS weights."""

    token = "token"
    sequence = "sequence"


@dataclass
class SyntheticConfig(BackendConfig):
    """The synthetic MoE RL backend (``ablate/backends/synthetic.py``).

    The PPO-step settings carry the names of the verl keys they mirror; the defaults are verl's
    defaults where verl has one. Named regimes are YAML files under ``conf/backend/``.
    """

    name: str = "synthetic"
    #: Which named regime (``conf/backend/synthetic*.yaml``) these settings come from.
    regime: str = "default"
    steps: int = 200
    # Task: prompt = a task token and `digits` random digits; the response continues the digits.
    vocab_digits: int = 8
    digits: int = 5
    response_length: int = 5
    tasks: int = 4
    #: From this step on every rule changes (task t counts in steps of t + 1 + tasks); null: never.
    task_shift_step: Optional[int] = None
    # Policy model.
    d_model: int = 32
    heads: int = 2
    layers: int = 6
    experts: int = 8
    topk: int = 2
    expert_hidden: int = 32
    router_temperature: float = 1.0
    # Rollout engine: the same weights, other numerics, possibly older.
    rollout_dtype: str = "bfloat16"
    #: Standard deviation of i.i.d. noise on the engine's router logits (once per position).
    router_noise: float = 0.07
    #: Fixed change of the engine's router weights (logit units): the same tokens misrouted every step.
    router_perturbation: float = 0.0
    #: The engine samples with the weights of this many steps ago (0: synchronous RL).
    rollout_lag: int = 0
    # RL: GRPO advantages, verl's PPO step.
    prompts_per_step: int = 16  # data.train_batch_size
    group_size: int = 8  # actor_rollout_ref.rollout.n
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    #: actor_rollout_ref.actor.ppo_mini_batch_size: prompts per optimizer step (verl: 1024 / 256).
    ppo_mini_batch_size: int = 4
    ppo_epochs: int = 1  # actor_rollout_ref.actor.ppo_epochs
    clip_ratio: float = 0.2  # actor_rollout_ref.actor.clip_ratio
    clip_ratio_c: float = 3.0  # actor_rollout_ref.actor.clip_ratio_c (dual clip)
    #: algorithm.rollout_correction.bypass_mode: false = ratio against old log-probs recomputed
    #: by the trainer (verl's default); true = against the rollout log-probs.
    bypass_mode: bool = False
    #: The mismatch policy takes its ratio against the native pass it selects from, as the verl
    #: backend does, instead of against an old-log-prob pass that replays its mask.
    mismatch_native_old_pass: bool = False
    rollout_is: Optional[RolloutIS] = None  # algorithm.rollout_correction.rollout_is
    rollout_is_threshold: float = 2.0  # algorithm.rollout_correction.rollout_is_threshold
    rollout_is_batch_normalize: bool = False  # algorithm.rollout_correction.rollout_is_batch_normalize
    replay_tokens: ReplayTokens = ReplayTokens.all
    extreme_threshold: float = 2.0
    threads: int = 1

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field (``backend.<field>=value``) that cannot work."""

        def fail(key: str, expected: str) -> None:
            raise ValueError(f"backend.{key}={getattr(self, key)!r}: expected {expected}")

        positive = ("steps", "vocab_digits", "digits", "response_length", "tasks", "d_model", "heads", "layers",
                    "experts", "topk", "expert_hidden", "prompts_per_step", "group_size", "ppo_mini_batch_size",
                    "ppo_epochs", "threads")
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(key, "a positive integer")
        for key in ("router_temperature", "lr", "max_grad_norm", "clip_ratio"):
            if not getattr(self, key) > 0:
                fail(key, "a positive number")
        for key in ("router_noise", "router_perturbation"):
            if not getattr(self, key) >= 0:
                fail(key, "a number >= 0")
        if self.rollout_lag < 0:
            fail("rollout_lag", "a number of steps >= 0")
        if self.group_size < 2:
            fail("group_size", "at least 2 responses per prompt (GRPO normalises within a group)")
        if self.topk > self.experts:
            fail("topk", f"at most experts={self.experts}")
        if self.d_model % self.heads:
            fail("d_model", f"a multiple of heads={self.heads}")
        for key in ("d_model", "expert_hidden"):
            if getattr(self, key) % 8:
                fail(key, "a multiple of 8 (the grouped expert matmul needs 16-byte rows in bfloat16)")
        if self.rollout_dtype not in ("bfloat16", "float16", "float32"):
            fail("rollout_dtype", "one of bfloat16, float16, float32")
        if self.prompts_per_step % self.ppo_mini_batch_size:
            fail("ppo_mini_batch_size", f"a divisor of prompts_per_step={self.prompts_per_step}")
        if not 0 < self.clip_ratio < 1:
            fail("clip_ratio", "a fraction in (0, 1)")
        if not self.clip_ratio_c > 1:
            fail("clip_ratio_c", "a ratio > 1 (verl's dual-clip bound)")
        if not self.rollout_is_threshold > 0:
            fail("rollout_is_threshold", "a positive upper bound for the importance weights")
        if self.rollout_is is not None and self.bypass_mode:
            fail("rollout_is", "null with bypass_mode=true: verl's bypass ppo_clip loss applies no IS weights")
        if self.task_shift_step is not None:
            if not 0 < self.task_shift_step < self.steps:
                fail("task_shift_step", f"a step in (0, steps={self.steps}) or null")
            if 2 * self.tasks > self.vocab_digits:
                fail("tasks", f"at most vocab_digits / 2 = {self.vocab_digits // 2} with a task shift, so every new rule differs from every old one")
        if not self.extreme_threshold > 1:
            fail("extreme_threshold", "a ratio > 1")


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
