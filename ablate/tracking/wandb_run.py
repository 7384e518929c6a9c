"""One W&B run per cell, which can never cost the cell its work.

The run store is the source of truth (docs/design.md section 5); W&B is a mirror. So every W&B
failure (no network, a bad key, a crashed ``wandb-core``) turns the tracker into a no-op that
records a readable warning, and the cell carries on. Failures do not outlive their cell:

- An online run that cannot reach the server within ``init_timeout`` continues offline, under
  the same run id, ready for ``wandb sync``; later cells of the process go offline at once
  rather than each waiting for the timeout again.
- After any W&B error the W&B service of the process is torn down, so the next cell starts a
  fresh ``wandb-core`` (a ``wandb-core`` that died would otherwise fail every later cell with
  ``MailboxClosedError``). An init that fails is retried once on a fresh service.

Each cell has one W&B run id (chosen by the runner and kept in the run store), and runs are
started with ``resume="allow"``: a rerun of an interrupted cell continues the same W&B run online,
and offline it replaces the partial run. One cell, one run: once a run has started, every other
folder of the same run id under ``wandb/`` goes (an online start that fell back offline, an earlier
attempt that the run store could not remove because ``wandb/`` is a link to another disk).

An online run turns off wandb's own SDK telemetry (``WANDB_ERROR_REPORTING=false``) unless the user
set it: at exit wandb would otherwise probe the server for it, for up to 10 s per probe, so a
process whose server does not answer would linger some 20 s after its last cell.

Three wandb 0.31 behaviours shape this module:

- Many cells run in one process (Hydra's in-process launcher), so runs are created with
  ``reinit="create_new"``: each cell gets its own run object and nothing touches the global
  ``wandb.run``.
- ``Run.finish()`` returns before the run's ``.wandb`` file is complete. ``wandb-core`` keeps
  the current 32 KiB block of the log in memory and writes it only when the stream closes,
  and ``finish()`` closes the stream with a fire-and-forget ``inform_finish`` message. So
  ``finish`` here waits, with a bound, until the log ends with the run's exit record, which is
  much cheaper than ``wandb.teardown()`` (that stops the shared service and makes the next
  cell pay for a restart).
- ``wandb.teardown()`` forgets the service before it talks to it, so after a crash of
  ``wandb-core`` it raises (the connection is gone) yet leaves the process ready for a new one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb

from ablate.config import TrackingMode
from ablate.tracking.cache_home import service_cache_home
from ablate.tracking.offline_reader import STEP_KEY, is_complete

logger = logging.getLogger(__name__)

TRACKER_MODES: tuple[str, ...] = tuple(mode.value for mode in TrackingMode)  # the config schema's choices

#: wandb's switch for its own SDK telemetry (error reports and usage metrics sent to the server).
TELEMETRY_ENV = "WANDB_ERROR_REPORTING"

#: Set once an online run of this process failed to reach the server: later cells log offline.
_server_unreachable: list[str] = []


def restart_wandb() -> None:
    """Tear down this process's W&B service so the next run starts a fresh ``wandb-core``."""
    try:
        wandb.teardown()
    except Exception as error:  # a dead service cannot be told to stop; it is forgotten all the same
        logger.debug("wandb.teardown after a W&B failure: %s: %s", type(error).__name__, error)


