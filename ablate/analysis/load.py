"""Load a sweep into a tidy frame: one row per cell (or per cell and step).

Sources (each a module of :mod:`ablate.analysis.sources`):

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
``trial``) and policy settings the arm name already carries are not arm keys
(:mod:`ablate.analysis.varied`). The varied keys
are listed in ``df.attrs["config_keys"]``: the tables group by them, so a sweep over
``backend.router_noise`` (or a rerun with another ``backend.steps``) gives separate arms
instead of clashing rows. A varied key whose value another arm key determines (the settings of a
named regime, ``backend=synthetic_async``, go with ``backend.regime``) is no arm key of its own:
``df.attrs["determined_keys"]`` maps it to the key that determines it; ``df.attrs["analysis"]``
holds what the sweep file declared of its own analysis (primary questions, outcomes, margins:
:mod:`ablate.analysis.declared`). ``where={"backend.steps": 5}`` keeps only the matching cells first
(any config key or identity column); keys that no longer vary are then no arm keys.

Then the outcomes of :func:`ablate.outcomes.cell_outcomes` and the last finite value of
every logged diagnostics key. A store cell's outcomes are those its ``summary.json`` holds (the
runner computed them with the same function from the same records) when the summary has every
outcome and is no older than the records; otherwise, for W&B runs, and whenever
``outcome_settings`` are given (so analysis settings can change after the sweep), they are
computed from the per-step records.

Cells of different diagnostics schema versions in one sweep are not comparable key by key: a
:class:`MixedSchemaWarning` names the versions and their counts, and ``schema_version`` becomes
an arm key, so cells are compared only within one version (``where={"schema_version": "1.0"}``
keeps one). A version whose records only add keys to an earlier one's
(:data:`ablate.diagnostics.schema.EXTENDS`) counts as that one.

Only complete cells are kept, and the store decides which those are: the loader reads every
cell through :mod:`ablate.store` (:func:`~ablate.store.inspect_cell`, :func:`~ablate.store.read_identity`,
:func:`~ablate.store.read_records_table`), the same reader the sweeps resume by. Other cells are
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

Every cell's records are read into one frame (:class:`ablate.analysis.sources.Loaded`) and both
frames are built from it by column operations: loading costs the parsing of the cells' files, not
a pandas frame per cell.
"""

from __future__ import annotations

import difflib
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import numpy as np
import pandas as pd
import yaml

from ablate.analysis.declared import declared_analysis
from ablate.analysis.sources import CELL, CorruptCellError, Loaded, LoadedCell
from ablate.analysis.sources.store import read_store
from ablate.analysis.varied import MISSING, varied_config_keys, varied_policy_settings
from ablate.diagnostics.schema import comparable_version
from ablate.outcomes import OUTCOME_NAMES, cell_outcomes

__all__ = ["CorruptCellError", "ExcludedCellsWarning", "MixedSchemaWarning", "SweepFrames", "load_runs", "parse_where",
           "find_sweep", "read_sweep"]

ID_COLUMNS: tuple[str, ...] = (
    "sweep", "cell_id", "name", "backend", "policy", "policy_name", "variant", "budget", "seed",
    "schema_version", "streams", "status",
)
Source = Literal["store", "wandb-offline", "wandb"]


class ExcludedCellsWarning(UserWarning):
    """Some cells of a sweep were left out of the analysis (failed, unfinished or corrupt)."""


class MixedSchemaWarning(UserWarning):
    """The cells of one sweep were logged under different diagnostics schema versions."""


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
    read = _read_sweep(path, sweep, source, on_corrupt, where)
    return read.steps_frame() if per_step else read.cells_frame(outcome_settings)


def read_sweep(
    path: str | Path,
    sweep: str | None = None,
    *,
    source: Source = "store",
    on_corrupt: Literal["error", "exclude"] = "error",
    where: Mapping[str, Any] | None = None,
) -> "SweepFrames":
    """Read a sweep once, for both of :func:`load_runs`' frames (``ablate-analyze`` needs both).

    ``read_sweep(...).cells_frame()`` is ``load_runs(...)`` and ``.steps_frame()`` is
    ``load_runs(..., per_step=True)``, with the same warnings, from one read of the files.
    """
    return _read_sweep(path, sweep, source, on_corrupt, where)


