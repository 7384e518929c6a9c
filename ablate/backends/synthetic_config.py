"""The synthetic backend as the registry sees it: its settings and its :class:`Backend` object.

The training loop it runs is :mod:`ablate.backends.synthetic` (torch), imported when a cell runs:
composing a config imports this module only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from ablate.backends import Backend, deferred
from ablate.config import BackendConfig, is_number, require, require_int, require_positive


class ReplayTokens(str, Enum):
    all = "all"
    response = "response"


ROLLOUT_DTYPES = ("float32", "float16", "bfloat16")


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
    #: The mismatch policy takes its ratio against the native pass it selects from (the verl
    #: backend did so at first), instead of against an old-log-prob pass that replays its mask.
    mismatch_native_old_pass: bool = False
    rollout_is: Optional[RolloutIS] = None  # algorithm.rollout_correction.rollout_is
    rollout_is_threshold: float = 2.0  # algorithm.rollout_correction.rollout_is_threshold
    rollout_is_batch_normalize: bool = False  # algorithm.rollout_correction.rollout_is_batch_normalize
    replay_tokens: ReplayTokens = ReplayTokens.all
    extreme_threshold: float = 2.0
    threads: int = 1

    def check(self) -> None:
        """Every field, named ``backend.<field>=value``, before the cell writes anything."""
        k = self.KEY
        for name in ("steps", "digits", "response_length", "tasks", "layers", "experts", "d_model", "heads",
                     "expert_hidden", "prompts_per_step", "ppo_mini_batch_size", "ppo_epochs", "threads"):
            require_int(f"{k}.{name}", getattr(self, name), 1)
        require_int(f"{k}.vocab_digits", self.vocab_digits, 2)
        require_int(f"{k}.topk", self.topk, 1, self.experts, f"{k}.experts")
        require_int(f"{k}.rollout_lag", self.rollout_lag, 0)
        require(self.d_model % self.heads == 0, f"{k}.d_model", self.d_model,
                f"a multiple of {k}.heads={self.heads} (each attention head gets d_model / heads dimensions)")
        for name in ("d_model", "expert_hidden"):
            require(getattr(self, name) % 8 == 0, f"{k}.{name}", getattr(self, name),
                    "a multiple of 8 (the grouped expert matmul needs 16-byte rows in bfloat16)")
        # GRPO normalises rewards within a group: one sample has no spread.
        require_int(f"{k}.group_size", self.group_size, 2)
        require(self.prompts_per_step % self.ppo_mini_batch_size == 0, f"{k}.ppo_mini_batch_size",
                self.ppo_mini_batch_size, f"a divisor of {k}.prompts_per_step={self.prompts_per_step}")
        require(self.rollout_dtype in ROLLOUT_DTYPES, f"{k}.rollout_dtype", self.rollout_dtype,
                f"one of {', '.join(ROLLOUT_DTYPES)}")
        for name in ("router_temperature", "lr", "max_grad_norm", "rollout_is_threshold"):
            require_positive(f"{k}.{name}", getattr(self, name))
        require(is_number(self.router_noise) and self.router_noise >= 0, f"{k}.router_noise", self.router_noise,
                "a finite standard deviation >= 0")
        require(is_number(self.router_perturbation) and self.router_perturbation >= 0, f"{k}.router_perturbation",
                self.router_perturbation, "a finite scale >= 0 (logit units)")
        require(is_number(self.clip_ratio) and 0 < self.clip_ratio < 1, f"{k}.clip_ratio", self.clip_ratio,
                "a fraction in (0, 1)")
        require(is_number(self.clip_ratio_c) and self.clip_ratio_c > 1, f"{k}.clip_ratio_c", self.clip_ratio_c,
                "a ratio > 1 (verl's dual-clip bound)")
        require(self.rollout_is is None or not self.bypass_mode, f"{k}.rollout_is", self.rollout_is,
                f"null with {k}.bypass_mode=true: verl's bypass ppo_clip loss applies no IS weights")
        if self.task_shift_step is not None:
            require_int(f"{k}.task_shift_step", self.task_shift_step, 1, self.steps - 1, f"{k}.steps - 1")
            require(2 * self.tasks <= self.vocab_digits, f"{k}.tasks", self.tasks,
                    f"at most {k}.vocab_digits / 2 = {self.vocab_digits // 2} with a task shift, "
                    "so every new rule differs from every old one")
        require(is_number(self.extreme_threshold) and self.extreme_threshold > 1, f"{k}.extreme_threshold",
                self.extreme_threshold, "a finite ratio > 1 (a token is extreme when max(r, 1/r) exceeds it)")


BACKEND = Backend(name="synthetic", config=SyntheticConfig, run=deferred("ablate.backends.synthetic:run"),
                  scores_probes=True, replay_sources=("rollout", "train"), replays_gate_weights=True, gates_slots=True)
