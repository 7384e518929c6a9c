"""A backend that does no work: for measuring ablate's own per-cell overhead and testing sweeps.

Each step logs a constant reward. ``fail_seeds`` makes the cells of those seeds raise at
``fail_at_step``, to exercise failure isolation.
"""

from __future__ import annotations

from collections.abc import Callable

from ablate.cell import Cell
from ablate.config import NoopConfig


class PlannedFailure(RuntimeError):
    """Raised on purpose by a noop cell listed in ``fail_seeds``."""


def run_cell_steps(cell: Cell, log_step: Callable[[int, dict[str, float]], None]) -> None:
    cfg: NoopConfig = cell.backend  # type: ignore[assignment]
    for step in range(cfg.steps):
        if cell.seed in cfg.fail_seeds and step == cfg.fail_at_step:
            raise PlannedFailure(f"noop backend: seed {cell.seed} is in fail_seeds={list(cfg.fail_seeds)}")
        log_step(step, {"train/reward": cfg.reward, "replay/budget_requested": cell.budget})