def _read_sweep(path: str | Path, sweep: str | None, source: Source, on_corrupt: str,
                where: Mapping[str, Any] | None) -> "SweepFrames":
    if on_corrupt not in ("error", "exclude"):
        raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'error' or 'exclude'")
    if source == "store":
        loaded = read_store(find_sweep(Path(path), sweep), on_corrupt)
    elif source == "wandb-offline":
        from ablate.analysis.sources.wandb_offline import read_wandb_offline

        loaded = read_wandb_offline(Path(path), sweep, on_corrupt)
    elif source == "wandb":
        from ablate.analysis.sources.wandb_api import read_wandb_api

        loaded = read_wandb_api(str(path), sweep)
    else:
        raise ValueError(f"source={source!r}: expected 'store', 'wandb-offline' or 'wandb'")
    read = SweepFrames(_select(loaded, dict(where or {})), {key: _plain(value) for key, value in (where or {}).items()})
    _report_excluded(loaded.excluded, loaded.corrupt, str(path))
    _report_schema_versions(read.loaded.cells, str(path))
    return read


class SweepFrames:
    """The complete cells of a sweep as read once, and the two frames of :func:`load_runs` built from them."""

    def __init__(self, loaded: Loaded, where: dict[str, Any]) -> None:
        self.loaded, self.where = loaded, where
        self.config_keys, self.determined = varied_config_keys(loaded.cells)
        # Policy settings that vary are in the arm's name (fisher[tau=1.0]), not arm keys; their own
        # columns let one compare two of their values (ablate.analysis.compare).
        self.policy_settings = varied_policy_settings(loaded.cells, self.config_keys)

    def cells_frame(self, outcome_settings: Mapping[str, Any] | None = None) -> pd.DataFrame:
        """One row per cell: ``load_runs(...)``."""
        frame = _cells_frame(self.loaded, [*self.config_keys, *self.policy_settings], dict(outcome_settings or {}))
        return self._with_attrs(frame, self.policy_settings)

    def steps_frame(self) -> pd.DataFrame:
        """One row per cell and step: ``load_runs(..., per_step=True)``."""
        return self._with_attrs(_steps_frame(self.loaded, self.config_keys), [])

    def _with_attrs(self, frame: pd.DataFrame, policy_settings: list[str]) -> pd.DataFrame:
        cells = self.loaded.cells
        frame.attrs.update(  # each frame its own copies: attrs are mutable
            excluded=dict(self.loaded.excluded), corrupt_files=list(self.loaded.corrupt),
            config_keys=list(self.config_keys), policy_settings=list(policy_settings),
            determined_keys=dict(self.determined), where=dict(self.where), probes=_probe_table(cells),
            analysis=declared_analysis((cell.meta.get("path", cell.meta.get("name")), cell.config) for cell in cells),
        )
        return frame


def find_sweep(path: Path, sweep: str | None = None) -> Path:
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


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _select(loaded: Loaded, where: dict[str, Any]) -> Loaded:
    """The cells whose identity column or config key equals each ``where`` value."""
    cells = loaded.cells
    keep = list(range(len(cells)))
    for key, wanted in where.items():
        found = [_lookup(cells[i], key) for i in keep]
        present = [value for value in found if value is not MISSING]
        if keep and not present:
            known = sorted({k for i in keep for k in cells[i].config} | set(ID_COLUMNS))
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"where {key}={wanted!r}: no cell has a config key or column {key!r}{hint}")
        kept = [i for i, value in zip(keep, found) if _matches(value, wanted)]
        if keep and not kept:
            values = ", ".join(sorted({str(v) for v in present}))
            raise ValueError(f"where {key}={wanted!r}: no cell matches; {key} takes the values {values} here")
        keep = kept
    return loaded.subset(keep)


def _lookup(cell: LoadedCell, key: str) -> Any:
    if key in ID_COLUMNS and key in cell.meta:
        return cell.meta[key]
    return cell.config.get(key, MISSING)


def _matches(value: Any, wanted: Any) -> bool:
    if value is MISSING:
        return False
    if value == wanted:
        return True
    return str(value) == str(wanted)


def _probe_table(cells: list[LoadedCell]) -> dict[str, dict[str, Any]]:
    """The probe tables of the cells' configs (ablate.probes), merged by probe id: one id names one probe."""
    table: dict[str, dict[str, Any]] = {}
    for cell in cells:
        for row in cell.config.get("probes") or []:
            table.setdefault(str(row["id"]), dict(row))
    return table


def _identity_frame(cells: list[LoadedCell], config_keys: list[str]) -> pd.DataFrame:
    """One row per cell: its identity columns, ``path`` and the config keys."""
    columns = [*ID_COLUMNS, "path", *config_keys]
    rows = [[cell.meta.get(key) for key in (*ID_COLUMNS, "path")] + [_plain(cell.config.get(key)) for key in config_keys]
            for cell in cells]
    return pd.DataFrame(rows, columns=columns) if rows else pd.DataFrame(columns=columns)


