"""``run_cell(cfg)``: one cell end to end, from a composed config to a complete run store entry.

Order matters for "nothing is lost": the config is validated before anything is written; every
step is appended to the store before it is sent to W&B; W&B can fail without failing the cell;
and whatever happens (an exception, Ctrl-C) the cell's status, records and W&B run are closed.
"""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ablate.analysis.outcomes import cell_outcomes
from ablate.backends import backend_runner
from ablate.cell import Cell, cell_from_config, resolved_config
from ablate.config import choice_value
from ablate.diagnostics import validate_record
from ablate.progress import Progress
from ablate.store import CellRecorder, held, is_complete, read_json, read_records, read_summary
from ablate.tracking import start_tracker

log = logging.getLogger(__name__)

#: Set to 1 (tests do) to make a schema violation an error instead of a logged warning.
STRICT_SCHEMA_ENV = "ABLATE_STRICT_SCHEMA"


def in_multirun() -> bool:
    """Inside a sweep the sweeper reports progress; a per-cell line would garble it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def store_root(cfg: DictConfig) -> Path:
    return Path(str(cfg.store_dir)).expanduser().absolute()


def cell_dir_of(cfg: DictConfig, cell: Cell) -> Path:
    return store_root(cfg) / cell.sweep / cell.dirname


def run_cell(cfg: DictConfig) -> dict[str, Any]:
    """Run one cell and return its summary; a complete cell is not rerun (``summary["skipped"]``)."""
    cell = cell_from_config(cfg)
    directory = cell_dir_of(cfg, cell)
    if is_complete(directory, cell.cell_id):
        log.info("%s: complete in %s, skipped", cell.name, directory)
        return {**read_summary(directory), "skipped": True}
    resolved = resolved_config(cfg)
    with held(directory) as claim:
        if is_complete(directory, cell.cell_id):  # another worker finished it while we looked
            return {**read_summary(directory), "skipped": True}
        previous = directory / "status.json"
        attempt = int(read_json(previous).get("attempt", 0)) + 1 if previous.exists() else 1
        recorder = CellRecorder(directory)
        recorder.start(
            {"cell_id": cell.cell_id, "name": cell.name, "sweep": cell.sweep, "backend": cell.backend.name,
             "policy": cell.policy, "budget": cell.budget, "seed": cell.seed, "trial": cell.trial,
             "variant": cell.variant, "settings": cell.policy_settings, "schema_version": resolved["schema_version"]},
            OmegaConf.to_yaml(resolved), attempt,
        )
        tracker = start_tracker(
            mode=choice_value(cfg.tracking.mode),
            project=cfg.tracking.project, entity=cfg.tracking.entity, tags=list(cfg.tracking.tags),
            run_dir=directory, group=cell.sweep, job_type=cell.policy, name=cell.name,
            config=cell.flat_config(resolved), init_timeout=cfg.tracking.init_timeout,
        )
        progress = Progress(cell.name, int(getattr(cell.backend, "steps", 0) or 0),
                            enabled=cfg.tracking.progress and not in_multirun())
        strict = os.environ.get(STRICT_SCHEMA_ENV) == "1"

        def log_step(step: int, record: dict[str, float], native: dict[str, float] | None = None) -> None:
            """One step: schema keys (validated) and backend-native metrics under their own names."""
            for problem in validate_record(record, strict=strict):
                recorder.warn(f"step {step}: {problem}")
            combined = {**(native or {}), **record}
            recorder.record(step, combined)
            tracker.log(combined, step=step)
            progress.update(step, record)
            claim.refresh()

        try:
            os.environ["ABLATE_CELL_DIR"] = str(directory)  # where a backend keeps its own files
            backend_runner(cell.backend.name)(cell, log_step)
            records = read_records(directory)
            summary = summarize_records(records)
            tracker.finish(summary=summary, exit_code=0)
            recorder.warnings.extend(tracker.warnings)
            recorder.complete(summary)
        except BaseException as error:
            tracker.finish(exit_code=1)
            recorder.warnings.extend(tracker.warnings)
            recorder.fail(error, traceback.format_exc())
            raise
        finally:
            progress.close()
    for warning in recorder.warnings:
        log.warning("%s: %s", cell.name, warning)
    return summary


def summarize_records(records) -> dict[str, Any]:
    """Outcomes (ablate.analysis.outcomes) plus the last value of every logged key."""
    summary: dict[str, Any] = {}
    if not records.empty:
        last = records.iloc[-1]
        summary.update({key: float(last[key]) for key in records.columns if key != "step"})
        summary["steps"] = int(len(records))
    summary.update(cell_outcomes(records))
    return summary


def objective(summary: dict[str, Any], name: str) -> float:
    if name not in summary:
        raise KeyError(f"objective={name!r} is not in the cell's summary: expected one of {', '.join(sorted(summary))}")
    return float(summary[name])
