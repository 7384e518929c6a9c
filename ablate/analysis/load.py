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
status`` (store cells also ``path``). ``policy`` is the arm: the policy name, plus its non-default
settings in brackets when it has any (``fisher[tau=1.0]``), so a settings sweep gives one row per
arm in the tables; ``policy_name`` is the bare name. Then the outcomes of :func:`ablate.analysis.outcomes.cell_outcomes`,
recomputed from the per-step records with ``outcome_settings`` (so analysis settings can
change after the sweep), and the last finite value of every logged diagnostics key.

Only complete cells are kept. Failed and unfinished cells are excluded and counted, never
silently: an :class:`ExcludedCellsWarning` (``warnings.warn``; routed to ``logging`` under
``logging.captureWarnings(True)``) names the counts and ``df.attrs["excluded"]`` holds
``{"failed": n, "running": m, "corrupt": k}`` ("running" includes cells without a
``status.json``, i.e. not started). A corrupt cell (unreadable ``cell.json``, ``status.json`` or
``records.parquet``, or a complete cell without records) raises :class:`CorruptCellError` naming
the file; with ``on_corrupt="exclude"`` it is excluded instead, counted under ``"corrupt"``, its
file listed in ``df.attrs["corrupt_files"]`` and named in the warning.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import pandas as pd

from ablate.analysis.outcomes import cell_outcomes
from ablate.store import StoreError, read_json

ID_COLUMNS: tuple[str, ...] = (
    "sweep", "cell_id", "name", "backend", "policy", "policy_name", "variant", "budget", "seed", "status",
)


def _with_arm(meta: dict[str, Any]) -> dict[str, Any]:
    """``policy`` becomes the arm: the policy name plus its non-default settings, if any.

    Cells of one policy with other settings (``fisher[tau=1.0]``, ``random[per_layer=True]``) are
    different arms, so tables and effects keep them apart; ``policy_name`` keeps the bare name.
    """
    variant = meta.get("variant") or ""
    name = meta.get("policy")
    return {**meta, "policy_name": name, "variant": variant, "policy": f"{name}[{variant}]" if variant else name}
Source = Literal["store", "wandb-offline", "wandb"]
#: W&B runs of this job type hold analysis results, not cells (see ``dashboard.log_summary_table``).
SUMMARY_JOB_TYPE = "summary"


class CorruptCellError(RuntimeError):
    """A run-store file that exists but cannot be read (the message names the file)."""


class ExcludedCellsWarning(UserWarning):
    """Some cells of a sweep were left out of the analysis (failed, unfinished or corrupt)."""


def load_runs(
    path: str | Path,
    sweep: str | None = None,
    *,
    source: Source = "store",
    per_step: bool = False,
    outcome_settings: Mapping[str, Any] | None = None,
    on_corrupt: Literal["error", "exclude"] = "error",
) -> pd.DataFrame:
    """One row per complete cell (``per_step=True``: per cell and step); see the module doc."""
    if on_corrupt not in ("error", "exclude"):
        raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'error' or 'exclude'")
    settings = dict(outcome_settings or {})
    if source == "store":
        cells, excluded, corrupt = _read_store(_sweep_dir(Path(path), sweep), on_corrupt)
    elif source == "wandb-offline":
        cells, excluded, corrupt = _read_wandb_offline(Path(path), sweep, on_corrupt)
    elif source == "wandb":
        cells, excluded, corrupt = _read_wandb_api(str(path), sweep)
    else:
        raise ValueError(f"source={source!r}: expected 'store', 'wandb-offline' or 'wandb'")
    frame = _steps_frame(cells) if per_step else _cells_frame(cells, settings)
    frame.attrs["excluded"] = excluded
    frame.attrs["corrupt_files"] = corrupt
    _report_excluded(excluded, corrupt, str(path))
    return frame


def _sweep_dir(path: Path, sweep: str | None) -> Path:
    sweep_dir = path / sweep if sweep else path
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {sweep_dir} does not exist")
    if not any(sweep_dir.glob("*/cell.json")):
        sweeps = sorted(p.parent.parent.name for p in sweep_dir.glob("*/*/cell.json"))
        hint = f"; it looks like a store root holding sweeps {sorted(set(sweeps))}: pass sweep=NAME" if sweeps else ""
        raise FileNotFoundError(f"{sweep_dir} holds no cells (no */cell.json){hint}")
    return sweep_dir


def _read_json(path: Path) -> dict[str, Any]:
    """The store's own reader; its errors name the file and become this module's corrupt-cell error."""
    try:
        return read_json(path)
    except StoreError as error:
        raise CorruptCellError(str(error)) from error


