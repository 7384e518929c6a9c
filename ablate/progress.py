"""A single cell's progress bar on a terminal: steps, rate, ETA, and the last reward and mismatch.

Off a terminal it prints nothing per step (a log file would fill with carriage returns); the
runner ends every cell with one line saying how it ended and where its results are.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        stream = stream or sys.stderr
        self._bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total or None, desc=label, unit="step", file=stream, dynamic_ncols=True, leave=False)

    def update(self, step: int, record: dict[str, float]) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix(reward=f"{record.get('train/reward', float('nan')):.3f}",
                              mismatch=f"{record.get('routing/route_mismatch_rate', float('nan')):.3f}", refresh=False)
        self._bar.update(step + 1 - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
