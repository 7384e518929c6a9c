"""One Optuna study driven through Hydra's launcher with ask-and-tell.

Each trial is an ordinary job of the app with the suggested values plus ``trial=<number>`` as
overrides, so a trial is a cell like any other: same run store, same W&B group.

Resuming: the study lives in persistent storage and is loaded if it exists. ``n_trials`` is the
size the study should reach; complete and failed trials of earlier runs count. A trial left
RUNNING by a driver that died is relaunched under its own number with its own parameters: the
cell is read back from the run store if it completed before the crash, and rerun otherwise, so
no trial is lost or duplicated. Run one sweeper per study at a time.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from ablate.overrides import quoted_override
from ablate.store import atomic_write, store_root

from ._journal import repair_journal
from ._search_space import parse_search_space
from .config import SamplerConf, SamplerName

log = logging.getLogger(__name__)

#: The app config key that receives the trial number.
TRIAL_KEY = "trial"
DIRECTIONS = ("minimize", "maximize")
FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


class StudyFailed(RuntimeError):
    """More trials failed than ``max_failure_rate`` allows, or a trial returned unusable values."""


class OptunaStudySweep:
    def __init__(
        self,
        sampler: SamplerConf,
        direction: Any,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        study_name: Optional[str],
        storage: Optional[str],
        params: Optional[DictConfig],
        metric_names: Optional[list[str]],
        export_dir: Optional[str],
    ) -> None:
        self.sampler_name = SamplerName(getattr(sampler.name, "value", sampler.name))
        self.seed = sampler.seed
        self.directions = _directions(direction)
        if n_trials < 0:
            raise ValueError(f"hydra.sweeper.n_trials={n_trials}: expected a number of trials >= 0")
        if n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_jobs={n_jobs}: expected at least 1 trial per batch")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"hydra.sweeper.max_failure_rate={max_failure_rate}: expected a fraction in [0, 1]")
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.study_name = study_name
        self.storage = storage
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.metric_names = list(metric_names) if metric_names is not None else None
        self.export_dir = export_dir
        self.job_idx = 0
        self.hydra_context: Optional[HydraContext] = None
        self.last_error: Optional[BaseException] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    # --- the sweep ------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> None:
        from ablate.launchers import stop_file
        from ablate.sweep import make_sweep_directory
        from hydra_plugins.ablate_grid_sweeper.grid_sweeper import JobComposer

        assert self.config is not None and self.hydra_context is not None
        space = parse_search_space([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        if any(o.split("=", 1)[0].lstrip("+~") == TRIAL_KEY for o in space.fixed) or TRIAL_KEY in space.distributions:
            raise ValueError(f"{TRIAL_KEY}=...: the sweeper sets the trial number of every trial; do not override it")
        study = self._open_study()
        previous = study.get_trials(deepcopy=False)
        interrupted = [t for t in previous if t.state == TrialState.RUNNING]
        finished = sum(t.state in FINISHED for t in previous)
        to_ask = max(0, self.n_trials - finished - len(interrupted))
        log.info(
            "Study %r in %s: %d trials finished, %d interrupted (relaunched), %d to ask for (n_trials=%d). "
            "Search space:\n%s",
            study.study_name, self._storage_text(), finished, len(interrupted), to_ask, self.n_trials,
            describe_space(space.distributions),
        )
        self.started, self.finished_here = time.monotonic(), 0
        # Every worker writes to the same store, wherever its working directory is (Ray, SLURM).
        # Quoted: Hydra parses it again, and a path may hold any character ("p (copy)", "é", ",").
        store = quoted_override("store_dir", str(store_root(str(self.config.store_dir))))
        compose = JobComposer(self.config, self.hydra_context.config_loader)
        with stop_file(make_sweep_directory(self.config)):  # named for every worker: a stopping study's queued trials do not start
            self._run_batches(study, space, interrupted, to_ask, store, compose)
        self._report(study)

    def _run_batches(self, study: optuna.Study, space: Any, interrupted: list[FrozenTrial], to_ask: int,
                     store: str, compose: Any) -> None:
        while interrupted or to_ask:
            batch: list[tuple[int, dict[str, Any]]] = []
            while interrupted and len(batch) < self.n_jobs:
                trial = interrupted.pop(0)
                batch.append((trial.number, trial.params))
            while to_ask and len(batch) < self.n_jobs:
                trial = study.ask(dict(space.distributions))
                batch.append((trial.number, trial.params))
                to_ask -= 1
            jobs = [[*(o for o in space.trial_overrides(params) if not o.startswith("store_dir=")),
                     f"{TRIAL_KEY}={number}", store] for number, params in batch]
            for (number, params), result in zip(batch, self._launch(jobs, compose)):
                if result is not None:
                    self._tell(study, number, result)
                self._log_trial(study, number, params)
            self._check_failures(study)

    def _launch(self, jobs: list[list[str]], compose: Any) -> list[Any]:
        """One batch of trials through :func:`ablate.launchers.launch`, as a grid sweep launches cells.

        So a killed worker fails its own trial only, and Ctrl-C or SIGTERM records every running
        trial's cell as interrupted, under every launcher. The result of each job, in order: its
        ``JobReturn``, a :class:`StoreOutcome` read from the run store where the launcher returned
        none (a joblib pool that broke loses the results of the cells it had run), a
        :class:`ConfigError` for a job whose config is invalid (never launched), or None for a trial
        to leave RUNNING (interrupted: the next run relaunches it).
        """
        from ablate.config import ConfigError
        from ablate.launchers import launch, settle
        from ablate.sweep import plan_grid

        planned: list[Any] = []
        for job in jobs:
            try:
                planned.append(plan_grid([job], compose)[0])
            except ConfigError as error:
                planned.append(error)
        cells = [cell for cell in planned if not isinstance(cell, ConfigError)]
        try:
            returns = launch(self.launcher, cells, self.job_idx) if cells else []
        finally:
            settle(cells)  # a launcher may return while its workers still record their cells
        self.job_idx += len(cells)
        by_overrides = {tuple(result.overrides): result for result in returns if isinstance(result, JobReturn)}
        return [cell if isinstance(cell, ConfigError) else self._result(cell, by_overrides.get(tuple(cell.overrides)))
                for cell in planned]

    def _result(self, cell: Any, returned: Optional[JobReturn]) -> Any:
        from ablate.launchers import StoppedCell
        from ablate.store import CellState, read_summary
        from ablate.sweep import outcome

        if returned is not None and returned.status is not JobStatus.COMPLETED:
            return returned  # the job raised: _tell reads the error from it
        if returned is not None and not isinstance(returned.return_value, StoppedCell):
            return returned
        state, view = outcome(cell)
        if state is CellState.COMPLETE:
            return StoreOutcome(read_summary(cell.directory), self.config)
        if state is CellState.FAILED:
            return StoreOutcome(None, self.config, f"{cell.cell.name}: {view.detail or 'its worker died'}")
        return None  # interrupted or never started: RUNNING in the study, relaunched by the next run

    def _tell(self, study: optuna.Study, number: int, result: Any) -> None:
        try:
            if isinstance(result, Exception):  # its config is invalid: it never ran
                raise result
            returned = result.return_value  # raises the job's exception when the job failed
        except Exception as error:
            log.warning("Trial %d failed: %s: %s", number, type(error).__name__, error)
            study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            self.last_error = error
            return
        try:
            values = _values(returned, len(self.directions))
        except (TypeError, ValueError) as error:
            study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            raise StudyFailed(
                f"trial {number} returned {returned!r}: {error}. The study has {len(self.directions)} "
                f"direction(s) {self.directions}; the task must return one float per direction"
            ) from None
        frozen = study.tell(number, values, skip_if_finished=True)
        if frozen.state == TrialState.FAIL:  # Optuna fails a trial whose value is NaN
            self.last_error = ValueError(f"trial {number} returned {values}")

    def _log_trial(self, study: optuna.Study, number: int, params: dict[str, Any]) -> None:
        """``trial 4/40 (#3): final_reward=0.41 | policy.tau=0.53 ... [best 0.45 (#2), 1:02 elapsed, ETA 9:18]``."""
        from ablate.sweep import format_duration

        trials = study.get_trials(deepcopy=False)
        frozen = trials[number]
        done = sum(t.state in FINISHED for t in trials)
        self.finished_here += 1
        names = study.metric_names or [f"value_{i}" for i in range(len(self.directions))]
        if frozen.state == TrialState.COMPLETE:
            outcome = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, frozen.values))
        else:
            outcome = f"{frozen.state.name.lower()}"
        shown = " ".join(f"{k}={_short(v)}" for k, v in params.items())
        timing = f"{format_duration(time.monotonic() - self.started)} elapsed"
        left = max(0, self.n_trials - done)
        if left:
            per_trial = (time.monotonic() - self.started) / self.finished_here
            timing += f", ETA {format_duration(per_trial * left)}"
        best = ""
        if len(self.directions) == 1 and any(t.state == TrialState.COMPLETE for t in trials):
            best = f"best {study.best_value:.4g} (#{study.best_trial.number}), "
        log.info("trial %d/%d (#%d): %s | %s [%s%s]", done, self.n_trials, number, outcome, shown, best, timing)

    def _check_failures(self, study: optuna.Study) -> None:
        failed = sum(t.state == TrialState.FAIL for t in study.get_trials(deepcopy=False))
        allowed = self.max_failure_rate * self.n_trials
        if failed > allowed:
            last = f"; last error: {type(self.last_error).__name__}: {self.last_error}" if self.last_error else ""
            raise StudyFailed(
                f"{failed} trial(s) of study {study.study_name!r} failed, more than "
                f"max_failure_rate={self.max_failure_rate} x n_trials={self.n_trials} = {allowed:g} allows{last}"
            ) from self.last_error

    # --- the study ------------------------------------------------------------------------

    def _open_study(self) -> optuna.Study:
        storage = self._open_storage()
        # The sampler is chosen once the study is open: its seed depends on the trials it holds.
        study = optuna.create_study(
            study_name=self.study_name, storage=storage, directions=list(self.directions), load_if_exists=True,
            sampler=optuna.samplers.RandomSampler(),
        )
        directions = [d.name.lower() for d in study.directions]
        if directions != self.directions:
            raise ValueError(
                f"hydra.sweeper.direction={self.directions}: study {study.study_name!r} in "
                f"{self._storage_text()} was created with {directions}; use another study_name or storage"
            )
        study.sampler = self._sampler(len(study.get_trials(deepcopy=False)))
        names = self._metric_names()
        if names is not None and study.metric_names != names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(names)
        return study

    def _open_storage(self) -> Optional[str | BaseStorage]:
        if self.storage is None:
            log.warning("hydra.sweeper.storage=null: the study lives in memory and cannot be resumed")
            return None
        if "://" in self.storage:
            return self.storage
        path = self._journal_path()
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        repair_journal(path)
        return JournalStorage(JournalFileBackend(str(path)))

    def _journal_path(self) -> Optional[Path]:
        if self.storage is None or "://" in self.storage:
            return None
        return store_root(self.storage)

    def _storage_text(self) -> str:
        path = self._journal_path()
        return str(path) if path is not None else (self.storage or "memory")

    def _sampler(self, existing_trials: int) -> optuna.samplers.BaseSampler:
        seed = None if self.seed is None else self.seed + existing_trials
        if self.sampler_name == SamplerName.tpe:
            return optuna.samplers.TPESampler(seed=seed)
        if self.sampler_name == SamplerName.random:
            return optuna.samplers.RandomSampler(seed=seed)
        if self.sampler_name == SamplerName.nsgaii:
            return optuna.samplers.NSGAIISampler(seed=seed)
        if len(self.directions) > 1:
            raise ValueError("hydra.sweeper.sampler.name=cmaes: CMA-ES optimises one objective; use tpe or nsgaii")
        try:
            import cmaes  # noqa: F401  (Optuna imports it lazily, only when the first trial is asked)
        except ImportError:
            raise ValueError("hydra.sweeper.sampler.name=cmaes needs the cmaes package: pip install cmaes") from None
        return optuna.samplers.CmaEsSampler(seed=seed)

    def _metric_names(self) -> Optional[list[str]]:
        names = self.metric_names
        if names is None:
            objective = self.config.get("objective")
            if isinstance(objective, str):
                names = [objective]
            elif isinstance(objective, ListConfig):
                names = [str(name) for name in objective]
        if names is not None and len(names) != len(self.directions):
            log.warning("metric names %s do not match directions %s: not set", names, self.directions)
            return None
        return names

    # --- the report -----------------------------------------------------------------------

    def _report(self, study: optuna.Study) -> None:
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        best = study.best_trials if complete else []
        names = study.metric_names or [f"values_{i}" for i in range(len(self.directions))]
        title = "Best trial" if len(self.directions) == 1 else f"Pareto front ({len(best)} trials)"
        lines = [f"{title} of study {study.study_name!r} ({len(complete)} complete trials):"]
        for trial in best:
            values = ", ".join(f"{n}={v:.6g}" for n, v in zip(names, trial.values))
            params = " ".join(f"{k}={v}" for k, v in trial.params.items())
            lines.append(f"  trial {trial.number}: {values} | {params}")
        log.info("\n".join(lines) if best else f"Study {study.study_name!r} has no complete trial")
        if self.export_dir is not None:
            self._export(study, best, store_root(self.export_dir))
        path = self._journal_path()
        if path is not None:
            log.info("Browse the study: optuna-dashboard %s", path)

    def _export(self, study: optuna.Study, best: Sequence[FrozenTrial], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        frame = study.trials_dataframe()
        atomic_write(directory / "optuna_trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
        atomic_write(directory / "optuna_trials.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
        report = {
            "study_name": study.study_name,
            "directions": self.directions,
            "metric_names": study.metric_names,
            "best_trials": [
                {"number": t.number, "values": list(t.values), "params": t.params} for t in best
            ],
        }
        text = json.dumps(report, indent=2, default=str) + "\n"
        atomic_write(directory / "optuna_best.json", lambda tmp: tmp.write_text(text))
        log.info("Trials exported to %s/optuna_trials.{csv,parquet}, best trials to optuna_best.json", directory)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_space(distributions: dict[str, BaseDistribution]) -> str:
    """One line per searched key: ``  policy.tau  float in [0, 2]``, aligned."""
    if not distributions:
        return "  (empty: every trial runs the same overrides)"
    width = max(len(name) for name in distributions)
    lines = []
    for name, distribution in distributions.items():
        if isinstance(distribution, CategoricalDistribution):
            text = "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in distribution.choices)
        else:
            kind = "int" if isinstance(distribution, IntDistribution) else "float"
            low, high = distribution.low, distribution.high  # type: ignore[attr-defined]
            text = f"{kind} in [{_short(low)}, {_short(high)}]"
            if distribution.log:  # type: ignore[attr-defined]
                text += ", log scale"
            if distribution.step is not None and not (kind == "int" and distribution.step == 1):  # type: ignore[attr-defined]
                text += f", step {_short(distribution.step)}"  # type: ignore[attr-defined]
        lines.append(f"  {name:<{width}}  {text}")
    return "\n".join(lines)


def _directions(direction: Any) -> list[str]:
    raw = list(direction) if isinstance(direction, (list, tuple, ListConfig)) else [direction]
    directions = [str(getattr(d, "value", d)).lower() for d in raw]
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"hydra.sweeper.direction={direction}: expected maximize, minimize or a list of them")
    return directions


def _values(returned: Any, expected: int) -> list[float]:
    """The task's return value as one float per objective."""
    if isinstance(returned, (ListConfig, Sequence)) and not isinstance(returned, str):
        values = [float(v) for v in returned]
    else:
        values = [float(returned)]
    if len(values) != expected:
        raise ValueError(f"{len(values)} value(s) for {expected} objective(s)")
    return values


class StoreOutcome:
    """A trial's result read from its cell in the run store, shaped as ``JobReturn.return_value`` is read."""

    def __init__(self, summary: Optional[dict[str, Any]], config: Any, error: str = "") -> None:
        self.summary, self.config, self.error = summary, config, error

    @property
    def return_value(self) -> Any:
        from ablate.runner import objective_values

        if self.summary is None:
            raise RuntimeError(self.error)
        return objective_values(self.config, self.summary)
