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
- the sweep's declared analysis (its outcomes, margins and primary questions) against the
  outcomes and the known policies;
- values read from the environment (``${oc.env:NAME}``): recorded as the interpolation where
  they do not change what the cell computes, refused where they would;
- the cell's directory name against what a file system takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigTypeError

from ablate.arms import arm_policy
from ablate.backends import backend_names, get_backend
from ablate.budget import BudgetError
from ablate.cell import NOT_IDENTITY, Cell, cell_id_of, cell_name
from ablate.config import AnalysisConfig, AppConfig, ConfigError, FisherEstimateConfig, choice_value, require
from ablate.diagnostics import SCHEMA_VERSION
from ablate.outcomes import OUTCOME_NAMES, check_objective
from ablate.policies import PolicyError, PolicySpec, available_policies, get_policy, load_plugins, policy_class
from ablate.probes import check_probe_every, parse_probes, probe_table
from ablate.questions import parse_question
from ablate.replay.spec import ReplaySpec, VariantError
from ablate.store import store_root

__all__ = ["CellTemplate", "ConfigError", "cell_from_config", "replay_spec", "unknown_key", "variant_of"]

#: The longest file name most file systems take (bytes): a cell's directory must fit.
MAX_NAME_BYTES = 255


def cell_from_config(cfg: DictConfig) -> Cell:
    """Validate every value of a composed config and turn it into a :class:`Cell`, before any work.

    The modules the config lists under ``plugins`` are imported first, in whichever process this runs.
    """
    plugins = load_config_plugins(cfg)
    stray = unknown_key(cfg)
    if stray is not None:
        raise ConfigError(stray)
    app = OmegaConf.to_object(cfg)
    assert isinstance(app, AppConfig)
    return build_cell(app, resolved_plain(cfg), plugins, AppConfig.SECTIONS)


def load_config_plugins(cfg: DictConfig) -> tuple[str, ...]:
    """Import the config's ``plugins`` and check that its policy is known; the plugins, as a tuple."""
    name = cfg.policy.name
    plugins = tuple(str(module) for module in cfg.get("plugins") or ())
    try:
        load_plugins(plugins)
        policy_class(name)
    except PolicyError as error:
        raise ConfigError(f"policy.name={name!r}: {error}") from None
    return plugins


def build_cell(app: AppConfig, plain: dict[str, Any], plugins: tuple[str, ...], sections: Collection[str]) -> Cell:
    """The :class:`Cell` of a typed config and its plain (resolved) form, every value checked.

    ``sections`` are the sections to check (every one, but for a cell derived from a template whose
    other sections were checked already; the policy's settings are checked with its section); the
    top-level values are always checked.
    """
    if "backend" in sections:
        # A misspelt backend.name composes (the field is a string) but has nothing to run the cell.
        require(app.backend.name in backend_names(), "backend.name", app.backend.name,
                f"one of {', '.join(backend_names())} (choose a backend with backend=<name>)")
    for section in sections:
        getattr(app, section).check()
    if "analysis" in sections:
        _check_declared_analysis(app.analysis)
    app.check_values()
    _check_objective(app.objective)
    name = app.policy.name
    policy_cfg = plain["policy"]
    settings = {k: v for k, v in policy_cfg.items() if k not in ("name", "fisher")}
    if "policy" in sections:
        _check_policy_settings(name, settings)
    fisher, trial = app.policy.fisher, app.trial
    replay = replay_spec(plain, PolicySpec(name, settings, fisher_decay=fisher.decay,
                                           fisher_normalize=choice_value(fisher.normalize), plugins=plugins))
    resolved = {**plain, "budget": replay.budget, "schema_version": SCHEMA_VERSION,
                "probes": probe_table(replay.probes), "probe_every": replay.probe_every}
    check_supported(app, resolved["probes"], replay)
    variant = variant_of(name, settings, policy_cfg.get("fisher", {}), replay.variant())
    objective = app.objective
    multi = not isinstance(objective, str)
    cell = Cell(
        backend=app.backend, replay=replay, fisher=fisher, sweep=app.sweep, cell_id=cell_id_of(resolved), trial=trial,
        variant=variant, name=cell_name(replay, trial, variant), store_dir=_store_root(app.store_dir),
        tracking=app.tracking,
        objective=tuple(str(o) for o in objective) if multi else (str(objective),), multi_objective=multi,
        timeout=app.cell_timeout, resolved=resolved,
    )
    check_name_length(cell)
    return cell


