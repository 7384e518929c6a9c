"""A cell: (backend, policy, budget, seed) plus overrides, with a stable identity and a human name.

The identity is a hash of the resolved config without the keys that do not change the result
(where it is stored, how it is tracked, which sweep asked for it), so the same sweep started twice
maps to the same cells and a rerun can recognise a cell that is already complete.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ablate.analysis.outcomes import check_objective
from ablate.arms import arm_name
from ablate.backends import get_backend
from ablate.budget import budget_label, check_budget
from ablate.config import AppConfig, BackendConfig, ConfigError, FisherEstimateConfig, choice_value
from ablate.diagnostics import SCHEMA_VERSION
from ablate.fisher import FisherTracker
from ablate.policies import PolicyError, PolicySpec, ReplayPolicy, get_policy, load_plugins, policy_class
from ablate.probes import Probe, check_probe_every, parse_probes, probe_table

#: Top-level config keys that never change what a cell computes (``plugins`` says where a policy's
#: code is found; the policy's name and settings are what the cell computes with; ``analysis`` is
#: read by ``ablate-analyze`` only).
NOT_IDENTITY = ("tracking", "store_dir", "sweep", "objective", "hydra", "plugins", "analysis")


__all__ = ["Cell", "ConfigError", "cell_from_config", "cell_name", "policy_for", "resolved_config"]


@dataclass(frozen=True)
class Cell:
    backend: BackendConfig
    policy: str
    #: Settings passed to ``get_policy`` (``per_layer``, ``tau``, ...).
    policy_settings: dict[str, Any]
    fisher: FisherEstimateConfig
    budget: float
    seed: int
    sweep: str
    cell_id: str
    name: str
    trial: int | None = None
    #: Non-default policy settings, e.g. ``tau=1,fisher.estimator=expert_params`` ("" for defaults):
    #: with the policy it names the arm a cell belongs to in an analysis.
    variant: str = ""
    #: Modules imported before the policy is looked up (the config's ``plugins``).
    plugins: tuple[str, ...] = ()
    #: Counterfactual probes scored every ``probe_every`` steps (``ablate.probes``); none by default.
    probes: tuple[Probe, ...] = ()
    probe_every: int = 1

    @property
    def dirname(self) -> str:
        """The cell's directory in the run store: its name and the start of its identity."""
        return f"{self.name}-{self.cell_id[:8]}"

    def flat_config(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """The resolved config flattened with dots, plus the keys dashboards group by."""
        flat = _flatten(resolved)
        flat.update({
            "policy": self.policy, "budget": self.budget, "seed": self.seed, "backend": self.backend.name,
            "schema_version": SCHEMA_VERSION, "cell_id": self.cell_id, "sweep": self.sweep, "variant": self.variant,
        })
        if self.trial is not None:
            flat["trial"] = self.trial
        return flat

    def policy_spec(self) -> PolicySpec:
        """The cell's policy and Fisher settings, as every backend builds them."""
        return PolicySpec(
            name=self.policy, settings=dict(self.policy_settings), fisher_decay=self.fisher.decay,
            fisher_normalize=choice_value(self.fisher.normalize), plugins=self.plugins,
        )


def cell_name(policy: str, budget: float, seed: int, trial: int | None = None, variant: str = "") -> str:
    """``fisher-b0.25-s3``; ``none-s3`` and ``full-s3`` carry no budget, they have only one.

    A settings variant joins the policy (``fisher+tau=1.0-b0.25-s3``), so that two arms of one
    policy never share a name in W&B or the store (``+``, not the analysis' ``fisher[tau=1.0]``:
    brackets are glob characters in a shell and in ``Path.glob``). Trials of an Optuna study get ``-t<number>``:
    they share policy, budget and seed.
    """
    arm = arm_name(policy, variant, in_path=True)
    name = f"{arm}-s{seed}" if policy_class(policy).fixed_budget is not None else f"{arm}-b{budget_label(budget)}-s{seed}"
    return name if trial is None else f"{name}-t{trial}"


def resolved_budget(cfg: DictConfig) -> float:
    try:
        return check_budget(cfg.budget, cfg.policy.name, fixed=policy_class(cfg.policy.name).fixed_budget)
    except ValueError as error:
        raise ConfigError(f"{error} (from the config key budget)") from None


def cell_from_config(cfg: DictConfig) -> Cell:
    """Validate every value of a composed config and turn it into a :class:`Cell`, before any work.

    The checks: each config section's ``check()`` (``ablate.config``), the policy name, the
    budget against the policy, and the policy's own settings through ``get_policy``. The modules
    the config lists under ``plugins`` are imported first, in whichever process this runs.
    """
    name = cfg.policy.name
    plugins = tuple(str(module) for module in cfg.get("plugins") or ())
    try:
        load_plugins(plugins)
        policy_class(name)
    except PolicyError as error:
        raise ConfigError(f"policy.name={name!r}: {error}") from None
    app = OmegaConf.to_object(cfg)
    assert isinstance(app, AppConfig)
    app.check()
    check_objective(app.objective)
    resolved = resolved_config(cfg)
    budget = resolved["budget"]
    policy_cfg = resolved["policy"]
    settings = {k: v for k, v in policy_cfg.items() if k not in ("name", "fisher")}
    try:
        get_policy(name, **settings)  # checks the settings now rather than in the middle of a run
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_supported(app, resolved["probes"])
    identity = {k: v for k, v in resolved.items() if k not in NOT_IDENTITY}
    cell_id = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    backend, fisher = app.backend, app.policy.fisher
    variant = variant_of(name, settings, policy_cfg.get("fisher", {}))
    assert isinstance(backend, BackendConfig) and isinstance(fisher, FisherEstimateConfig)
    return Cell(
        backend=backend, policy=name, policy_settings=settings, fisher=fisher, budget=budget, seed=int(cfg.seed),
        sweep=str(cfg.sweep), cell_id=cell_id, trial=cfg.get("trial"), variant=variant, plugins=plugins,
        name=cell_name(name, budget, int(cfg.seed), cfg.get("trial"), variant),
        probes=parse_probes(resolved["probes"]), probe_every=resolved["probe_every"],
    )


def check_supported(app: AppConfig, probes: list[dict[str, Any]]) -> None:
    """What the cell asks of its backend (probes, a Fisher estimator) is what the backend declares."""
    backend = get_backend(app.backend.name)
    if probes and not backend.scores_probes:
        raise ConfigError(f"probes={[row['id'] for row in probes]} with backend={backend.name}: "
                          "expected no probes (this backend does not score them)")
    estimator = choice_value(app.policy.fisher.estimator)
    if estimator not in backend.fisher_estimators:
        raise ConfigError(f"policy.fisher.estimator={estimator}: expected {' or '.join(backend.fisher_estimators)} "
                          f"with backend={backend.name} (the Fisher estimators it measures)")


def variant_of(policy: str, settings: dict[str, Any], fisher: dict[str, Any]) -> str:
    """The settings that differ from the policy's defaults, as ``k=v`` joined by commas.

    Cells of one policy with different settings (a temperature sweep, per-layer against global
    budgets) are different arms of an ablation; this names them. The Fisher estimate settings
    count only for a policy that reads the estimate (``reads_fisher``).
    """
    cls = policy_class(policy)
    defaults = {
        p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    changed = [f"{k}={v}" for k, v in sorted(settings.items()) if k in defaults and defaults[k] != v]
    if cls.reads_fisher:
        base = {f.name: choice_value(getattr(FisherEstimateConfig(), f.name)) for f in fields(FisherEstimateConfig)}
        changed += [f"fisher.{k}={v}" for k, v in sorted(fisher.items()) if base.get(k) != v]
    return ",".join(changed)


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data with the budget resolved (``none`` -> 0, ``full`` -> 1)."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(plain, dict)
    plain.pop("hydra", None)
    plain["budget"] = resolved_budget(cfg)
    plain["schema_version"] = SCHEMA_VERSION
    # The probe table in canonical form: the same probes written either way are the same cell.
    plain["probes"] = probe_table(parse_probes(plain.get("probes")))
    plain["probe_every"] = check_probe_every(plain.get("probe_every", 1))
    return plain


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def policy_for(cell: Cell, num_layers: int, num_experts: int) -> tuple[ReplayPolicy, FisherTracker]:
    """The cell's policy and its Fisher tracker (kept for every policy, to log its Fisher mass)."""
    return cell.policy_spec().build(num_layers, num_experts)
