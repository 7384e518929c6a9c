"""A one-line progress display for long cells that stays quiet when output is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 interval: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.label, self.total, self.interval = label, total, interval
        self._last = 0.0

    def update(self, step: int, record: dict[str, float]) -> None:
        if not self.enabled or (time.monotonic() - self._last < self.interval and step + 1 < self.total):
            return
        self._last = time.monotonic()
        reward = record.get("train/reward", float("nan"))
        mismatch = record.get("routing/route_mismatch_rate", float("nan"))
        self.stream.write(f"\r{self.label}: step {step + 1}/{self.total}  reward {reward:.3f}  "
                          f"route mismatch {mismatch:.3f}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
