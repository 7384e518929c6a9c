"""A backend that does no work: for measuring ablate's own per-cell overhead and testing sweeps.

Each step logs a constant reward. ``fail_seeds`` makes the cells of those seeds raise at
``fail_at_step``, to exercise failure isolation; ``step_seconds`` makes each step take that long,
so that tests can interrupt or kill a cell in the middle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ablate.backends import Backend, RunContext
from ablate.config import BackendConfig, is_number, require, require_int

if TYPE_CHECKING:  # the cell module imports torch; composing a config imports this one
    from ablate.cell import Cell


@dataclass
class NoopConfig(BackendConfig):
    """``backend=noop``: how many steps it logs, the reward it logs, which seeds fail and when."""

    name: str = "noop"
    steps: int = 1
    reward: float = 0.0
    fail_seeds: list[int] = field(default_factory=list)
    fail_at_step: int = 0
    #: Seconds each step sleeps: lets tests interrupt or kill a sweep in the middle of a cell.
    step_seconds: float = 0.0

    def check(self) -> None:
        k = self.KEY
        require_int(f"{k}.steps", self.steps, 1)
        require(is_number(self.reward), f"{k}.reward", self.reward, "a finite number")
        require_int(f"{k}.fail_at_step", self.fail_at_step, 0, self.steps - 1, f"{k}.steps={self.steps}")
        require(is_number(self.step_seconds) and self.step_seconds >= 0, f"{k}.step_seconds", self.step_seconds,
                "a finite number of seconds >= 0")


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
