"""Where log lines go: a cell's to its job's file, and to the console only for a cell run alone.

In a sweep the console belongs to the sweeper (its plan, its progress bar, its tally): a job's
own lines and the launcher's line per job would break the bar, so they go to files in the
sweep's Hydra folder (``conf/hydra/job_logging/ablate.yaml`` and
``conf/hydra/hydra_logging/ablate.yaml`` select these classes). A log file on a full disk
stops writing without a ``--- Logging error ---`` block per line: the store reports the full
disk once, where it matters.
"""

from __future__ import annotations

import logging

from ablate.store.files import is_disk_full


class OnlyOutsideSweeps(logging.Filter):
    """Lets records through for a cell run alone, none for a job of a sweep (decided when the
    job's logging is configured, once Hydra knows the job's mode)."""

    def __init__(self) -> None:
        super().__init__()
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        self.in_sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.in_sweep


class QuietWhenFull(logging.FileHandler):
    """A file handler that stops writing once its disk is full, instead of printing a traceback
    for every line it cannot write; any other error is reported as :mod:`logging` does."""

    full = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.full:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        import sys

        error = sys.exc_info()[1]
        if error is not None and is_disk_full(error):
            self.full = True
            return
        super().handleError(record)
