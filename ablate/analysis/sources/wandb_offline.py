"""W&B offline run directories as a source: every run found under a folder (a store's cells keep
theirs in ``wandb/``), decoded with :mod:`ablate.tracking.offline_reader`.

``sweep`` keeps only the runs of that W&B group; runs of ``job_type="summary"`` (logged by
``ablate-analyze --dashboard``) hold analysis results, not cells, and are skipped. A run without
its exit record is counted "running", one that exited non-zero "failed"; a run that cannot be
decoded is corrupt.
"""

from __future__ import annotations

from pathlib import Path

from ablate.analysis.sources import SUMMARY_JOB_TYPE, CorruptCellError, Loaded, LoadedCell, no_exclusions, wandb_cell


def read_wandb_offline(root: Path, sweep: str | None, on_corrupt: str) -> Loaded:
    from ablate.tracking.offline_reader import find_offline_runs, history_frame, read_offline_run

    cells: list[LoadedCell] = []
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
        cells.append(wandb_cell(run.config, history_frame(run), group=run.group, name=run.name,
                                run_id=run.run_id, path=str(run.path)))
    return Loaded.from_cells(cells, excluded, corrupt)
