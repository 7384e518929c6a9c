"""Load a sweep into a tidy frame: one row per cell (or per cell and step).

Sources:

- ``"store"`` (default): the local run store (layout in ablate/store.py), the source of truth. ``path`` is
  a sweep directory ``<store>/<sweep>``, or the store root with ``sweep=`` given.
- ``"wandb-offline"``: W&B offline run directories found anywhere under ``path`` (for example
  the cells' ``wandb/`` folders), decoded with :mod:`ablate.tracking.offline_reader`;
  ``sweep=`` keeps only runs of that W&B group. Runs of ``job_type="summary"`` (logged by
  ``ablate-analyze --dashboard``) are skipped in both W&B sources.
- ``"wandb"``: the W&B API; ``path`` is ``"entity/project"`` and ``sweep=`` the group.

Each cell row holds ``sweep, cell_id, name, backend, policy, policy_name, variant, budget, seed,
schema_version, status`` (store cells also ``path``). ``policy`` is the policy arm: the policy
name, plus its non-default settings in brackets when it has any (``fisher[tau=1.0]``);
``policy_name`` is the bare name. Then one column per **varied config key**: every key of the
resolved config (each store cell's ``config.yaml``; for W&B, the run's flattened config) whose
value differs between the loaded cells, named by its dotted path (``backend.router_noise``).
Keys that say where or how a cell ran rather than what it computed (``tracking``,
``store_dir``, ``sweep``, ``objective``, ``hydra``), the grid's own axes (``budget``, ``seed``,
``trial``) and policy settings the arm name already carries are not arm keys. The varied keys
are listed in ``df.attrs["config_keys"]``: the tables group by them, so a sweep over
``backend.router_noise`` (or a rerun with another ``backend.steps``) gives separate arms
instead of clashing rows. A varied key whose value another arm key determines (the settings of a
named regime, ``backend=synthetic_async``, go with ``backend.regime``) is no arm key of its own:
``df.attrs["determined_keys"]`` maps it to the key that determines it. ``where={"backend.steps": 5}`` keeps only the matching cells first
(any config key or identity column); keys that no longer vary are then no arm keys.

Then the outcomes of :func:`ablate.outcomes.cell_outcomes`, recomputed from the
per-step records with ``outcome_settings`` (so analysis settings can change after the sweep),
and the last finite value of every logged diagnostics key.

Cells of different diagnostics schema versions in one sweep are not comparable key by key: a
:class:`MixedSchemaWarning` names the versions and their counts, and ``schema_version`` becomes
an arm key, so cells are compared only within one version (``where={"schema_version": "1.0"}``
keeps one).

Only complete cells are kept, and the store decides which those are: the loader reads every
cell through :mod:`ablate.store` (:func:`~ablate.store.inspect_cell`, :func:`~ablate.store.read_identity`,
:func:`~ablate.store.read_records`), the same reader the sweeps resume by. Other cells are
excluded and counted, never silently: an :class:`ExcludedCellsWarning` (``warnings.warn``;
routed to ``logging`` under ``logging.captureWarnings(True)``) names the counts and
``df.attrs["excluded"]`` holds ``{"failed", "interrupted", "running", "unfinished", "corrupt"}``
counts ("running": a live worker holds it now; "unfinished": started and never ended, its worker
killed or crashed). A corrupt cell (an unreadable ``status.json`` or one with an unknown status,
or a complete cell whose ``cell.json`` has a field of the wrong type or names another
directory, or whose ``config.yaml``, ``summary.json`` or ``records.parquet`` is missing or
unreadable) raises :class:`CorruptCellError` naming the file; with ``on_corrupt="exclude"`` it
is excluded instead, counted under ``"corrupt"``, its file listed in ``df.attrs["corrupt_files"]``
and named in the warning.
"""

from __future__ import annotations

import difflib
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import numpy as np
import pandas as pd
import yaml

from ablate.analysis.declared import declared_analysis
from ablate.outcomes import cell_outcomes
from ablate.arms import arm_name
from ablate.store import CellState, StoreError, cell_directories, inspect_cell, read_identity, read_records