def _read_records(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise CorruptCellError(f"{path}: missing, but the cell's status is 'complete'")
    try:
        return pd.read_parquet(path)
    except Exception as error:  # pyarrow raises several unrelated types for a damaged file
        raise CorruptCellError(f"{path}: unreadable parquet ({type(error).__name__}: {error})") from error


def _read_store(
    sweep_dir: Path, on_corrupt: str
) -> tuple[list[tuple[dict[str, Any], pd.DataFrame]], dict[str, int], list[str]]:
    cells: list[tuple[dict[str, Any], pd.DataFrame]] = []
    excluded = {"failed": 0, "running": 0, "corrupt": 0}
    corrupt: list[str] = []
    for cell_file in sorted(sweep_dir.glob("*/cell.json")):
        cell_dir = cell_file.parent
        try:
            meta = _read_json(cell_file)
            status_file = cell_dir / "status.json"
            status = _read_json(status_file).get("status") if status_file.exists() else "running"
            if status != "complete":
                excluded["failed" if status == "failed" else "running"] += 1
                continue
            records = _read_records(cell_dir / "records.parquet")
        except CorruptCellError as error:
            if on_corrupt == "error":
                raise
            excluded["corrupt"] += 1
            corrupt.append(str(error))
            continue
        meta = {**meta, "sweep": meta.get("sweep", sweep_dir.name), "status": status, "path": str(cell_dir)}
        cells.append((_with_arm(meta), records))
    return cells, excluded, corrupt


def _wandb_meta(config: dict[str, Any], *, group: str, name: str, run_id: str, path: str) -> dict[str, Any]:
    """A cell's identity from the flattened config the cell runner gives W&B (offline or online)."""
    return _with_arm({
        "sweep": group,
        "cell_id": config.get("cell_id", run_id),
        "name": name,
        "backend": config.get("backend"),
        "policy": config.get("policy"),
        "budget": config.get("budget"),
        "seed": config.get("seed"),
        "variant": config.get("variant", ""),
        "status": "complete",
        "path": path,
    })


def _read_wandb_offline(
    root: Path, sweep: str | None, on_corrupt: str
) -> tuple[list[tuple[dict[str, Any], pd.DataFrame]], dict[str, int], list[str]]:
    from ablate.tracking.offline_reader import find_offline_runs, history_frame, read_offline_run

    cells: list[tuple[dict[str, Any], pd.DataFrame]] = []
    excluded = {"failed": 0, "running": 0, "corrupt": 0}
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
        meta = _wandb_meta(run.config, group=run.group, name=run.name, run_id=run.run_id, path=str(run.path))
        cells.append((meta, history_frame(run)))
    return cells, excluded, corrupt


def _read_wandb_api(
    project_path: str, sweep: str | None
) -> tuple[list[tuple[dict[str, Any], pd.DataFrame]], dict[str, int], list[str]]:
    import wandb

    filters = {"group": sweep} if sweep else {}
    cells: list[tuple[dict[str, Any], pd.DataFrame]] = []
    excluded = {"failed": 0, "running": 0, "corrupt": 0}
    for run in wandb.Api().runs(project_path, filters=filters):
        if run.job_type == SUMMARY_JOB_TYPE:
            continue
        if run.state != "finished":
            excluded["failed" if run.state in ("failed", "crashed") else "running"] += 1
            continue
        config = dict(run.config)
        records = pd.DataFrame(list(run.scan_history()))
        if "step" not in records.columns and "_step" in records.columns:
            records = records.rename(columns={"_step": "step"})
        records = records[[c for c in records.columns if not c.startswith("_")]]
        meta = _wandb_meta(config, group=run.group, name=run.name, run_id=run.id, path=run.url)
        cells.append((meta, records))
    return cells, excluded, []


def _metric_columns(records: pd.DataFrame) -> list[str]:
    return [c for c in records.columns if c != "step" and pd.api.types.is_numeric_dtype(records[c])]


def _cells_frame(cells: list[tuple[dict[str, Any], pd.DataFrame]], settings: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for meta, records in cells:
        row = {key: meta.get(key) for key in (*ID_COLUMNS, "path")}
        row.update(cell_outcomes(records, **settings))
        ordered = records.sort_values("step") if "step" in records.columns else records
        for key in _metric_columns(ordered):
            values = ordered[key].to_numpy(dtype=float)
            finite = values[np.isfinite(values)]
            row[key] = float(finite[-1]) if finite.size else math.nan
        rows.append(row)
    return _typed(pd.DataFrame(rows, columns=None if rows else [*ID_COLUMNS, "path"]))


def _steps_frame(cells: list[tuple[dict[str, Any], pd.DataFrame]]) -> pd.DataFrame:
    parts = []
    for meta, records in cells:
        part = records.copy()
        for key in reversed(ID_COLUMNS):
            part.insert(0, key, meta.get(key))
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=[*ID_COLUMNS, "step"])
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
