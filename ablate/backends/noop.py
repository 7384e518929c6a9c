"""A backend that does no work: for measuring ablate's own per-cell overhead and testing sweeps.

Each step logs a constant reward. ``fail_seeds`` makes the cells of those seeds raise at
``fail_at_step``, to exercise failure isolation; ``step_seconds`` makes each step take that long,
so that tests can interrupt or kill a cell in the middle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ablate.backends import Backend, RunContext
from ablate.cell import Cell
from ablate.config import NoopConfig


class PlannedFailure(RuntimeError):
    """Raised on purpose by a noop cell listed in ``fail_seeds``."""


def run_cell_steps(cell: Cell, log_step: Callable[[int, dict[str, float]], None]) -> None:
    cfg = BACKEND.config_of(cell)
    for step in range(cfg.steps):
        if cell.seed in cfg.fail_seeds and step == cfg.fail_at_step:
            raise PlannedFailure(f"noop backend: seed {cell.seed} is in fail_seeds={list(cfg.fail_seeds)}")
        if cfg.step_seconds:
            time.sleep(cfg.step_seconds)
        log_step(step, {"train/reward": cfg.reward, "replay/budget_requested": cell.budget})


def run(cell: Cell, context: RunContext) -> None:
    run_cell_steps(cell, context.log_step)


BACKEND = Backend(name="noop", config=NoopConfig, run=run)
