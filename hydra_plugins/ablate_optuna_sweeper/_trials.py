"""The trial loop: ask for a batch, launch it, tell the study each result, stop past the failure rate.

A batch holds first the trials a previous run left RUNNING (relaunched under their numbers, with
their parameters), then new trials asked for, ``n_jobs`` in all. A trial whose job failed, or
whose config is invalid, is told FAIL; a trial whose task returns other than one float per
direction ends the study (:class:`StudyFailed`); an interrupted trial is told nothing, and stays
RUNNING for the next run to relaunch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import optuna
from omegaconf import ListConfig
from optuna.trial import FrozenTrial, TrialState

from ._drivers import asking, mark
from ._report import TrialLog

log = logging.getLogger(__name__)

#: The app config key that receives the trial number.
TRIAL_KEY = "trial"


class StudyFailed(RuntimeError):
    """More trials failed than ``max_failure_rate`` allows, or a trial returned unusable values."""


class TrialLoop:
    def __init__(self, study: optuna.Study, directions: list[str], n_trials: int, n_jobs: int,
                 max_failure_rate: float, launch: Callable[[list[list[str]]], list[Any]],
                 journal: Optional[Path] = None) -> None:
        self.study, self.directions = study, directions
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.launch = launch
        self.journal = journal
        self.last_error: Optional[BaseException] = None
        self.log = TrialLog(n_trials, len(directions))

    def run(self, space: Any, interrupted: list[FrozenTrial], to_ask: int, store: str) -> None:
        """Relaunch ``interrupted``, then ask for up to ``to_ask`` new trials, while the study holds fewer
        than ``n_trials`` (other sweepers may ask too: :mod:`._drivers`); every job gets ``store``."""
        interrupted = list(interrupted)
        while interrupted or to_ask:
            batch: list[tuple[int, dict[str, Any]]] = []
            while interrupted and len(batch) < self.n_jobs:
                trial = interrupted.pop(0)
                mark(self.study, trial._trial_id)
                batch.append((trial.number, trial.params))
            while to_ask and len(batch) < self.n_jobs:
                with asking(self.journal):
                    if len(self.study.get_trials(deepcopy=False)) >= self.n_trials:
                        to_ask = 0
                        break
                    asked = self.study.ask(dict(space.distributions))
                    mark(self.study, asked._trial_id)
                batch.append((asked.number, asked.params))
                to_ask -= 1
            if not batch:
                break
            jobs = [[*(o for o in space.trial_overrides(params) if not o.startswith("store_dir=")),
                     f"{TRIAL_KEY}={number}", store] for number, params in batch]
            for (number, params), result in zip(batch, self.launch(jobs)):
                if result is not None:
                    self.tell(number, result)
                self.log.trial(self.study, number, params)
            self.check_failures()

    def tell(self, number: int, result: Any) -> None:
        try:
            if isinstance(result, Exception):  # its config is invalid: it never ran
                raise result
            returned = result.return_value  # raises the job's exception when the job failed
        except Exception as error:
            log.warning("Trial %d failed: %s: %s", number, type(error).__name__, error)
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            self.last_error = error
            return
        try:
            values = objective_values(returned, len(self.directions))
        except (TypeError, ValueError) as error:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            raise StudyFailed(
                f"trial {number} returned {returned!r}: {error}. The study has {len(self.directions)} "
                f"direction(s) {self.directions}; the task must return one float per direction"
            ) from None
        frozen = self.study.tell(number, values, skip_if_finished=True)
        if frozen.state == TrialState.FAIL:  # Optuna fails a trial whose value is NaN
            self.last_error = ValueError(f"trial {number} returned {values}")

    def check_failures(self) -> None:
        failed = sum(t.state == TrialState.FAIL for t in self.study.get_trials(deepcopy=False))
        allowed = self.max_failure_rate * self.n_trials
        if failed > allowed:
            last = f"; last error: {type(self.last_error).__name__}: {self.last_error}" if self.last_error else ""
            raise StudyFailed(
                f"{failed} trial(s) of study {self.study.study_name!r} failed, more than "
                f"max_failure_rate={self.max_failure_rate} x n_trials={self.n_trials} = {allowed:g} allows{last}"
            ) from self.last_error


def objective_values(returned: Any, expected: int) -> list[float]:
    """The task's return value as one float per objective."""
    if isinstance(returned, (ListConfig, Sequence)) and not isinstance(returned, str):
        values = [float(v) for v in returned]
    else:
        values = [float(returned)]
    if len(values) != expected:
        raise ValueError(f"{len(values)} value(s) for {expected} objective(s)")
    return values
