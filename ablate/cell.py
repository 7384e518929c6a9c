"""A cell: (backend, policy, budget, seed) plus overrides, with a stable identity and a human name.

One :class:`Cell` is built per job, by :func:`ablate.compose.cell_from_config`, from a composed and
checked config; everything after (the sweep's plan, the runner, the backends) reads the cell and
never the raw config again. It carries what the cell computes with (backend, policy, budget,
seed, probes) and what the runner needs around it (where it is stored, how it is tracked, the
objective it returns to a sweeper).

The identity is a hash of the resolved config without the keys that do not change the result
(where it is stored, how it is tracked, which sweep asked for it), so the same sweep started twice
maps to the same cells and a rerun can recognise a cell that is already complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ablate.arms import arm_name
from ablate.budget import budget_label
from ablate.config import BackendConfig, FisherEstimateConfig, TrackingConfig
from ablate.diagnostics import SCHEMA_VERSION
from ablate.probes import Probe
from ablate.replay.spec import ReplaySpec
from ablate.seeding import STREAMS_VERSION
from ablate.store import CellIdentity, sweep_directory
from ablate.store.identity import LATER_KEYS, NOT_IDENTITY, cell_id_of

__all__ = ["LATER_KEYS", "NOT_IDENTITY", "Cell", "cell_id_of", "cell_name"]


@dataclass(frozen=True)
class Cell:
    backend: BackendConfig
    #: What the cell replays: its policy and settings, its budget (resolved), its seed and probes.
    replay: ReplaySpec
    #: How the Fisher estimate is measured (its smoothing is part of ``replay``).
    fisher: FisherEstimateConfig
    sweep: str
    cell_id: str
    name: str
    trial: int | None = None
    #: Non-default policy settings, e.g. ``tau=1,fisher.estimator=expert_params`` ("" for defaults):
    #: with the policy it names the arm a cell belongs to in an analysis.
    variant: str = ""
    #: The run store's root, absolute (``store_dir`` resolved where the command started).
    store_dir: Path = Path("runs")
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    #: The summary key(s) returned to a Hydra sweeper: one name, or several for a multi-objective study.
    objective: tuple[str, ...] = ("final_reward",)
    #: Whether the config gave a list of objectives (a sweeper then gets a list of values).
    multi_objective: bool = False
    #: Seconds the cell may run (``cell_timeout``); None: no limit.
    timeout: float | None = None
    #: The resolved config as plain data (``config.yaml``, and the W&B run's config).
    resolved: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def dirname(self) -> str:
        """The cell's directory in the run store: its name and the start of its identity."""
        return f"{self.name}-{self.cell_id[:8]}"

    @cached_property
    def directory(self) -> Path:
        """``<store_dir>/<sweep>/<name>-<id[:8]>``: where the cell's files are."""
        return sweep_directory(self.store_dir, self.sweep) / self.dirname

    @cached_property
    def identity(self) -> CellIdentity:
        """What the cell's ``cell.json`` holds, but the W&B run id (drawn when it first runs)."""
        return CellIdentity(
            cell_id=self.cell_id, name=self.name, sweep=self.sweep, backend=self.backend.name, policy=self.policy,
            budget=self.budget, seed=self.seed, trial=self.trial, variant=self.variant, settings=self.policy_settings,
            schema_version=self.resolved["schema_version"], streams=STREAMS_VERSION,
        )

    def flat_config(self) -> dict[str, Any]:
        """The resolved config flattened with dots, plus the keys dashboards group by."""
        flat = _flatten(self.resolved)
        flat.update({
            "policy": self.policy, "budget": self.budget, "seed": self.seed, "backend": self.backend.name,
            "schema_version": SCHEMA_VERSION, "cell_id": self.cell_id, "sweep": self.sweep, "variant": self.variant,
            "streams": STREAMS_VERSION,
        })
        if self.trial is not None:
            flat["trial"] = self.trial
        return flat

    @property
    def policy(self) -> str:
        return self.replay.policy.name

    @property
    def policy_settings(self) -> dict[str, Any]:
        """Settings passed to ``get_policy`` (``per_layer``, ``tau``, ...)."""
        return self.replay.policy.settings

    @property
    def budget(self) -> float:
        return self.replay.budget

    @property
    def seed(self) -> int:
        return self.replay.seed

    @property
    def plugins(self) -> tuple[str, ...]:
        """Modules imported before the policy is looked up (the config's ``plugins``)."""
        return self.replay.policy.plugins

    @property
    def probes(self) -> tuple[Probe, ...]:
        """Counterfactual probes scored every ``probe_every`` steps (``ablate.probes``); none by default."""
        return self.replay.probes

    @property
    def probe_every(self) -> int:
        return self.replay.probe_every

    @property
    def display_name(self) -> str:
        """The W&B run's name: the cell's name, and the arm's label where the sweep sets one."""
        return f"{self.name} {self.tracking.label}" if self.tracking.label else self.name

    @property
    def steps(self) -> int:
        """The backend's step count where it declares one (0 where it does not)."""
        return int(getattr(self.backend, "steps", 0) or 0)


def cell_name(replay: ReplaySpec, trial: int | None = None, variant: str = "") -> str:
    """``fisher-b0.25-s3``; ``none-s3`` and ``full-s3`` carry no budget, they have only one.

    A settings variant joins the policy (``fisher+tau=1.0-b0.25-s3``), so that two arms of one
    policy never share a name in W&B or the store (``+``, not the analysis' ``fisher[tau=1.0]``:
    brackets are glob characters in a shell and in ``Path.glob``). Trials of an Optuna study get ``-t<number>``:
    they share policy, budget and seed.
    """
    arm, seed = arm_name(replay.policy.name, variant, in_path=True), replay.seed
    name = f"{arm}-s{seed}" if replay.budget_is_fixed else f"{arm}-b{budget_label(replay.budget)}-s{seed}"
    return name if trial is None else f"{name}-t{trial}"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
