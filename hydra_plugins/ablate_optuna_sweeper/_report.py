"""What the study says: its search space, a line per trial, the best trials, and their export."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from ablate.store import atomic_write

log = logging.getLogger(__name__)

FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


def short(value: Any) -> str:
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
            text = f"{kind} in [{short(low)}, {short(high)}]"
            if distribution.log:  # type: ignore[attr-defined]
                text += ", log scale"
            if distribution.step is not None and not (kind == "int" and distribution.step == 1):  # type: ignore[attr-defined]
                text += f", step {short(distribution.step)}"  # type: ignore[attr-defined]
        lines.append(f"  {name:<{width}}  {text}")
    return "\n".join(lines)


class TrialLog:
    """``trial 4/40 (#3): final_reward=0.41 | policy.tau=0.53 ... [best 0.45 (#2), 1:02 elapsed, ETA 9:18]``."""

    def __init__(self, n_trials: int, objectives: int) -> None:
        self.n_trials, self.objectives = n_trials, objectives
        self.started, self.finished_here = time.monotonic(), 0

    def trial(self, study: optuna.Study, number: int, params: dict[str, Any]) -> None:
        from ablate.sweep import format_duration

        trials = study.get_trials(deepcopy=False)
        frozen = trials[number]
        done = sum(t.state in FINISHED for t in trials)
        self.finished_here += 1
        names = study.metric_names or [f"value_{i}" for i in range(self.objectives)]
        if frozen.state == TrialState.COMPLETE:
            outcome = ", ".join(f"{n}={v:.4g}" for n, v in zip(names, frozen.values))
        else:
            outcome = f"{frozen.state.name.lower()}"
        shown = " ".join(f"{k}={short(v)}" for k, v in params.items())
        timing = f"{format_duration(time.monotonic() - self.started)} elapsed"
        left = max(0, self.n_trials - done)
        if left:
            per_trial = (time.monotonic() - self.started) / self.finished_here
            timing += f", ETA {format_duration(per_trial * left)}"
        best = ""
        if self.objectives == 1 and any(t.state == TrialState.COMPLETE for t in trials):
            best = f"best {study.best_value:.4g} (#{study.best_trial.number}), "
        log.info("trial %d/%d (#%d): %s | %s [%s%s]", done, self.n_trials, number, outcome, shown, best, timing)


def report(study: optuna.Study, directions: list[str], export_dir: Optional[Path], journal: Optional[Path]) -> None:
    """The best trial (or the Pareto front), its export, and where to browse the study."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = study.best_trials if complete else []
    names = study.metric_names or [f"values_{i}" for i in range(len(directions))]
    title = "Best trial" if len(directions) == 1 else f"Pareto front ({len(best)} trials)"
    lines = [f"{title} of study {study.study_name!r} ({len(complete)} complete trials):"]
    for trial in best:
        values = ", ".join(f"{n}={v:.6g}" for n, v in zip(names, trial.values))
        params = " ".join(f"{k}={v}" for k, v in trial.params.items())
        lines.append(f"  trial {trial.number}: {values} | {params}")
    log.info("\n".join(lines) if best else f"Study {study.study_name!r} has no complete trial")
    if export_dir is not None:
        export(study, directions, best, export_dir)
    if journal is not None:
        log.info("Browse the study: optuna-dashboard %s", journal)


def export(study: optuna.Study, directions: list[str], best: Sequence[FrozenTrial], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    frame = study.trials_dataframe()
    atomic_write(directory / "optuna_trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
    atomic_write(directory / "optuna_trials.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
    summary = {
        "study_name": study.study_name,
        "directions": directions,
        "metric_names": study.metric_names,
        "best_trials": [{"number": t.number, "values": list(t.values), "params": t.params} for t in best],
    }
    text = json.dumps(summary, indent=2, default=str) + "\n"
    atomic_write(directory / "optuna_best.json", lambda tmp: tmp.write_text(text))
    log.info("Trials exported to %s/optuna_trials.{csv,parquet}, best trials to optuna_best.json", directory)
