"""Per-cell outcomes: one number per question, computed from a cell's per-step records.

The input is a cell's records frame (``records.parquet`` in the run store): one row per
training step, a ``step`` column and the schema-v1 diagnostics keys. Rows are sorted by
``step`` first. Every outcome is NaN-safe: NaN values are ignored, and an outcome whose input
column is missing (or holds no finite value) is NaN, never an error.

Outcomes (the names are a public contract):

``final_reward``
    Mean of ``train/reward`` over the last ``final_fraction`` of the steps: the last
    ``ceil(final_fraction * n_steps)`` rows (at least one).
``reward_auc``
    Area under the reward curve divided by the step span,
    ``trapz(reward, step) / (step_last - step_first)``: the time-averaged reward over
    training, in reward units. With a single finite value it is that value.
``reward_late_gain``
    ``final_reward`` minus the mean reward over the window of the same length just before it:
    how much the policy was still improving at the end (a description: an arm that learned
    faster has less left to gain, so the flags do not read it).
    NaN when there are fewer than two windows of steps.
``kl_k3_mean`` / ``kl_k3_worst``
    Mean and maximum over steps of ``mismatch/kl_k3`` (train-inference KL after replay,
    k3 estimator ``mean(r - 1 - log r)``).
``extreme_token_frac_mean``
    Mean over steps of ``mismatch/extreme_token_frac`` (share of tokens with
    ``max(r, 1/r) > 2``).
``override_rate_mean``
    Mean over steps of ``replay/override_rate`` (share of replayed routes whose rollout route
    differed from the native route). NaN for ``none``, which replays nothing.
``expert_drift_final``
    Last finite value of ``drift/experts`` (relative change of expert parameters since step 0).
``residual_mismatch_mean``
    Mean over steps of ``routing/residual_mismatch_rate`` (mismatched routes left after replay).
``effective_budget_mean``
    Mean over steps of ``replay/effective_budget``: the share of valid routes whose replayed
    experts differ from the native ones, i.e. the routes replay actually changed (the budget
    counts routes replayed, and replaying a route where rollout and native experts agree
    changes nothing). Where a step lacks that key it is ``replay/budget_realized x
    replay/override_rate``, the same quantity from two keys every schema-1.0 run logs; a step
    that replayed nothing (``budget_realized = 0``, so ``none``) has effective budget 0.
``collapsed``
    1.0 if the run collapsed, else 0.0 (NaN without reward data). Rule: smooth the reward with
    a trailing moving average over ``smoothing_window`` steps and let ``best`` be its maximum
    (first occurrence). The run collapsed if, after the step of ``best``, the smoothed reward
    stays below a threshold for at least ``collapse_patience`` consecutive steps.

    - With a chance level (``train/reward_chance`` in the records, else the ``chance_reward``
      setting), the threshold is ``chance + collapse_fraction * (best - chance)``: the run lost
      more than ``1 - collapse_fraction`` of its gain over chance, so a run that peaks at 0.3
      and falls back to chance counts whatever its start. A run that never beats chance never
      counts as collapsed.
    - Without one, the threshold is ``best - (1 - collapse_fraction) * scale`` with
      ``scale = max(best - start, |best|)`` and ``start`` the first smoothed value: for rewards
      that are never negative, "falls below ``collapse_fraction * best``"; for rewards that can
      be negative, "lost more than ``1 - collapse_fraction`` of the larger of its gain and its
      magnitude". ``scale == 0`` (a run stuck at zero) never counts as collapsed.

    When the records carry ``train/task_shifted`` and the task changed during the run, only the
    steps after the change count: the drop the change itself causes is not a collapse.

Only numpy and pandas are imported here: the cell runner calls :func:`cell_outcomes` to write
each cell's ``summary.json``, and :func:`check_objective` checks a config's ``objective`` before
the cell starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from ablate.config import require

REWARD_KEY = "train/reward"
KL_K3_KEY = "mismatch/kl_k3"
EXTREME_KEY = "mismatch/extreme_token_frac"
OVERRIDE_KEY = "replay/override_rate"
EXPERT_DRIFT_KEY = "drift/experts"
RESIDUAL_KEY = "routing/residual_mismatch_rate"
EFFECTIVE_BUDGET_KEY = "replay/effective_budget"
BUDGET_REALIZED_KEY = "replay/budget_realized"
CHANCE_KEY = "train/reward_chance"
SHIFT_KEY = "train/task_shifted"

OUTCOME_NAMES: tuple[str, ...] = (
    "final_reward",
    "reward_auc",
    "reward_late_gain",
    "collapsed",
    "kl_k3_mean",
    "kl_k3_worst",
    "extreme_token_frac_mean",
    "override_rate_mean",
    "expert_drift_final",
    "residual_mismatch_mean",
    "effective_budget_mean",
)

def objective_names() -> list[str]:
    """Keys a cell's summary always holds: the outcomes, the schema's diagnostics and ``steps``."""
    from ablate.diagnostics import SCHEMA

    return [*OUTCOME_NAMES, "steps", *SCHEMA]


def check_objective(objective: Any) -> None:
    names = [objective] if isinstance(objective, str) else objective
    known = objective_names()
    ok = isinstance(names, Iterable) and bool(names) and all(isinstance(n, str) and n in known for n in names)
    require(ok, "objective", objective,
            f"a summary key or a list of them: an outcome ({', '.join(known[:known.index('steps')])}), "
            "steps, or a diagnostics key such as mismatch/kl_k3")


#: Which way is better for each outcome: True higher, False lower, None neither (a description
#: of what replay did, not a goal). The probability of improvement and the flags read it.
HIGHER_IS_BETTER: dict[str, bool | None] = {
    "final_reward": True,
    "reward_auc": True,
    "reward_late_gain": True,
    "collapsed": False,
    "kl_k3_mean": False,
    "kl_k3_worst": False,
    "extreme_token_frac_mean": False,
    "override_rate_mean": None,
    "expert_drift_final": None,
    "residual_mismatch_mean": False,
    "effective_budget_mean": None,
}


def cell_outcomes(
    records: pd.DataFrame,
    *,
    final_fraction: float = 0.2,
    collapse_fraction: float = 0.5,
    collapse_patience: int = 10,
    smoothing_window: int = 5,
    chance_reward: float | None = None,
) -> dict[str, float]:
    """Outcomes of one cell from its per-step records (see the module docstring).

    ``final_fraction`` is the share of the last steps averaged into ``final_reward``;
    ``collapse_fraction``, ``collapse_patience``, ``smoothing_window`` and ``chance_reward`` (the
    chance level when the records do not carry ``train/reward_chance``) set the collapse rule.
    Returns a dict with exactly the keys of :data:`OUTCOME_NAMES`, values as Python floats.
    """
    if not 0.0 < final_fraction <= 1.0:
        raise ValueError(f"final_fraction={final_fraction}: expected a fraction in (0, 1]")
    if not 0.0 <= collapse_fraction < 1.0:
        raise ValueError(f"collapse_fraction={collapse_fraction}: expected a fraction in [0, 1)")
    if collapse_patience < 1 or smoothing_window < 1:
        raise ValueError(
            f"collapse_patience={collapse_patience}, smoothing_window={smoothing_window}: "
            "expected positive step counts"
        )
    if "step" in records.columns:
        records = records.sort_values("step", kind="stable")
        steps = records["step"].to_numpy(dtype=float)
    else:
        steps = np.arange(len(records), dtype=float)

    # Values near the float limit (1e308) overflow in a sum: the outcome is then infinite, which
    # the analysis names beside its table, and the console stays free of numpy's warnings.
    with np.errstate(over="ignore", invalid="ignore"):
        return _outcomes(records, steps, final_fraction, collapse_fraction, collapse_patience, smoothing_window,
                         chance_reward)


def _outcomes(records: pd.DataFrame, steps: np.ndarray, final_fraction: float, collapse_fraction: float,
              collapse_patience: int, smoothing_window: int, chance_reward: float | None) -> dict[str, float]:
    reward = _column(records, REWARD_KEY)
    finite = np.isfinite(reward) & np.isfinite(steps)
    reward_steps, reward_values = steps[finite], reward[finite]

    final_reward, late_gain = _final_and_late_gain(reward_values, final_fraction)
    chance = _nanmean(_column(records, CHANCE_KEY)[finite])
    if math.isnan(chance) and chance_reward is not None:
        chance = float(chance_reward)
    shifted = _column(records, SHIFT_KEY)[finite] == 1.0
    current_task = reward_values[shifted] if shifted.any() and not shifted.all() else reward_values
    kl_k3 = _column(records, KL_K3_KEY)
    return {
        "final_reward": final_reward,
        "reward_auc": _time_average(reward_steps, reward_values),
        "reward_late_gain": late_gain,
        "collapsed": _collapsed(current_task, collapse_fraction, collapse_patience, smoothing_window, chance),
        "kl_k3_mean": _nanmean(kl_k3),
        "kl_k3_worst": _nanmax(kl_k3),
        "extreme_token_frac_mean": _nanmean(_column(records, EXTREME_KEY)),
        "override_rate_mean": _nanmean(_column(records, OVERRIDE_KEY)),
        "expert_drift_final": _last_finite(_column(records, EXPERT_DRIFT_KEY)),
        "residual_mismatch_mean": _nanmean(_column(records, RESIDUAL_KEY)),
        "effective_budget_mean": _nanmean(_effective_budget(records)),
    }


def _effective_budget(records: pd.DataFrame) -> np.ndarray:
    """Per step: the logged effective budget, else realized budget x override rate (0 if nothing replayed)."""
    realized = _column(records, BUDGET_REALIZED_KEY)
    derived = np.where(realized == 0.0, 0.0, realized * _column(records, OVERRIDE_KEY))
    logged = _column(records, EFFECTIVE_BUDGET_KEY)
    return np.where(np.isfinite(logged), logged, derived)


def _column(records: pd.DataFrame, key: str) -> np.ndarray:
    if key not in records.columns:
        return np.full(len(records), np.nan)
    return pd.to_numeric(records[key], errors="coerce").to_numpy(dtype=float)


def _nanmean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def _nanmax(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else math.nan


def _last_finite(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if finite.size else math.nan


def _final_and_late_gain(reward: np.ndarray, final_fraction: float) -> tuple[float, float]:
    if reward.size == 0:
        return math.nan, math.nan
    window = max(1, math.ceil(final_fraction * reward.size))
    final = float(reward[-window:].mean())
    if reward.size < 2 * window:
        return final, math.nan
    before = float(reward[-2 * window : -window].mean())
    return final, final - before


def _time_average(steps: np.ndarray, values: np.ndarray) -> float:
    if values.size == 0:
        return math.nan
    span = steps[-1] - steps[0]
    if values.size == 1 or span <= 0:
        return float(values.mean())
    area = float(np.sum((values[1:] + values[:-1]) * np.diff(steps)) / 2.0)
    return area / span


def _collapsed(reward: np.ndarray, fraction: float, patience: int, window: int, chance: float) -> float:
    if reward.size == 0:
        return math.nan
    return 0.0 if collapse_onset(reward, fraction, patience, window, chance) is None else 1.0


def collapse_onset(reward: np.ndarray, fraction: float = 0.5, patience: int = 10, window: int = 5,
                   chance: float = math.nan) -> int | None:
    """Index (into ``reward``) of the first step of the collapse ``collapsed`` finds, or None.

    The same rule as the ``collapsed`` outcome (module doc): the first of ``patience``
    consecutive smoothed values below the threshold after the best one. It is the event time of
    the survival curves (:mod:`ablate.analysis.survival`).
    """
    if reward.size == 0:
        return None
    smoothed = pd.Series(reward).rolling(window, min_periods=1).mean().to_numpy()
    best_index = int(np.argmax(smoothed))
    best = smoothed[best_index]
    if math.isnan(chance):
        scale = max(best - smoothed[0], abs(best))
        threshold = best - (1.0 - fraction) * scale
    else:
        scale = best - chance
        threshold = chance + fraction * scale
    if scale <= 0:
        return None
    run = 0
    for offset, below in enumerate(smoothed[best_index + 1 :] < threshold):
        run = run + 1 if below else 0
        if run >= patience:
            return best_index + 1 + offset - patience + 1
    return None
    run = 0
    for below in smoothed[best_index + 1 :] < threshold:
        run = run + 1 if below else 0
        if run >= patience:
            return 1.0
    return 0.0