class CellTemplate:
    """What every job of one composition shares, checked once: a job's cell is this base with the
    job's values (``budget=0.1``, ``seed=3``, ``policy.tau=1.0``) set in it.

    A grid has few compositions (one per choice of config groups) and many values, so a sweep
    plans its cells from templates at the cost of a few dictionary updates each, instead of
    composing and resolving every job (:meth:`cell` gives exactly what :func:`cell_from_config`
    gives for the job's composed config: ``tests/test_plan.py`` holds the two against each other).
    A composition that holds an interpolation (a value may depend on another) makes no template.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.plugins = load_config_plugins(cfg)
        stray = unknown_key(cfg)
        if stray is not None:
            raise ConfigError(stray)
        app = OmegaConf.to_object(cfg)
        assert isinstance(app, AppConfig)
        self.app, self.plain = app, resolved_plain(cfg)
        self.fixed_budget = policy_class(app.policy.name).fixed_budget
        self._checked: set[str] = set()
        self._sections: dict[tuple[str, tuple[Any, ...]], Any] = {}
        self._checked_settings: set[tuple[str, tuple[Any, ...]]] = set()
        self._cells: dict[tuple[Any, ...], Cell] = {}

    @classmethod
    def of(cls, cfg: DictConfig) -> CellTemplate | None:
        """The template of a composed config, or None where values may depend on each other."""
        return None if has_interpolation(cfg) else cls(cfg)

    def cell(self, values: Mapping[str, Any]) -> Cell:
        """The cell with ``values`` (dotted key -> value, typed as the config's schema types it) set.

        Each section with a new combination of values is rebuilt and checked once: the jobs of a grid
        share a few (``backend.router_noise=0.2``, ``tracking.mode=disabled``) across many seeds. A
        job with the values of an earlier job (``none`` at every budget of a grid) gets its cell.
        """
        job = _values_key(values.items())
        if job in self._cells:
            return self._cells[job]
        plain, top, nested = self.plain, {}, {}
        for key, value in values.items():
            path = key.split(".")
            plain = _set(plain, path, choice_value(value) if isinstance(value, Enum) else value)
            if len(path) == 1:
                top[key] = value
            else:
                nested.setdefault(path[0], []).append((path[1:], value))
        unchecked = [name for name in AppConfig.SECTIONS if name not in self._checked and name not in nested]
        new_settings = []
        for section, settings in nested.items():
            setting = (section, _values_key((tuple(path), value) for path, value in settings))
            if setting not in self._sections:
                node = getattr(self.app, section)
                for path, value in settings:
                    node = _replaced(node, path, value)
                self._sections[setting] = node
            if setting not in self._checked_settings:
                unchecked.append(section)
                new_settings.append(setting)
            top[section] = self._sections[setting]
        app = dataclasses.replace(self.app, **top) if top else self.app
        cell = build_cell(app, plain, self.plugins, unchecked)
        # Checked now: what no job changes once per template, each section's values once.
        self._checked.update(section for section in unchecked if section not in nested)
        self._checked_settings.update(new_settings)
        self._cells[job] = cell
        return cell


def _values_key(values: Iterable[tuple[Any, Any]]) -> tuple[tuple[Any, type, Any], ...]:
    """Values as a dictionary key that tells 1, 1.0 and True apart (equal in Python, not in a config)."""
    return tuple((key, type(value), value) for key, value in values)


def has_interpolation(cfg: DictConfig | ListConfig) -> bool:
    """Whether any value of ``cfg`` (outside ``hydra``) is an interpolation."""
    keys = range(len(cfg)) if isinstance(cfg, ListConfig) else [key for key in cfg.keys() if key != "hydra"]
    for key in keys:
        if OmegaConf.is_interpolation(cfg, key):
            return True
        if OmegaConf.is_missing(cfg, key):
            continue
        value = cfg[key]  # not an interpolation: reading it resolves nothing
        if isinstance(value, (DictConfig, ListConfig)) and has_interpolation(value):
            return True
    return False


def _replaced(node: Any, path: list[str], value: Any) -> Any:
    """``node`` (a dataclass) with ``path`` set to ``value``, every dataclass on the way copied."""
    head, rest = path[0], path[1:]
    return dataclasses.replace(node, **{head: _replaced(getattr(node, head), rest, value) if rest else value})


def _set(plain: Any, path: list[str], value: Any) -> Any:
    """``plain`` with ``path`` set to ``value``: the dicts and lists on the way are copied, the rest shared."""
    head, rest = path[0], path[1:]
    updated = list(plain) if isinstance(plain, list) else dict(plain)
    at = int(head) if isinstance(plain, list) else head
    updated[at] = _set(plain[at], rest, value) if rest else value
    return updated


@functools.lru_cache(maxsize=64)
def _store_root(store_dir: str) -> Any:
    return store_root(store_dir)


_CHECKED_OBJECTIVES: set[str] = set()


def _check_objective(objective: Any) -> None:
    """:func:`ablate.outcomes.check_objective`, once per distinct objective (a name or a list of names)."""
    key = repr(objective)
    if key not in _CHECKED_OBJECTIVES:
        check_objective(objective)
        _CHECKED_OBJECTIVES.add(key)


_CHECKED_ANALYSES: set[str] = set()


def _check_declared_analysis(analysis: AnalysisConfig) -> None:
    """What the sweep declares of its analysis, against what the analysis knows (once per block).

    Its outcomes and margins name outcomes, its primary questions read and name known policies:
    the analysis would refuse an unknown outcome, ignore its margin and skip such a question
    without a word (the next one named "primary 2"), and only once every cell has run.
    """
    key = json.dumps([analysis.primary, analysis.outcomes, analysis.margins], sort_keys=True, default=str)
    if key in _CHECKED_ANALYSES:
        return
    named = [(f"analysis.outcomes={list(analysis.outcomes)}", name) for name in analysis.outcomes]
    named += [(f"analysis.margins.{name}={margin}", name) for name, margin in analysis.margins.items()]
    for where, name in named:
        if name not in OUTCOME_NAMES:
            close = difflib.get_close_matches(name, OUTCOME_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: {name!r} is not an outcome{hint}; expected outcomes among "
                              f"{', '.join(OUTCOME_NAMES)}")
    known = available_policies()
    for text in analysis.primary:
        try:
            question = parse_question(text, "analysis.primary")
        except ValueError as error:
            raise ConfigError(str(error)) from None
        named = [("POLICY", question.policy), ("BASELINE", question.baseline)]
        for role, arm in named:
            # A comparison of two values of a setting names its baseline by the setting (key=b).
            if arm is None or (question.kind == "compare" and role == "BASELINE" and "=" in arm):
                continue
            if arm_policy(arm) not in known:
                close = difflib.get_close_matches(arm_policy(arm), known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"analysis.primary {text!r}: {role} {arm!r} is not a policy{hint}; expected one "
                                  f"of {', '.join(known)}, with its settings in brackets where it has any")
    _CHECKED_ANALYSES.add(key)


_CHECKED_SETTINGS: set[str] = set()


def _check_policy_settings(name: str, settings: dict[str, Any]) -> None:
    """The policy's own settings, through ``get_policy`` (once per distinct settings), rather than mid-run."""
    key = json.dumps([name, settings], sort_keys=True, default=str)
    if key in _CHECKED_SETTINGS:
        return
    try:
        get_policy(name, **settings)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _CHECKED_SETTINGS.add(key)


@functools.lru_cache(maxsize=256)
def _parsed_probes(table: str) -> tuple[Any, ...]:
    return parse_probes(json.loads(table))


def _probes(table: list[dict[str, Any]]) -> tuple[Any, ...]:
    return _parsed_probes(json.dumps(table, sort_keys=True)) if table else ()


def check_supported(app: AppConfig, probes: list[dict[str, Any]], replay: ReplaySpec) -> None:
    """What the cell asks of its backend (probes, a Fisher estimator, a replay variant) is what the backend declares."""
    backend = get_backend(app.backend.name)
    if replay.source not in backend.replay_sources:
        raise ConfigError(f"replay.source={replay.source} with backend={backend.name}: expected "
                          f"{' or '.join(backend.replay_sources)} (the sources of replayed routes it runs)")
    if replay.weights == "rollout" and not backend.replays_gate_weights:
        raise ConfigError(f"replay.weights=rollout with backend={backend.name}: its rollout hands over expert ids "
                          "without their gate weights, so there are none to replay; use replay.weights=recompute")
    if replay.policy_class.gates_slots and not backend.gates_slots:
        raise ConfigError(f"policy={replay.policy.name} with backend={backend.name}: its gate needs the trainer's "
                          f"router scores where each route is applied, which {backend.gate_refusal}; run it on a "
                          "backend that gates replayed routes (backend=synthetic)")
    if probes and not backend.scores_probes:
        raise ConfigError(f"probes={[row['id'] for row in probes]} with backend={backend.name}: "
                          "expected no probes (this backend does not score them)")
    gated = [row["id"] for row in probes if policy_class(row["policy"]).gates_slots]
    if gated:
        raise ConfigError(f"probes=[{','.join(gated)}]: a probe scores a mask, and {gated[0]} spends what its gate "
                          "lets through in the MoE forward, which a probe's pass does not apply; run it as a cell")
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


def variant_of(policy: str, settings: dict[str, Any], fisher: dict[str, Any],
               replay: dict[str, str] | None = None) -> str:
    """The settings that differ from the policy's defaults, as ``k=v`` joined by commas.

    Cells of one policy with different settings (a temperature sweep, per-layer against global
    budgets) are different arms of an ablation; this names them. The Fisher estimate settings
    count only for a policy that reads the estimate (``reads_fisher``). A replay variant
    (``replay``: ``{"source": "train"}``) is an arm of the policy too: ``replay.source=train``.
    """
    cls = policy_class(policy)
    defaults = _keyword_defaults(cls)
    changed = [f"{k}={v}" for k, v in sorted(settings.items()) if k in defaults and defaults[k] != v]
    if cls.reads_fisher:
        base = _fisher_defaults()
        changed += [f"fisher.{k}={v}" for k, v in sorted(fisher.items()) if base.get(k) != v]
    changed += [f"replay.{k}={v}" for k, v in sorted((replay or {}).items())]
    return ",".join(changed)


@functools.lru_cache(maxsize=None)
def _keyword_defaults(cls: type) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


@functools.lru_cache(maxsize=1)
def _fisher_defaults() -> dict[str, Any]:
    return {f.name: choice_value(getattr(FisherEstimateConfig(), f.name)) for f in fields(FisherEstimateConfig)}


def resolved_plain(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, every interpolation resolved and every choice a string, but the
    values read from the environment: each stays its interpolation (:func:`from_environment`).

    A value read from the environment may be a secret or a path of one machine, and this plain
    data is what ``config.yaml`` and the W&B run's config record. Where it changes what the cell
    computes it is refused instead: recorded as its interpolation, it could not be the cell's
    identity (the hash of the recorded config), and recorded as its value, it would be written.
    """
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert isinstance(plain, dict)
    plain.pop("hydra", None)
    for key, text in from_environment(cfg).items():
        if key.split(".")[0] not in NOT_IDENTITY:
            variable = re.search(r"\$\{oc\.env:([^,}]+)", text)
            raise ConfigError(f"{key}={text}: a value read from the environment, in a setting that changes what the "
                              f"cell computes; expected the value itself (on the command line: {key}=\"$"
                              f"{variable[1] if variable else 'NAME'}\"), so that config.yaml and W&B record it and "
                              "the cell's identity holds it")
        plain = _set(plain, key.split("."), text)
    return plain


#: The text an interpolation that reads the environment starts with (OmegaConf's resolver).
ENV_INTERPOLATION = "${oc.env:"


def from_environment(cfg: DictConfig) -> dict[str, str]:
    """Dotted key -> its value with the environment left unread, for every value of ``cfg`` (outside
    ``hydra``) that reads the environment, directly or through another key's interpolation.

    Resolved once more with every ``${oc.env:...}`` escaped: such a value keeps the interpolation
    as text (``${oc.env:SCRATCH}/runs``), and every other value resolves as it does.
    """
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    if ENV_INTERPOLATION not in json.dumps(raw, default=str):
        return {}
    escaped = OmegaConf.create(_escape_environment(raw))
    kept = OmegaConf.to_container(escaped, resolve=True)
    assert isinstance(kept, dict)
    return {key: value for key, value in _leaves(kept) if isinstance(value, str) and ENV_INTERPOLATION in value}


def _escape_environment(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _escape_environment(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_environment(value) for value in node]
    return node.replace(ENV_INTERPOLATION, "\\" + ENV_INTERPOLATION) if isinstance(node, str) else node


def _leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), node


def replay_spec(plain: dict[str, Any], policy: PolicySpec) -> ReplaySpec:
    """The cell's :class:`ReplaySpec`: its budget resolved (``none`` -> 0, ``full`` -> 1) and its probes
    in canonical form (the same probes written either way are the same cell), or a one-line error."""
    table = plain.get("probes")
    probes = _probes(table) if isinstance(table, list) else parse_probes(table)
    replay = plain.get("replay") or {}
    try:
        return ReplaySpec(policy, plain["budget"], int(plain["seed"]), probes,
                          check_probe_every(plain.get("probe_every", 1)), **replay)
    except BudgetError as error:
        raise ConfigError(f"{error} (from the config key budget)") from None
    except VariantError as error:
        raise ConfigError(str(error)) from None


