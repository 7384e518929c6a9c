"""One batch of trials through the configured launcher, as a grid sweep launches its cells.

So a killed worker fails its own trial only, and Ctrl-C or SIGTERM records every running trial's
cell as interrupted, under every launcher. The result of each job, in order: its ``JobReturn``; a
:class:`StoreOutcome` read from the run store where the job returned none of its cell (stopped,
or its worker lost); a :class:`~ablate.config.ConfigError` for a job whose config is invalid (never
launched); or None for a trial to leave RUNNING (interrupted: the next run relaunches it).
"""

from __future__ import annotations

from typing import Any, Optional

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class BatchLauncher:
    """Launches batches of trial jobs through ``launcher``, numbering the jobs across batches."""

    def __init__(self, launcher: Launcher, compose: Any) -> None:
        self.launcher, self.compose = launcher, compose
        self.job_idx = 0

    def __call__(self, jobs: list[list[str]]) -> list[Any]:
        from ablate.config import ConfigError
        from ablate.launchers.stopping import settle
        from ablate.sweep import plan_grid

        planned: list[Any] = []
        for job in jobs:
            try:
                planned.append(plan_grid([job], self.compose)[0])
            except ConfigError as error:
                planned.append(error)
        cells = [cell for cell in planned if not isinstance(cell, ConfigError)]
        try:
            returns = self.launcher.launch([list(cell.overrides) for cell in cells], initial_job_idx=self.job_idx) if cells else []
        finally:
            settle(cells)  # a launcher may return while its workers still record their cells
        self.job_idx += len(cells)
        by_overrides = {tuple(result.overrides): result for result in returns if isinstance(result, JobReturn)}
        return [cell if isinstance(cell, ConfigError) else _result(cell, by_overrides.get(tuple(cell.overrides)))
                for cell in planned]


def _result(cell: Any, returned: Optional[JobReturn]) -> Any:
    from ablate.launchers.jobs import without_result
    from ablate.store import CellState, read_summary
    from ablate.sweep import outcome

    if not without_result(returned):
        return returned  # a result, or the job raised: the trial loop reads the error from it
    state, view = outcome(cell)
    if state is CellState.COMPLETE:
        return StoreOutcome(cell.cell, read_summary(cell.directory))
    if state is CellState.FAILED:
        return StoreOutcome(cell.cell, None, f"{cell.cell.name}: {view.detail or 'its worker died'}")
    return None  # interrupted or never started: RUNNING in the study, relaunched by the next run


class StoreOutcome:
    """A trial's result read from its cell in the run store, shaped as ``JobReturn.return_value`` is read."""

    def __init__(self, cell: Any, summary: Optional[dict[str, Any]], error: str = "") -> None:
        self.cell, self.summary, self.error = cell, summary, error

    @property
    def return_value(self) -> Any:
        from ablate.runner import objective_values

        if self.summary is None:
            raise RuntimeError(self.error)
        return objective_values(self.cell, self.summary)