ID_COLUMNS: tuple[str, ...] = (
    "sweep", "cell_id", "name", "backend", "policy", "policy_name", "variant", "budget", "seed",
    "schema_version", "status",
)
#: Config keys (and the sub-trees under them) that never make an arm: where and how a cell ran,
#: and the grid's own axes, which are columns of their own.
NOT_ARM_KEYS: tuple[str, ...] = (
    "tracking", "store_dir", "sweep", "objective", "hydra", "budget", "seed", "trial", "schema_version", "policy.name",
    "analysis",
)
#: Keys the cell runner adds to the flattened W&B config beside the resolved config's own.
WANDB_IDENTITY_KEYS: frozenset[str] = frozenset(
    {"policy", "budget", "seed", "backend", "schema_version", "cell_id", "sweep", "variant", "trial"}
)
Source = Literal["store", "wandb-offline", "wandb"]
#: W&B runs of this job type hold analysis results, not cells (see ``dashboard.log_summary_table``).
SUMMARY_JOB_TYPE = "summary"
_MISSING = "<missing>"
#: libyaml's loader where PyYAML was built with it (about 10x faster on a sweep of many cells).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class CorruptCellError(RuntimeError):
    """A run-store file that exists but cannot be read (the message names the file)."""


class ExcludedCellsWarning(UserWarning):
    """Some cells of a sweep were left out of the analysis (failed, unfinished or corrupt)."""


class MixedSchemaWarning(UserWarning):
    """The cells of one sweep were logged under different diagnostics schema versions."""


@dataclass
class _LoadedCell:
    meta: dict[str, Any]
    config: dict[str, Any]  # the resolved config, flattened with dots
    records: pd.DataFrame


def load_runs(
    path: str | Path,
    sweep: str | None = None,
    *,
    source: Source = "store",
    per_step: bool = False,
    outcome_settings: Mapping[str, Any] | None = None,
    on_corrupt: Literal["error", "exclude"] = "error",
    where: Mapping[str, Any] | None = None,
) -> pd.DataFrame:
    """One row per complete cell (``per_step=True``: per cell and step); see the module doc."""
    if on_corrupt not in ("error", "exclude"):
        raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'error' or 'exclude'")
    settings = dict(outcome_settings or {})
    if source == "store":
        cells, excluded, corrupt = _read_store(sweep_dir(Path(path), sweep), on_corrupt)
    elif source == "wandb-offline":
        cells, excluded, corrupt = _read_wandb_offline(Path(path), sweep, on_corrupt)
    elif source == "wandb":
        cells, excluded, corrupt = _read_wandb_api(str(path), sweep)
    else:
        raise ValueError(f"source={source!r}: expected 'store', 'wandb-offline' or 'wandb'")
    cells = _select(cells, dict(where or {}))
    config_keys, determined = varied_config_keys(cells)
    # Policy settings that vary are in the arm's name (fisher[tau=1.0]), not arm keys; their own
    # columns let one compare two of their values (ablate.analysis.compare).
    policy_settings = varied_policy_settings(cells, config_keys)
    frame = (_steps_frame(cells, config_keys) if per_step
             else _cells_frame(cells, [*config_keys, *policy_settings], settings))
    frame.attrs["excluded"] = excluded
    frame.attrs["corrupt_files"] = corrupt
    frame.attrs["config_keys"] = config_keys
    frame.attrs["policy_settings"] = [] if per_step else policy_settings
    frame.attrs["determined_keys"] = determined
    frame.attrs["where"] = {key: _plain(value) for key, value in (where or {}).items()}
    frame.attrs["probes"] = _probe_table(cells)
    frame.attrs["analysis"] = declared_analysis((cell.meta.get("path", cell.meta.get("name")), cell.config) for cell in cells)
    _report_excluded(excluded, corrupt, str(path))
    _report_schema_versions(cells, str(path))
    return frame


def sweep_dir(path: Path, sweep: str | None = None) -> Path:
    """The sweep directory at ``path`` (or ``path / sweep``); an error says what is there instead."""
    directory = path / sweep if sweep else path
    if not directory.is_dir():
        raise FileNotFoundError(f"sweep directory {directory} does not exist")
    if not any(directory.glob("*/cell.json")):
        sweeps = sorted({p.parent.parent.name for p in directory.glob("*/*/cell.json")})
        hint = f"; it looks like a store root holding sweeps {sweeps}: pass sweep=NAME" if sweeps else ""
        raise FileNotFoundError(f"{directory} holds no cells (no */cell.json){hint}")
    return directory


def parse_where(items: Iterable[str]) -> dict[str, Any]:
    """``["backend.steps=5", "policy_name=fisher"]`` -> ``{"backend.steps": 5, ...}``.

    Values are read as YAML scalars, the way Hydra reads overrides (``5`` an int, ``0.07`` a
    float, ``true`` a bool, ``null`` None); a value that is not valid YAML stays a string.
    """
    where: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"where {item!r}: expected KEY=VALUE, e.g. backend.steps=5")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        where[key.strip()] = value
    return where


