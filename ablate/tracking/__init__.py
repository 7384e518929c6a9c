"""W&B tracking for cells: a failure-proof run wrapper and a reader for offline runs."""

from ablate.tracking.offline_reader import (
    OfflineRun,
    find_offline_runs,
    history_frame,
    is_complete,
    read_offline_run,
)
from ablate.tracking.wandb_run import TRACKER_MODES, WandbTracker, restart_wandb, start_tracker

__all__ = [
    "TRACKER_MODES",
    "OfflineRun",
    "WandbTracker",
    "find_offline_runs",
    "history_frame",
    "is_complete",
    "read_offline_run",
    "restart_wandb",
    "start_tracker",
]