class WandbTracker:
    """Logs one cell to one W&B run; a no-op when disabled or once W&B has failed.

    ``warnings`` lists every W&B failure as a sentence, for the cell's ``status.json``.
    ``run_path`` is the directory holding the run's ``.wandb`` file, or ``None`` when no run
    was created.
    """

    def __init__(self, run: wandb.Run | None, flush_timeout: float) -> None:
        self._run = run
        self._flush_timeout = flush_timeout
        self._failed = False
        self.warnings: list[str] = []
        self.run_path: Path | None = Path(run.settings.sync_file).parent if run else None

    @property
    def active(self) -> bool:
        """Whether metrics still reach W&B."""
        return self._run is not None and not self._failed

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one training step; ``step`` becomes the x-axis of every key."""
        if STEP_KEY in metrics:
            raise ValueError(
                f"metrics contain the reserved key {STEP_KEY!r}={metrics[STEP_KEY]!r}: "
                f"pass the step as log(..., step={step!r}) instead"
            )
        run = self._run
        if run is None or self._failed:
            return
        try:
            run.log({**metrics, STEP_KEY: step})
        except Exception as error:  # W&B must never cost the cell its work
            self._failed = True
            self._warn(f"W&B log failed at step {step}, further steps are not sent to W&B", error)

    def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> None:
        """Write the summary, close the run and wait until its log file is complete.

        Idempotent, so it can sit in a ``finally`` that may run after an earlier ``finish``.
        The run is closed even after a failed ``log``, so W&B does not keep it open; after any
        W&B failure the service is restarted for the next cell.
        """
        run, self._run = self._run, None
        if run is None:
            return
        try:
            if summary and not self._failed:
                run.summary.update(dict(summary))
            run.finish(exit_code=exit_code)
        except Exception as error:
            self._failed = True
            self._warn("W&B finish failed, the run's W&B record may be incomplete", error)
        if self._failed:
            restart_wandb()
            return
        self._wait_for_exit_record()

    def _use_step_axis(self) -> None:
        """Plot every key against ``step``, so all panels of a cell share one x-axis."""
        assert self._run is not None
        try:
            self._run.define_metric(STEP_KEY)
            self._run.define_metric("*", step_metric=STEP_KEY)
        except Exception as error:
            self._failed = True
            self._warn("W&B define_metric failed, no steps are sent to W&B", error)

    def _wait_for_exit_record(self) -> None:
        """Poll the log until it holds the exit record, or warn after ``flush_timeout``."""
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
    run_id: str | None = None,
    init_timeout: float = 10.0,
    finish_timeout: float = 60.0,
    flush_timeout: float = 30.0,
    save_requirements: bool = False,
) -> WandbTracker:
    """Start the W&B run of one cell; W&B files go under ``run_dir/"wandb"``.

    ``config`` is stored as given (the caller flattens it). ``run_id`` is the cell's W&B run id
    (every attempt of a cell passes the same one). ``init_timeout`` bounds how long a run may
    take to start (online: to reach the server) before it continues offline; ``finish_timeout``
    bounds the final upload of an online run (its data stays on disk for ``wandb sync``);
    ``flush_timeout`` bounds the wait for the log file after ``finish``. ``save_requirements``
    stores a ``requirements.txt`` in every run; it is off by default because listing the
    installed packages is most of a cell's W&B start-up time and every cell of a sweep shares
    them. Only an unknown ``mode`` raises: W&B failures become warnings on the returned tracker.
    """
    if mode not in TRACKER_MODES:
        raise ValueError(f"W&B mode={mode!r}: expected one of {', '.join(TRACKER_MODES)}")
    if mode == "disabled":
        return WandbTracker(None, flush_timeout)
    run_dir = Path(run_dir)
    notes: list[str] = []
    if mode == "online":
        os.environ.setdefault(TELEMETRY_ENV, "false")
    if mode == "online" and _server_unreachable:
        notes.append(f"W&B server unreachable earlier in this process ({_server_unreachable[0]}): "
                     "this cell logs offline; upload it later with wandb sync")
        mode = "offline"

    def init(run_mode: str) -> wandb.Run:
        run_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            mode=run_mode, project=project, entity=entity, tags=list(tags), dir=str(run_dir), group=group,
            job_type=job_type, name=name, config=dict(config), id=run_id, resume="allow" if run_id else None,
            reinit="create_new", settings=_settings(init_timeout, finish_timeout, save_requirements),
        )

    moved: list[str] = []  # said once, with the cell's warnings: the service's own lines were the noise
    with service_cache_home(moved):  # a service W&B starts here must not log to the console
        run, error = _attempt(init, mode)
        if run is None and mode == "online":
            _server_unreachable.append(f"{type(error).__name__}: {error}")
            notes.append(f"W&B online start failed within init_timeout={init_timeout:g} s ({type(error).__name__}: "
                         f"{error}): this cell logs offline; upload it later with wandb sync")
            # The failed run's stream still holds the run id in this service: an offline start of the
            # same id would wait for it until init_timeout, fail, and leave one more empty run folder.
            restart_wandb()
            run, error = _attempt(init, "offline")
    remove_other_runs(run_dir / "wandb", run.id if run is not None else run_id,
                      Path(run.settings.sync_file).parent if run is not None else None)
    tracker = WandbTracker(run, flush_timeout)
    tracker.warnings.extend(moved)
    for note in notes:
        tracker._warn(note, None)
    if run is None:
        tracker._warn(f"W&B init failed (mode={mode}), the cell runs without W&B", error)
        return tracker
    tracker._use_step_axis()
    return tracker


def remove_other_runs(wandb_dir: Path, run_id: str | None, keep: Path | None) -> None:
    """Remove every run folder of ``run_id`` under ``wandb_dir`` but ``keep``, so a cell has one run.

    Only folders of this run id go (``run-<time>-<id>``, ``offline-run-<time>-<id>``, and the
    ``-<n>`` copies wandb makes when a name is taken): a ``wandb/`` linked to a folder that other
    cells share keeps their runs.
    """
    if run_id is None or not wandb_dir.is_dir():
        return
    own = re.compile(rf"(offline-)?run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    kept = keep.resolve() if keep is not None else None
    for folder in wandb_dir.iterdir():
        if own.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink() and folder.resolve() != kept:
            shutil.rmtree(folder, ignore_errors=True)


def _attempt(init: Any, mode: str) -> tuple[wandb.Run | None, Exception | None]:
    """``init(mode)``; an offline init that fails is retried once on a fresh W&B service.

    Offline, nothing but the local service can fail, so a failure most likely means that it died.
    Online, the server is the likely cause, and a retry would only wait for it again.
    """
    try:
        return init(mode), None
    except Exception as error:  # W&B must never cost the cell its work
        if mode == "online":
            return None, error
        logger.debug("W&B init failed (%s: %s); retrying on a fresh service", type(error).__name__, error)
    restart_wandb()
    try:
        return init(mode), None
    except Exception as error:
        return None, error


def _settings(
    init_timeout: float, finish_timeout: float, save_requirements: bool
) -> wandb.Settings:
    """Quiet settings for one cell: a sweep's terminal shows the sweep, not W&B banners."""
    options: dict[str, Any] = dict(
        init_timeout=init_timeout, finish_timeout=finish_timeout, silent=True, console="off",
        **git_settings(os.getcwd()),
    )
    # A private setting: pass it only where this wandb has it, since Settings rejects
    # unknown fields and a rejected init would silently turn W&B off for every cell.
    if "x_save_requirements" in wandb.Settings.model_fields:
        options["x_save_requirements"] = save_requirements
    return wandb.Settings(**options)


