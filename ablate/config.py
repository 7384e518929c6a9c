"""Structured configs: the schema of every Hydra config, and the check of every value.

Two layers of validation, both before a cell writes anything:

- Composition. The dataclasses are registered in Hydra's ConfigStore as ``base_*`` schemas that
  the YAML files under ``conf/`` (packaged as ``ablate.conf``) extend (``defaults: [/base_fisher@_here_]``), so a
  misspelt key or a value of the wrong type fails when Hydra composes the config. Enums turn a
  bad choice (``tracking.mode=ofline``) into an error listing the valid ones. The schemas sit at
  the root of the ConfigStore, outside the ``policy`` and ``backend`` groups, so that ``--help``
  and tab completion offer only the real choices. Each backend's config class lives beside its
  backend under ``ablate/backends/`` and is registered there, in the same way.
- Values. Every dataclass has a ``check()`` that raises :class:`ConfigError` naming the config
  key, its value and what was expected (``backend.topk=9: expected an integer in [1, 8]
  (backend.experts)``). :func:`ablate.compose.cell_from_config` calls :meth:`AppConfig.check`,
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


class ReplaySource(str, Enum):
    """Whose routes a replayed route takes: the rollout's (R3) or the trainer's own old-log-prob pass's (R2)."""

    rollout = "rollout"
    train = "train"


class ReplayWeights(str, Enum):
    """The gate weights of a replayed route: recomputed from the trainer's scores (R3), or the rollout's."""

    recompute = "recompute"
    rollout = "rollout"


# "global" is a Python keyword, so this enum is built functionally: OmegaConf matches members by
# name, and ``policy.fisher.normalize=global`` must work.
Normalization = Enum("Normalization", {"none": "none", "layer": "layer", "global": "global"}, type=str)


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


#: The threshold policy's ``ratio``: a share of the trainer's weakest top-k score.
GATE_RATIO = "a ratio in [0, 1] of the trainer's weakest top-k gate score (0: full replay; 1: none that differs)"


def is_gate_ratio(value: Any) -> bool:
    return is_number(value) and 0.0 <= value <= 1.0


@dataclass
class ThresholdPolicyConfig(PolicyConfig):
    name: str = "threshold"
    ratio: float = 0.5

    def check(self) -> None:
        super().check()
        require(is_gate_ratio(self.ratio), "policy.ratio", self.ratio, GATE_RATIO)


# --- replay -------------------------------------------------------------------------------


@dataclass
class ReplayConfig:
    """How a replayed route is replayed (docs/policies.md, "Replay variants"); the policy says which routes.

    Added after cells were first stored: a cell that leaves both at their defaults keeps the
    identity it had before (:func:`ablate.cell.cell_id_of`).
    """

    KEY: ClassVar[str] = "replay"

    #: ``rollout``: the routes the rollout recorded (R3); ``train``: the routes the trainer recorded
    #: in its own old-log-prob pass, which routes natively (R2).
    source: ReplaySource = ReplaySource.rollout
    #: ``recompute``: gate weights from the trainer's router scores over the replayed experts (R3);
    #: ``rollout``: the rollout's own gate weights, recorded with its expert ids.
    weights: ReplayWeights = ReplayWeights.recompute

    def check(self) -> None:
        """The values are typed by their enums; what a policy cannot replay is checked with the policy, where
        the cell's :class:`~ablate.replay.ReplaySpec` is built."""


# --- backends -----------------------------------------------------------------------------


@dataclass
class BackendConfig:
    """Fields every backend has: the base of each backend's config class.

    Each backend's own class lives beside its implementation and is registered by
    :func:`ablate.backends.register_backend_schemas`; ``name`` is the registered backend name.
    """

    KEY: ClassVar[str] = "backend"

    name: str = MISSING

    def check(self) -> None:
        """Each backend checks its own settings; the base has none beyond its name."""


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
    #: What sets the cell's arm apart from the other arms of its sweep beyond policy, budget and seed
    #: (``backend.router_noise=0.2``): the grid sweeper fills it so that two arms' W&B runs never
    #: share a display name; "" for a cell run alone.
    label: str = ""

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


#: The largest cell seed: vLLM, SGLang and numpy's legacy seeding take 32-bit seeds (a cell's streams
#: derive their own seeds from it through :func:`ablate.seeding.stream_seed`).
MAX_SEED = 2**31 - 1


