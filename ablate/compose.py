"""From a composed Hydra config to one validated :class:`~ablate.cell.Cell`, before any work.

Every check a cell's config must pass happens here, in one place, in whichever process composes
the job (the sweeper plans the whole grid with it before the first cell starts; a worker builds
its cell with it once):

- the keys: a typed section (a backend's or a policy's settings, the app's own) refuses a key it
  does not have, ``+`` or not, naming the closest known key;
- each section's ``check()`` (:mod:`ablate.config`), the backend's name against the registry and
  what the cell asks of its backend (probes, a Fisher estimator) against what it supports;
- the policy name, the budget against the policy, the policy's own settings;
- the objective against the outcomes a summary holds;
- the cell's directory name against what a file system takes.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigTypeError

from ablate.backends import backend_names, get_backend
from ablate.budget import check_budget
from ablate.cell import Cell, cell_id_of, cell_name
from ablate.config import AppConfig, ConfigError, FisherEstimateConfig, choice_value, require
from ablate.diagnostics import SCHEMA_VERSION
from ablate.outcomes import check_objective
from ablate.policies import PolicyError, get_policy, load_plugins, policy_class
from ablate.probes import check_probe_every, parse_probes, probe_table
from ablate.store import store_root

__all__ = ["ConfigError", "cell_from_config", "resolved_config", "unknown_key", "variant_of"]

#: The longest file name most file systems take (bytes): a cell's directory must fit.
MAX_NAME_BYTES = 255


def cell_from_config(cfg: DictConfig) -> Cell:
    """Validate every value of a composed config and turn it into a :class:`Cell`, before any work.

    The modules the config lists under ``plugins`` are imported first, in whichever process this runs.
    """
    name = cfg.policy.name
    plugins = tuple(str(module) for module in cfg.get("plugins") or ())
    try:
        load_plugins(plugins)
        policy_class(name)
    except PolicyError as error:
        raise ConfigError(f"policy.name={name!r}: {error}") from None
    stray = unknown_key(cfg)
    if stray is not None:
        raise ConfigError(stray)
    app = OmegaConf.to_object(cfg)
    assert isinstance(app, AppConfig)
    check_app(app)
    resolved = resolved_config(cfg)
    policy_cfg = resolved["policy"]
    settings = {k: v for k, v in policy_cfg.items() if k not in ("name", "fisher")}
    try:
        get_policy(name, **settings)  # checks the settings now rather than in the middle of a run
    except ValueError as error:
        raise ConfigError(str(error)) from None
    check_supported(app, resolved["probes"])
    budget, seed, trial = resolved["budget"], int(app.seed), app.trial
    variant = variant_of(name, settings, policy_cfg.get("fisher", {}))
    objective = app.objective
    multi = not isinstance(objective, str)
    cell = Cell(
        backend=app.backend, policy=name, policy_settings=settings, fisher=app.policy.fisher, budget=budget, seed=seed,
        sweep=app.sweep, cell_id=cell_id_of(resolved), trial=trial, variant=variant, plugins=plugins,
        name=cell_name(name, budget, seed, trial, variant), probes=parse_probes(resolved["probes"]),
        probe_every=resolved["probe_every"], store_dir=store_root(app.store_dir), tracking=app.tracking,
        objective=tuple(str(o) for o in objective) if multi else (str(objective),), multi_objective=multi,
        resolved=resolved,
    )
    check_name_length(cell)
    return cell


def check_app(app: AppConfig) -> None:
    """Every section's own check, the backend's name against the registry, and the objective."""
    # A misspelt backend.name composes (the field is a string) but has nothing to run the cell.
    require(app.backend.name in backend_names(), "backend.name", app.backend.name,
            f"one of {', '.join(backend_names())} (choose a backend with backend=<name>)")
    app.check()
    check_objective(app.objective)


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


def check_name_length(cell: Cell) -> None:
    """A cell's directory is one file name: a policy, variant or sweep name too long for it fails here."""
    size = len(cell.dirname.encode())
    require(size <= MAX_NAME_BYTES, "policy.name", cell.policy if len(cell.policy) <= 40 else cell.policy[:40] + "...",
            f"a cell name of at most {MAX_NAME_BYTES} bytes: {cell.name[:40]}... is {size} bytes with its identity, "
            "too long for a directory name (shorten the policy name or its settings)")


def unknown_key(cfg: DictConfig, prefix: str = "") -> str | None:
    """``backend.stepz=3: ...`` for the first key of a typed section that its schema does not have.

    Hydra refuses a misspelt key but accepts it with ``+``; a typed section (a dataclass schema:
    the app, a backend's or a policy's settings) would then carry a setting nothing reads.
    Sections typed ``Any`` or ``dict`` hold what they are given.
    """
    schema = OmegaConf.get_type(cfg)
    known = [f.name for f in fields(schema)] if schema is not None and is_dataclass(schema) else None
    for key, value in cfg.items_ex(resolve=False):
        key = str(key)
        if known is not None and key not in known and not (key == "hydra" and not prefix):
            close = difflib.get_close_matches(key, known, n=1)
            expected = f"did you mean {prefix}{close[0]}?" if close else f"one of {', '.join(sorted(known))}"
            return f"{prefix}{key}={value}: {_section_name(cfg, prefix)} has no setting {key!r}; {expected}"
        if isinstance(value, DictConfig):
            try:
                found = unknown_key(value, f"{prefix}{key}.")
            except ConfigTypeError:  # a typed section left null (backend.cpu on backend=verl): no keys
                continue
            if found is not None:
                return found
    return None


def _section_name(cfg: DictConfig, prefix: str) -> str:
    if prefix == "backend.":
        return f"backend={cfg.get('name')}"
    if prefix == "policy.":
        return f"policy={cfg.get('name')}"
    return prefix.rstrip(".") or "the config"


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


def resolved_budget(cfg: DictConfig) -> float:
    try:
        return check_budget(cfg.budget, cfg.policy.name, fixed=policy_class(cfg.policy.name).fixed_budget)
    except ValueError as error:
        raise ConfigError(f"{error} (from the config key budget)") from None


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