def git_settings(directory: str) -> dict[str, Any]:
    """The git state W&B records in each run (repository root, remote URL, commit), read once per
    process and working directory by W&B's own reader: given none, W&B asks git for it in four
    subprocesses per run, a quarter of a cell's W&B start-up. A worker's cells run the code it
    imported, so the commit it saw first is theirs. Outside a repository, W&B's lookups are off.
    Where the user turned them off (``WANDB_DISABLE_GIT``) each run is told so: W&B reads that
    variable once per process, when its settings first load. Where the user chose the root
    (``WANDB_GIT_ROOT``), W&B is left to it."""
    if wandb.env.disable_git():
        return {"disable_git": True}
    if os.environ.get(wandb.env.GIT_ROOT):
        return {}
    return _git_state(directory)


@functools.lru_cache(maxsize=8)
def _git_state(directory: str) -> dict[str, Any]:
    from wandb.sdk.lib.gitlib import GitRepo

    try:
        repo = GitRepo(root=directory, lazy=False)
        # "" for no remote: W&B records none either way, and looks for one again when given None.
        found = {"git_root": repo.root_dir, "git_remote_url": repo.remote_url or "", "git_commit": repo.last_commit}
    except Exception as error:  # git missing or broken: W&B would have found nothing either
        logger.debug("git state for W&B: %s: %s", type(error).__name__, error)
        found = {"git_root": None}
    if found["git_root"] is None:
        return {"disable_git": True}
    return {key: value for key, value in found.items() if value is not None and key in wandb.Settings.model_fields}
