"""The W&B API as a source: the runs of ``entity/project``, filtered by group (the sweep).

Runs of ``job_type="summary"`` are skipped; a run that has not finished is counted "failed"
(failed or crashed) or "running" (any other state). Needs a W&B login.
"""

from __future__ import annotations

import pandas as pd

from ablate.analysis.sources import SUMMARY_JOB_TYPE, Loaded, LoadedCell, no_exclusions, wandb_cell


def read_wandb_api(project_path: str, sweep: str | None) -> Loaded:
    import wandb

    filters = {"group": sweep} if sweep else {}
    cells: list[LoadedCell] = []
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
        cells.append(wandb_cell(dict(run.config), records, group=run.group, name=run.name, run_id=run.id,
                                path=run.url))
    return Loaded.from_cells(cells, excluded, [])
