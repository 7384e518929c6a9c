"""Which sweeper process drives each trial, so that several of them can share one study.

Two sweepers started on one journal (two terminals, two SLURM jobs) ask the same study for
trials. ``n_trials`` is the study's total, whoever runs it: a new trial is asked for only while
the study holds fewer, and the count and the ask are one step under a lock beside the journal
(:func:`asking`), so two sweepers cannot both ask for the last one. A trial records the process
that drives it (:func:`mark`): a trial left RUNNING is relaunched by the next sweeper only once
that process is gone (:func:`abandoned`), never while another live sweeper runs it.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import optuna
from optuna.trial import FrozenTrial

from ablate.store import holder_is_alive, this_process

#: The user attribute of a trial that names its driver (host, pid, process start), as JSON.
DRIVER_ATTR = "ablate_driver"


def mark(study: optuna.Study, trial_id: int) -> None:
    """Record this process as the driver of the trial ``trial_id`` (asked for, or relaunched here)."""
    study._storage.set_trial_user_attr(trial_id, DRIVER_ATTR, json.dumps(this_process()))


def abandoned(trial: FrozenTrial) -> bool:
    """Whether a RUNNING trial's driver is gone: killed, or ended without telling its result.

    A trial without a recorded driver (an older ablate's) is abandoned, as every RUNNING trial
    was before. A driver on another host cannot be checked from here, and is taken to be alive.
    """
    recorded = trial.user_attrs.get(DRIVER_ATTR)
    if not isinstance(recorded, str):
        return True
    try:
        driver = json.loads(recorded)
    except ValueError:
        return True
    # Another host's driver leaves no heartbeat here: age 0 counts it alive.
    return not (isinstance(driver, dict) and holder_is_alive(driver, heartbeat_age=0.0))


@contextmanager
def asking(journal: Optional[Path]) -> Iterator[None]:
    """Hold the study's ask lock (a file beside a journal) for a count and an ask; no lock elsewhere."""
    if journal is None:
        yield
        return
    with open(journal.with_name(journal.name + ".ask.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