def varied_config_keys(cells: list[_LoadedCell]) -> tuple[list[str], dict[str, str]]:
    """Config keys whose value differs between ``cells`` and that make an arm (module doc).

    Returns the arm keys and, apart, the varied keys that another arm key determines, each with
    the key that determines it: a named regime of a backend (``backend=synthetic_async``) sets
    ``backend.regime`` together with its settings (``backend.rollout_lag``), and those settings
    add no arm of their own. Keys with more distinct values are kept first, then by name.
    """
    keys = sorted({key for cell in cells for key in cell.config if not _not_arm_key(key)})
    values: dict[str, list[Any]] = {}
    for key in keys:
        column = [_hashable(cell.config.get(key, _MISSING)) for cell in cells]
        if len(set(column)) < 2:
            continue
        if key.startswith("policy.") and _fixed_within_policy_arms(cells, key):
            continue  # the arm name (fisher[tau=1.0]) already tells these cells apart
        values[key] = column
    varied: list[str] = []
    determined: dict[str, str] = {}
    for key in sorted(values, key=lambda k: (-len(set(values[k])), k)):
        by = next((kept for kept in varied if _determines(values[kept], values[key])), None)
        if by is None:
            varied.append(key)
        else:
            determined[key] = by
    return sorted(varied), determined


def varied_policy_settings(cells: list[_LoadedCell], config_keys: list[str]) -> list[str]:
    """``policy.*`` keys (besides the name) whose value differs between cells and that are no arm keys."""
    keys = sorted({key for cell in cells for key in cell.config
                   if key.startswith("policy.") and key != "policy.name" and key not in config_keys})
    return [key for key in keys if len({_hashable(cell.config.get(key, _MISSING)) for cell in cells}) > 1]


def _determines(cause: list[Any], effect: list[Any]) -> bool:
    """Whether each value of ``cause`` goes with one value of ``effect`` only."""
    seen: dict[Any, Any] = {}
    return all(seen.setdefault(c, e) == e for c, e in zip(cause, effect))


def _not_arm_key(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in NOT_ARM_KEYS)


def _fixed_within_policy_arms(cells: list[_LoadedCell], key: str) -> bool:
    values: dict[str, set[Any]] = {}
    for cell in cells:
        values.setdefault(cell.meta["policy"], set()).add(_hashable(cell.config.get(key, _MISSING)))
    return all(len(found) == 1 for found in values.values())


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _select(cells: list[_LoadedCell], where: dict[str, Any]) -> list[_LoadedCell]:
    """The cells whose identity column or config key equals each ``where`` value."""
    for key, wanted in where.items():
        found = [_lookup(cell, key) for cell in cells]
        present = [value for value in found if value is not _MISSING]
        if cells and not present:
            known = sorted({k for cell in cells for k in cell.config} | set(ID_COLUMNS))
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"where {key}={wanted!r}: no cell has a config key or column {key!r}{hint}")
        kept = [cell for cell, value in zip(cells, found) if _matches(value, wanted)]
        if cells and not kept:
            values = ", ".join(sorted({str(v) for v in present}))
            raise ValueError(f"where {key}={wanted!r}: no cell matches; {key} takes the values {values} here")
        cells = kept
    return cells


def _lookup(cell: _LoadedCell, key: str) -> Any:
    if key in ID_COLUMNS and key in cell.meta:
        return cell.meta[key]
    return cell.config.get(key, _MISSING)


def _matches(value: Any, wanted: Any) -> bool:
    if value is _MISSING:
        return False
    if value == wanted:
        return True
    return str(value) == str(wanted)


def _read_config(path: Path) -> dict[str, Any]:
    """A cell's resolved config, flattened with dots (the store checked that it exists)."""
    try:
        tree = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except (OSError, yaml.YAMLError) as error:
        raise CorruptCellError(f"{path}: unreadable config ({error}); expected the YAML written by ablate") from None
    if not isinstance(tree, dict):
        raise CorruptCellError(f"{path}: corrupt config: expected a YAML mapping, found {type(tree).__name__}")
    return flatten_config(tree)