def _cells_frame(loaded: Loaded, config_keys: list[str], settings: dict[str, Any]) -> pd.DataFrame:
    """Identity and config keys, then the outcomes, then the last finite value of every numeric key."""
    if not loaded.cells:
        return _identity_frame(loaded.cells, config_keys)
    records = loaded.records
    starts = np.searchsorted(records[CELL].to_numpy(), np.arange(len(loaded.cells) + 1))
    outcomes = pd.DataFrame(
        [cell.outcomes if cell.outcomes is not None and not settings
         else cell_outcomes(records.iloc[starts[i]:starts[i + 1]], **settings)
         for i, cell in enumerate(loaded.cells)],
        columns=list(OUTCOME_NAMES))
    last = _last_finite(records, len(loaded.cells))
    for key in [c for c in last.columns if c in outcomes.columns]:  # a logged key of an outcome's name wins
        outcomes[key] = last.pop(key)
    return _typed(pd.concat([_identity_frame(loaded.cells, config_keys), outcomes, last], axis=1))


def _last_finite(records: pd.DataFrame, n_cells: int) -> pd.DataFrame:
    """Per cell (rows in cell order), the last finite value by step of every numeric column but ``step``."""
    metrics = [c for c in records.columns if c not in ("step", CELL) and pd.api.types.is_numeric_dtype(records[c])]
    if "step" in records.columns and not _sorted_within_cells(records):
        records = records.sort_values([CELL, "step"], kind="stable")
    values = records[metrics].astype(float)
    values = values.where(np.isfinite(values.to_numpy()))
    last = values.groupby(records[CELL].to_numpy(), sort=True).last()
    return last.reindex(range(n_cells)).reset_index(drop=True)


def _sorted_within_cells(records: pd.DataFrame) -> bool:
    cell, step = records[CELL].to_numpy(), records["step"].to_numpy()
    same_cell = cell[1:] == cell[:-1]
    return bool(np.all(~same_cell | (step[1:] >= step[:-1])))


def _steps_frame(loaded: Loaded, config_keys: list[str]) -> pd.DataFrame:
    identity = _identity_frame(loaded.cells, config_keys)
    if not loaded.cells:
        return identity.assign(step=pd.Series(dtype=object))
    records = loaded.records
    rows = identity.take(records[CELL].to_numpy()).reset_index(drop=True)
    steps = records.drop(columns=[CELL, *[c for c in identity.columns if c in records.columns]])
    return _typed(pd.concat([rows, steps.reset_index(drop=True)], axis=1))


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    if not frame.empty:
        frame["budget"] = pd.to_numeric(frame["budget"], errors="coerce").astype(float)
        frame["seed"] = pd.to_numeric(frame["seed"], errors="coerce").astype("Int64")
    return frame


#: Where a warning points: the caller of load_runs or read_sweep (warn, _report_*, _read_sweep, the public function).
_CALLER = 4


def _report_excluded(excluded: dict[str, int], corrupt: list[str], where: str) -> None:
    if not any(excluded.values()):
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in excluded.items() if n)
    message = f"{where}: excluded {counts} cell(s) from the analysis (only complete cells are used)"
    if corrupt:
        message += "; corrupt: " + "; ".join(corrupt)
    warnings.warn(message, ExcludedCellsWarning, stacklevel=_CALLER)


def _report_schema_versions(cells: list[LoadedCell], where: str) -> None:
    schemes = Counter(int(cell.meta.get("streams") or 1) for cell in cells)
    if len(schemes) > 1:
        counts = ", ".join(f"{scheme} ({n} cells)" for scheme, n in sorted(schemes.items()))
        warnings.warn(
            f"{where}: cells of seed schemes {counts} are mixed: a seed draws other data under each, so they are "
            f"paired only within one scheme (streams is part of the arm); keep the newest with where streams="
            f"{max(schemes)}, or rerun the older cells", MixedSchemaWarning, stacklevel=_CALLER)
    if len({comparable_version(cell.meta.get("schema_version")) for cell in cells}) < 2:
        return  # versions whose records only add keys to each other's are compared as one
    versions = Counter(str(cell.meta.get("schema_version")) for cell in cells)
    if len(versions) < 2:
        return
    counts = ", ".join(f"{version} ({n} cells)" for version, n in sorted(versions.items()))
    newest = max(versions, key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split(".")))
    warnings.warn(
        f"{where}: cells of diagnostics schema versions {counts} are mixed: they are compared only "
        f"within one version (schema_version is part of the arm); keep one with "
        f"where schema_version={newest}",
        MixedSchemaWarning, stacklevel=_CALLER,
    )
