"""Structured configs: the schema of every Hydra config, and the check of every value.

Two layers of validation, both before a cell writes anything:

- Composition. The dataclasses are registered in Hydra's ConfigStore as ``base_*`` schemas that
  the YAML files under ``conf/`` (packaged as ``ablate.conf``) extend (``defaults: [/base_fisher@_here_]``), so a
  misspelt key or a value of the wrong type fails when Hydra composes the config. Enums turn a
  bad choice (``tracking.mode=ofline``) into an error listing the valid ones. The schemas sit at
  the root of the ConfigStore, outside the ``policy`` and ``backend`` groups, so that ``--help``
  and tab completion offer only the real choices.
- Values. Every dataclass has a ``check()`` that raises :class:`ConfigError` naming the config
  key, its value and what was expected (``backend.topk=9: expected an integer in [1, 8]
  (backend.experts)``). :func:`ablate.cell.cell_from_config` calls :meth:`AppConfig.check`,
  which checks every section.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that cannot describe a cell: names the key, the value and what was expected."""


def choice_value(choice: Enum | str) -> str:
    """The string behind a config choice: an enum member from a typed node, or a plain string."""
    return choice.value if isinstance(choice, Enum) else choice


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise ``ConfigError("key=value: expected ...")`` unless ``ok``."""
    if not ok:
        shown = choice_value(value) if isinstance(value, Enum) else value
        raise ConfigError(f"{key}={shown}: expected {expected}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_int(key: str, value: Any, low: int, high: int | None = None, high_name: str = "") -> None:
    """An integer in ``[low, high]`` (``high_name`` says where the bound comes from)."""
    bound = f"[{low}, {high}]" + (f" ({high_name})" if high_name else "") if high is not None else f">= {low}"
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    require(ok, key, value, f"an integer {'in ' if high is not None else ''}{bound}")


def require_positive(key: str, value: Any) -> None:
    require(is_number(value) and value > 0, key, value, "a finite number > 0")


# The rules below are each checked in one place and worded once: by the config schema here, and
# by the library objects (the Fisher tracker, the fisher policy) that take the same values in code.

#: An EMA decay across steps: 0 keeps only the last step; 1 would never update (and the bias
#: correction ``1 - decay**t`` would divide by zero), so it is excluded.
EMA_DECAY = "an EMA decay in [0, 1)"


def is_ema_decay(value: Any) -> bool:
    return is_number(value) and 0.0 <= value < 1.0


#: A sampling temperature (the fisher policy's ``tau``): 0 is deterministic top-n.
TEMPERATURE = "a finite temperature >= 0"


def is_temperature(value: Any) -> bool:
    return is_number(value) and value >= 0


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

    KEY: ClassVar[str] = "policy.fisher"

    estimator: Estimator = Estimator.router_logits
    #: EMA decay across steps (:data:`EMA_DECAY`).
    decay: float = 0.9
    normalize: Normalization = Normalization["none"]  # type: ignore[valid-type]

    def check(self) -> None:
        require(is_ema_decay(self.decay), f"{self.KEY}.decay", self.decay, EMA_DECAY)


@dataclass
class PolicyConfig:
    """Fields every policy has. ``name`` is the registered policy name."""

    name: str = MISSING
    fisher: FisherEstimateConfig = field(default_factory=FisherEstimateConfig)

    def check(self) -> None:
        self.fisher.check()


@dataclass
class BudgetedPolicyConfig(PolicyConfig):
    per_layer: bool = False


@dataclass
class FisherPolicyConfig(BudgetedPolicyConfig):
    name: str = "fisher"
    tau: float = 0.0

    def check(self) -> None:
        super().check()
        require(is_temperature(self.tau), "policy.tau", self.tau, TEMPERATURE)


# --- backends -----------------------------------------------------------------------------


@dataclass
class BackendConfig:
    KEY: ClassVar[str] = "backend"

    name: str = MISSING

    def check(self) -> None:
        """Each backend checks its own settings; the base has none beyond its name."""


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


@dataclass
class NoopConfig(BackendConfig):
    """A backend that does no work (``ablate/backends/noop.py``): overhead benchmarks, sweep tests."""

    name: str = "noop"
    steps: int = 1
    reward: float = 0.0
    fail_seeds: list[int] = field(default_factory=list)
    fail_at_step: int = 0
    #: Seconds each step sleeps: lets tests interrupt or kill a sweep in the middle of a cell.
    step_seconds: float = 0.0

    def check(self) -> None:
        k = self.KEY
        require_int(f"{k}.steps", self.steps, 1)
        require(is_number(self.reward), f"{k}.reward", self.reward, "a finite number")
        require_int(f"{k}.fail_at_step", self.fail_at_step, 0, self.steps - 1, f"{k}.steps={self.steps}")
        require(is_number(self.step_seconds) and self.step_seconds >= 0, f"{k}.step_seconds", self.step_seconds,
                "a finite number of seconds >= 0")


@dataclass
class VerlCpuConfig:
    """``backend=verl_cpu``: verl's ``main_ppo`` on a CPU (``ablate/backends/verl/cpu``, docs/verl-cpu.md)."""

    #: Standard deviation of the noise on the CPU rollout's router logits (logit units): how far
    #: its routes are from the trainer's. 0 makes them agree up to float rounding.
    router_noise: float = 0.03
    #: Where the tiny model, tokenizer and prompts are made; null: a cache folder in the user's home.
    assets_dir: Optional[str] = None


@dataclass
class VerlConfig(BackendConfig):
    """The verl backend: one verl ``main_ppo`` run per cell (see ``ablate/backends/verl``)."""

    name: str = "verl"
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


# --- tracking and the whole app -----------------------------------------------------------