@dataclass
class AnalysisConfig:
    """What the sweep asks of its analysis; read by ``ablate-analyze``, never by a cell."""

    KEY: ClassVar[str] = "analysis"

    #: Ordered primary questions (effect-row selectors such as ``replay`` or
    #: ``selection:fisher:random@pooled``), tested by serial gatekeeping before the exploratory
    #: rows; ``ablate-analyze --primary`` replaces them (docs/statistics.md).
    primary: list[str] = field(default_factory=list)
    #: The outcomes the analysis reports, in order (``ablate-analyze --outcome`` replaces them).
    outcomes: list[str] = field(default_factory=list)
    #: Per outcome, the equivalence margin in the outcome's units: the smallest effect that matters,
    #: and the one a "no effect" claim is tested against (``--margin`` adds to them).
    margins: dict[str, float] = field(default_factory=dict)

    def check(self) -> None:
        require(all(isinstance(text, str) and text for text in self.primary), f"{self.KEY}.primary", self.primary,
                "a list of effect-row selectors, e.g. [replay, 'selection:fisher:random@pooled']")
        require(all(isinstance(text, str) and text for text in self.outcomes), f"{self.KEY}.outcomes", self.outcomes,
                "a list of outcome names, e.g. [kl_k3_mean, final_reward]")
        for outcome, margin in self.margins.items():
            require(is_number(margin) and margin > 0, f"{self.KEY}.margins.{outcome}", margin,
                    "a finite margin > 0 in the outcome's units")


@dataclass
class AppConfig:
    backend: BackendConfig = MISSING
    policy: PolicyConfig = MISSING
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    #: Fraction of valid routes replayed; ``null`` for none/full, which have fixed budgets.
    budget: Optional[float] = None
    seed: int = 0
    #: Name of the sweep: the run store's sub-directory and the W&B group.
    sweep: str = "adhoc"
    #: Root of the run store, relative to the directory the command was started in.
    store_dir: str = "runs"
    #: Outcome returned to Hydra sweepers (see ablate.outcomes): a summary key, or a list
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
    #: Seconds a cell may run before it ends ``failed`` (timeout), its steps kept; null: no limit.
    cell_timeout: Optional[float] = None

    #: The sections, each with its own ``check()``.
    SECTIONS: ClassVar[tuple[str, ...]] = ("backend", "policy", "replay", "tracking", "analysis")

    def check(self) -> None:
        """Every section and every top-level value. What needs more than the config itself is
        checked where the cell is composed (:mod:`ablate.compose`): the backend's name against the
        registry, the budget against its policy, the objective against the outcomes."""
        for section in self.SECTIONS:
            getattr(self, section).check()
        self.check_values()

    def check_values(self) -> None:
        """The top-level values, without the sections."""
        require_int("seed", self.seed, 0, MAX_SEED, "2**31 - 1, the largest seed every backend's generators take")
        if self.trial is not None:
            require_int("trial", self.trial, 0)
        require(bool(self.store_dir), "store_dir", self.store_dir, "a directory for the run store")
        if self.cell_timeout is not None:
            require_positive("cell_timeout", self.cell_timeout)
        check_sweep_name(self.sweep)


#: A sweep name is one directory of the run store and a W&B group: one path component that can
#: neither climb out of the store (``..``, ``/abs``) nor land in its root (``''``, ``.``).
SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]{0,127}")


def check_sweep_name(name: Any) -> str:
    require(isinstance(name, str) and SWEEP_NAME.fullmatch(name) is not None and ".." not in name, "sweep",
            repr(name), "one directory name of at most 128 letters, digits and . _ - = + , starting with a "
            "letter or digit")
    return name


def register_configs() -> None:
    """Register the schemas as root-level ``base_*`` configs (idempotent); each backend's schema
    is registered with the backends (:func:`ablate.backends.register_backend_schemas`).

    Root level, not inside the ``policy``/``backend`` groups: a schema in a group would be offered
    as a choice (``policy=base_fisher``) by ``--help`` and tab completion.
    """
    store = ConfigStore.instance()
    for name, node in (
        ("base_config", AppConfig), ("base_policy", PolicyConfig), ("base_budgeted_policy", BudgetedPolicyConfig),
        ("base_fisher", FisherPolicyConfig), ("base_threshold", ThresholdPolicyConfig),
    ):
        store.store(name=name, node=node)
