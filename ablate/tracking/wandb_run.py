"""One W&B run per cell, which can never cost the cell its work.

The run store is the source of truth (DESIGN.md section 5); W&B is a mirror. So every W&B
failure (no network, a bad key, a crashed ``wandb-core``) turns the tracker into a no-op that
records a readable warning, and the cell carries on.

Two wandb 0.31 behaviours shape this module:

- Many cells run in one process (Hydra's in-process launcher), so runs are created with
  ``reinit="create_new"``: each cell gets its own run object and nothing touches the global
  ``wandb.run``.
- ``Run.finish()`` returns before the run's ``.wandb`` file is complete. ``wandb-core`` keeps
  the current 32 KiB block of the log in memory and writes it only when the stream closes,
  and ``finish()`` closes the stream with a fire-and-forget ``inform_finish`` message. So
  ``finish`` here waits, with a bound, until the log ends with the run's exit record, which is
  much cheaper than ``wandb.teardown()`` (that stops the shared service and makes the next
  cell pay for a restart).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb

from ablate.tracking.offline_reader import STEP_KEY, is_complete

logger = logging.getLogger(__name__)

TRACKER_MODES = ("offline", "online", "disabled")


class WandbTracker:
    """Logs one cell to one W&B run; a no-op when disabled or once W&B has failed.

    ``warnings`` lists every W&B failure as a sentence, for the cell's ``status.json``.
    ``run_path`` is the directory holding the run's ``.wandb`` file, or ``None`` when no run
    was created.
    """

    def __init__(self, run: wandb.Run | None, flush_timeout: float) -> None:
        self._run = run
        self._flush_timeout = flush_timeout
        self._log_failed = False
        self.warnings: list[str] = []
        self.run_path: Path | None = Path(run.settings.sync_file).parent if run else None

    @property
    def active(self) -> bool:
        """Whether metrics still reach W&B."""
        return self._run is not None and not self._log_failed

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one training step; ``step`` becomes the x-axis of every key."""
        if STEP_KEY in metrics:
            raise ValueError(
                f"metrics contain the reserved key {STEP_KEY!r}={metrics[STEP_KEY]!r}: "
                f"pass the step as log(..., step={step!r}) instead"
            )
        run = self._run
        if run is None or self._log_failed:
            return
        try:
            run.log({**metrics, STEP_KEY: step})
        except Exception as error:  # W&B must never cost the cell its work
            self._log_failed = True
            self._warn(f"W&B log failed at step {step}, further steps are not sent to W&B", error)

    def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> None:
        """Write the summary, close the run and wait until its log file is complete.

        Idempotent, so it can sit in a ``finally`` that may run after an earlier ``finish``.
        The run is closed even after a failed ``log``, so W&B does not keep it open.
        """
        run, self._run = self._run, None
        if run is None:
            return
        try:
            if summary:
                run.summary.update(dict(summary))
            run.finish(exit_code=exit_code)
        except Exception as error:
            self._warn("W&B finish failed, the run's W&B record may be incomplete", error)
            return
        self._wait_for_exit_record()

    def _use_step_axis(self) -> None:
        """Plot every key against ``step``, so all panels of a cell share one x-axis."""
        assert self._run is not None
        try:
            self._run.define_metric(STEP_KEY)
            self._run.define_metric("*", step_metric=STEP_KEY)
        except Exception as error:
            self._log_failed = True
            self._warn("W&B define_metric failed, no steps are sent to W&B", error)

    def _wait_for_exit_record(self) -> None:
        """Poll the log until it ends with the exit record, or warn after ``flush_timeout``."""
        assert self.run_path is not None
        deadline = time.monotonic() + self._flush_timeout
        pause = 0.002
        while True:
            try:
                if is_complete(self.run_path):
                    return
            except (OSError, ValueError) as error:
                self._warn("could not read the W&B log back", error)
                return
            if time.monotonic() >= deadline:
                self._warn(
                    f"the W&B log in {self.run_path} has no exit record "
                    f"{self._flush_timeout:g} s after finish",
                    None,
                )
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _warn(self, message: str, error: BaseException | None) -> None:
        sentence = f"{message}: {type(error).__name__}: {error}" if error else message
        self.warnings.append(sentence)
        logger.warning(sentence)


def start_tracker(
    *,
    mode: str,
    project: str,
    entity: str | None,
    tags: Sequence[str],
    run_dir: Path | str,
    group: str,
    job_type: str,
    name: str,
    config: Mapping[str, Any],
    init_timeout: float = 30.0,
    finish_timeout: float = 60.0,
    flush_timeout: float = 30.0,
    save_requirements: bool = False,
) -> WandbTracker:
    """Start the W&B run of one cell; W&B files go under ``run_dir/"wandb"``.

    ``config`` is stored as given (the caller flattens it). ``init_timeout`` bounds how long an
    online run waits for the server before giving up; ``finish_timeout`` bounds the final
    upload of an online run (its data stays on disk for ``wandb sync``); ``flush_timeout``
    bounds the wait for the log file after ``finish``. ``save_requirements`` stores a
    ``requirements.txt`` in every run; it is off by default because listing the installed
    packages is most of a cell's W&B start-up time and every cell of a sweep shares them.
    Only an unknown ``mode`` raises: W&B failures become warnings on the returned tracker.
    """
    if mode not in TRACKER_MODES:
        raise ValueError(f"W&B mode={mode!r}: expected one of {', '.join(TRACKER_MODES)}")
    if mode == "disabled":
        return WandbTracker(None, flush_timeout)
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            mode=mode,
            project=project,
            entity=entity,
            tags=list(tags),
            dir=str(run_dir),
            group=group,
            job_type=job_type,
            name=name,
            config=dict(config),
            reinit="create_new",
            settings=_settings(init_timeout, finish_timeout, save_requirements),
        )
    except Exception as error:  # W&B must never cost the cell its work
        tracker = WandbTracker(None, flush_timeout)
        tracker._warn(f"W&B init failed (mode={mode}), the cell runs without W&B", error)
        return tracker
    tracker = WandbTracker(run, flush_timeout)
    tracker._use_step_axis()
    return tracker


def _settings(
    init_timeout: float, finish_timeout: float, save_requirements: bool
) -> wandb.Settings:
    """Quiet settings for one cell: a sweep's terminal shows the sweep, not W&B banners."""
    options: dict[str, Any] = dict(
        init_timeout=init_timeout, finish_timeout=finish_timeout, silent=True, console="off"
    )
    # A private setting: pass it only where this wandb has it, since Settings rejects
    # unknown fields and a rejected init would silently turn W&B off for every cell.
    if "x_save_requirements" in wandb.Settings.model_fields:
        options["x_save_requirements"] = save_requirements
    return wandb.Settings(**options)