@dataclass
class TrackingConfig:
    KEY: ClassVar[str] = "tracking"

    mode: TrackingMode = TrackingMode.offline
    project: str = "ablate"
    entity: Optional[str] = None
    #: A tag or a list of tags (``tracking.tags=pilot`` or ``tracking.tags=[pilot,v2]``).
    #: ``Any``: OmegaConf 2.3 has no Union[str, list[str]]; :meth:`tag_list` gives the list.
    tags: Any = field(default_factory=list)
    #: Seconds W&B may take to start a run (online: to reach the server) before the cell gives up
    #: on it; an online run that cannot start continues offline, ready for ``wandb sync``.
    init_timeout: float = 10.0
    progress: bool = True

    def tag_list(self) -> list[str]:
        return [self.tags] if isinstance(self.tags, str) else list(self.tags)

    def check(self) -> None:
        k = self.KEY
        require(bool(self.project) and "/" not in self.project, f"{k}.project", self.project,
                "a W&B project name (no '/')")
        tags = self.tags if isinstance(self.tags, (str, list, tuple)) else None
        require(tags is not None and all(isinstance(t, str) and t for t in self.tag_list()), f"{k}.tags", self.tags,
                "a tag or a list of tags, e.g. tracking.tags=pilot or tracking.tags=[pilot,v2]")
        require_positive(f"{k}.init_timeout", self.init_timeout)


#: The largest cell seed: vLLM, SGLang and numpy's legacy seeding take 32-bit seeds, and the synthetic
#: backend derives its streams' seeds from it (``seed * 7919 + k``) within torch's 64-bit range.
MAX_SEED = 2**31 - 1


@dataclass
class AnalysisConfig:
    """What the sweep asks of its analysis; read by ``ablate-analyze``, never by a cell."""

    KEY: ClassVar[str] = "analysis"

    #: Ordered primary questions (effect-row selectors such as ``replay`` or
    #: ``selection:fisher:random@pooled``), tested by serial gatekeeping before the exploratory
    #: rows; ``ablate-analyze --primary`` replaces them (docs/statistics.md).
    primary: list[str] = field(default_factory=list)

    def check(self) -> None:
        require(all(isinstance(text, str) and text for text in self.primary), f"{self.KEY}.primary", self.primary,
                "a list of effect-row selectors, e.g. [replay, 'selection:fisher:random@pooled']")


@dataclass
class AppConfig:
    backend: BackendConfig = MISSING
    policy: PolicyConfig = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
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
    #: Optuna trial number when the cell is a trial of a study.
    trial: Optional[int] = None
    #: Modules to import before the policy is looked up, in every process that builds it: a policy
    #: of your own whose package is not installed (``plugins=[my_policies]``). An installed package
    #: needs no entry here: its entry point (group ``ablate.policies``) is found by itself.
    plugins: list[str] = field(default_factory=list)
    #: Counterfactual replay probes scored on probed steps (docs/probes.md): ``random@0.25``,
    #: ``fisher@0.25:tau=1.0`` or ``{policy, budget, settings}``; checked by ``ablate.probes``.
    #: ``Any``: OmegaConf 2.3 has no list of Union[str, dict].
    probes: Any = field(default_factory=list)
    #: Probe every N-th step (steps 0, N, 2N, ...). The default keeps six probes within 10% of a
    #: synthetic cell's time (bench/bench_probes.py).
    probe_every: int = 10

    def check(self) -> None:
        """Every section and every top-level value (the budget is checked with its policy, the
        objective with the outcomes: :func:`ablate.analysis.outcomes.check_objective`)."""
        from ablate.backends import backend_names

        # A misspelt backend.name composes (the field is a string) but has nothing to run the cell.
        require(self.backend.name in backend_names(), "backend.name", self.backend.name,
                f"one of {', '.join(backend_names())} (choose a backend with backend=<name>)")
        self.backend.check()
        self.policy.check()
        self.tracking.check()
        self.analysis.check()
        require_int("seed", self.seed, 0, MAX_SEED, "2**31 - 1, the largest seed every backend's generators take")
        if self.trial is not None:
            require_int("trial", self.trial, 0)
        require(bool(self.store_dir), "store_dir", self.store_dir, "a directory for the run store")
        check_sweep_name(self.sweep)
        if self.backend.name == "verl":  # the verl hook measures router-logit gradients only
            estimator = choice_value(self.policy.fisher.estimator)
            require(estimator == "router_logits", "policy.fisher.estimator", estimator,
                    "router_logits with backend=verl (its hook measures router-logit gradients only)")


#: A sweep name is one directory of the run store and a W&B group: one path component that can
#: neither climb out of the store (``..``, ``/abs``) nor land in its root (``''``, ``.``).
SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]{0,127}")


def check_sweep_name(name: Any) -> str:
    require(isinstance(name, str) and SWEEP_NAME.fullmatch(name) is not None and ".." not in name, "sweep",
            repr(name), "one directory name of at most 128 letters, digits and . _ - = + , starting with a "
            "letter or digit")
    return name


def register_configs() -> None:
    """Register the schemas as root-level ``base_*`` configs (idempotent).

    Root level, not inside the ``policy``/``backend`` groups: a schema in a group would be offered
    as a choice (``policy=base_fisher``) by ``--help`` and tab completion.
    """
    store = ConfigStore.instance()
    for name, node in (
        ("base_config", AppConfig), ("base_policy", PolicyConfig), ("base_budgeted_policy", BudgetedPolicyConfig),
        ("base_fisher", FisherPolicyConfig), ("base_synthetic", SyntheticConfig), ("base_verl", VerlConfig),
        ("base_noop", NoopConfig),
    ):
        store.store(name=name, node=node)