def flatten_config(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Nested config -> ``{"backend.steps": 100, ...}`` (lists stay values)."""
    if not tree:
        return {}
    row = pd.json_normalize(dict(tree), sep=".").iloc[0].to_dict()
    return {key: value.item() if isinstance(value, np.generic) else value for key, value in row.items()}


def _with_arm(meta: dict[str, Any]) -> dict[str, Any]:
    """``policy`` becomes the arm: the policy name plus its non-default settings, if any.

    Cells of one policy with other settings (``fisher[tau=1.0]``, ``random[per_layer=True]``) are
    different arms, so tables and effects keep them apart; ``policy_name`` keeps the bare name.
    """
    variant = meta.get("variant") or ""
    name = meta.get("policy")
    return {**meta, "policy_name": name, "variant": variant, "policy": arm_name(name, variant)}


def no_exclusions() -> dict[str, int]:
    """``df.attrs["excluded"]`` before counting: every kind of cell left out, at 0."""
    return {kind: 0 for kind in EXCLUDED_KINDS}


#: How the analysis counts a store cell that is not complete, by its :class:`~ablate.store.CellState`:
#: a cell started and never ended (killed, crashed, or claimed and killed before it started) is
#: "unfinished"; "running" is a cell a live worker holds now.
EXCLUDED_AS = {CellState.FAILED: "failed", CellState.INTERRUPTED: "interrupted", CellState.RUNNING: "running",
               CellState.UNFINISHED: "unfinished", CellState.NEW: "unfinished", CellState.CORRUPT: "corrupt"}
EXCLUDED_KINDS = ("failed", "interrupted", "running", "unfinished", "corrupt")


def _read_store(sweep_path: Path, on_corrupt: str) -> tuple[list[_LoadedCell], dict[str, int], list[str]]:
    """The complete cells of a sweep directory, read through the store (:func:`ablate.store.inspect_cell`).

    The store decides what a cell is: complete only with a valid identity that names its own
    directory, its config, summary and Parquet records; everything else is counted by state.
    """
    cells: list[_LoadedCell] = []
    excluded = no_exclusions()
    corrupt: list[str] = []
    for cell_dir in cell_directories(sweep_path):
        view = inspect_cell(cell_dir)
        try:
            if view.state is CellState.CORRUPT:
                raise CorruptCellError(view.detail or f"{cell_dir}: corrupt cell")
            if view.state is not CellState.COMPLETE:
                excluded[EXCLUDED_AS[view.state]] += 1
                continue
            try:
                identity = read_identity(cell_dir)
                records = read_records(cell_dir)
            except StoreError as error:
                raise CorruptCellError(str(error)) from error
            config = _read_config(cell_dir / "config.yaml")
        except CorruptCellError as error:
            if on_corrupt == "error":
                raise
            excluded["corrupt"] += 1
            corrupt.append(str(error))
            continue
        meta = {
            **identity.to_json(), "sweep": identity.sweep or sweep_path.name, "status": CellState.COMPLETE.value,
            "path": str(cell_dir), "schema_version": _version(identity.schema_version or config.get("schema_version")),
        }
        cells.append(_LoadedCell(_with_arm(meta), config, records))
    return cells, excluded, corrupt


def _probe_table(cells: list[_LoadedCell]) -> dict[str, dict[str, Any]]:
    """The probe tables of the cells' configs (ablate.probes), merged by probe id: one id names one probe."""
    table: dict[str, dict[str, Any]] = {}
    for cell in cells:
        for row in cell.config.get("probes") or []:
            table.setdefault(str(row["id"]), dict(row))
    return table


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


def _wandb_cell(config: dict[str, Any], records: pd.DataFrame, *, group: str, name: str, run_id: str,
                path: str) -> _LoadedCell:
    """A cell from the flattened config the cell runner gives W&B (offline or online)."""
    meta = _with_arm({
        "sweep": group,
        "cell_id": config.get("cell_id", run_id),
        "name": name,
        "backend": config.get("backend"),
        "policy": config.get("policy"),
        "budget": config.get("budget"),
        "seed": config.get("seed"),
        "variant": config.get("variant", ""),
        "schema_version": _version(config.get("schema_version")),
        "status": "complete",
        "path": path,
    })
    flat = flatten_config({k: v for k, v in config.items() if k not in WANDB_IDENTITY_KEYS and not k.startswith("_")})
    return _LoadedCell(meta, flat, records)


def _read_wandb_offline(
    root: Path, sweep: str | None, on_corrupt: str
) -> tuple[list[_LoadedCell], dict[str, int], list[str]]:
    from ablate.tracking.offline_reader import find_offline_runs, history_frame, read_offline_run

    cells: list[_LoadedCell] = []
    excluded = no_exclusions()
    corrupt: list[str] = []
    for run_dir in find_offline_runs(root):
        try:
            run = read_offline_run(run_dir)
        except ValueError as error:
            if on_corrupt == "error":
                raise CorruptCellError(str(error)) from error
            excluded["corrupt"] += 1
            corrupt.append(str(error))
            continue
        if (sweep is not None and run.group != sweep) or run.job_type == SUMMARY_JOB_TYPE:
            continue
        if not run.complete:
            excluded["running"] += 1
            continue
        if run.exit_code:
            excluded["failed"] += 1
            continue
        cells.append(_wandb_cell(run.config, history_frame(run), group=run.group, name=run.name,
                                 run_id=run.run_id, path=str(run.path)))
    return cells, excluded, corrupt


def _read_wandb_api(project_path: str, sweep: str | None) -> tuple[list[_LoadedCell], dict[str, int], list[str]]:
    import wandb

    filters = {"group": sweep} if sweep else {}
    cells: list[_LoadedCell] = []
    excluded = no_exclusions()
    for run in wandb.Api().runs(project_path, filters=filters):
        if run.job_type == SUMMARY_JOB_TYPE:
            continue
        if run.state != "finished":
            excluded["failed" if run.state in ("failed", "crashed") else "running"] += 1
            continue
        records = pd.DataFrame(list(run.scan_history()))
        if "step" not in records.columns and "_step" in records.columns:
            records = records.rename(columns={"_step": "step"})
        records = records[[c for c in records.columns if not c.startswith("_")]]
        cells.append(_wandb_cell(dict(run.config), records, group=run.group, name=run.name, run_id=run.id,
                                 path=run.url))
    return cells, excluded, []


def _metric_columns(records: pd.DataFrame) -> list[str]:
    return [c for c in records.columns if c != "step" and pd.api.types.is_numeric_dtype(records[c])]


def _identity(cell: _LoadedCell, config_keys: list[str]) -> dict[str, Any]:
    row = {key: cell.meta.get(key) for key in (*ID_COLUMNS, "path")}
    row.update({key: _plain(cell.config.get(key)) for key in config_keys})
    return row


def _cells_frame(cells: list[_LoadedCell], config_keys: list[str], settings: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for cell in cells:
        row = _identity(cell, config_keys)
        row.update(cell_outcomes(cell.records, **settings))
        ordered = cell.records.sort_values("step") if "step" in cell.records.columns else cell.records
        for key in _metric_columns(ordered):
            values = ordered[key].to_numpy(dtype=float)
            finite = values[np.isfinite(values)]
            row[key] = float(finite[-1]) if finite.size else math.nan
        rows.append(row)
    return _typed(pd.DataFrame(rows, columns=None if rows else [*ID_COLUMNS, "path", *config_keys]))


def _steps_frame(cells: list[_LoadedCell], config_keys: list[str]) -> pd.DataFrame:
    parts = []
    for cell in cells:
        identity = _identity(cell, config_keys)
        part = cell.records.copy()
        for key in reversed(list(identity)):
            part.insert(0, key, identity[key])
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=[*ID_COLUMNS, "path", *config_keys, "step"])
    return _typed(pd.concat(parts, ignore_index=True))


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    if not frame.empty:
        frame["budget"] = pd.to_numeric(frame["budget"], errors="coerce").astype(float)
        frame["seed"] = pd.to_numeric(frame["seed"], errors="coerce").astype("Int64")
    return frame


def _report_excluded(excluded: dict[str, int], corrupt: list[str], where: str) -> None:
    if not any(excluded.values()):
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in excluded.items() if n)
    message = f"{where}: excluded {counts} cell(s) from the analysis (only complete cells are used)"
    if corrupt:
        message += "; corrupt: " + "; ".join(corrupt)
    warnings.warn(message, ExcludedCellsWarning, stacklevel=3)


def _report_schema_versions(cells: list[_LoadedCell], where: str) -> None:
    versions = Counter(str(cell.meta.get("schema_version")) for cell in cells)
    if len(versions) < 2:
        return
    counts = ", ".join(f"{version} ({n} cells)" for version, n in sorted(versions.items()))
    newest = max(versions, key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")))
    warnings.warn(
        f"{where}: cells of diagnostics schema versions {counts} are mixed: they are compared only "
        f"within one version (schema_version is part of the arm); keep one with "
        f"where schema_version={newest}",
        MixedSchemaWarning, stacklevel=3,
    )
