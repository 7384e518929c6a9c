"""Time to collapse per arm: Kaplan-Meier curves and a paired permutation log-rank test.

**Collapse** is the event of the ``collapsed`` outcome (:mod:`ablate.outcomes`): the
smoothed reward stays below the collapse threshold for ``collapse_patience`` consecutive steps
after its best value. The **time** of a collapse is the step at which that run of low values
starts (:func:`~ablate.outcomes.collapse_onset`); a run that never collapses is
censored at its last step. Steps are those of the records (after a task shift, only the steps
after it count, as for ``collapsed``).

Shape convention: ``time`` and ``event`` are 1-D arrays, one entry per cell (seed); for the
paired test ``a`` and ``b`` are seed-paired (entry ``i`` of both is seed ``i``).

**The test** compares an arm with its baseline by the log-rank statistic (observed minus
expected collapses of the arm, over the pooled risk sets), with its null distribution from
swapping the two arms' (time, event) within each seed: exact over all ``2^n`` swaps up to 12
seeds, Monte Carlo above. Seeds are the unit, as for every effect: the swap keeps each seed's
shared start.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from ablate.outcomes import REWARD_KEY, SHIFT_KEY, collapse_onset

EXACT_MAX_N = 12


def time_to_collapse(records: pd.DataFrame, *, collapse_fraction: float = 0.5, collapse_patience: int = 10,
                     smoothing_window: int = 5, chance_reward: float | None = None) -> tuple[float, bool]:
    """``(step, collapsed)`` of one cell's records: the collapse's first step, else the last step."""
    ordered = records.sort_values("step", kind="stable")
    steps = ordered["step"].to_numpy(dtype=float)
    reward = pd.to_numeric(ordered[REWARD_KEY], errors="coerce").to_numpy(dtype=float) \
        if REWARD_KEY in ordered.columns else np.full(len(ordered), math.nan)
    finite = np.isfinite(reward) & np.isfinite(steps)
    steps, reward = steps[finite], reward[finite]
    if SHIFT_KEY in ordered.columns:
        shifted = ordered[SHIFT_KEY].to_numpy(dtype=float)[finite] == 1.0
        if shifted.any() and not shifted.all():
            steps, reward = steps[shifted], reward[shifted]
    if reward.size == 0:
        return math.nan, False
    chance = math.nan if chance_reward is None else float(chance_reward)
    onset = collapse_onset(reward, collapse_fraction, collapse_patience, smoothing_window, chance)
    return (float(steps[onset]), True) if onset is not None else (float(steps[-1]), False)


def collapse_times(steps: pd.DataFrame, keys: Sequence[str] = ()) -> pd.DataFrame:
    """One row per cell of a per-step frame (``load_runs(per_step=True)``): arm, seed, ``time``, ``event``."""
    identity = [*keys, "policy", "budget", "seed"]
    rows = []
    for values, records in steps.groupby(identity, sort=False, dropna=False):
        time, event = time_to_collapse(records)
        rows.append({**dict(zip(identity, values)), "time": time, "event": event})
    return pd.DataFrame(rows, columns=[*identity, "time", "event"])


def kaplan_meier(time: np.ndarray, event: np.ndarray) -> pd.DataFrame:
    """The Kaplan-Meier estimate of P(no collapse yet) at each distinct event or censoring step."""
    time, event = np.asarray(time, dtype=float), np.asarray(event, dtype=bool)
    rows, survival = [], 1.0
    for t in np.unique(time):
        at_risk = int(np.count_nonzero(time >= t))
        events = int(np.count_nonzero((time == t) & event))
        survival *= 1.0 - events / at_risk if at_risk else 1.0
        rows.append({"step": t, "at_risk": at_risk, "collapses": events, "survival": survival})
    return pd.DataFrame(rows, columns=["step", "at_risk", "collapses", "survival"])


def logrank_statistic(time: np.ndarray, event: np.ndarray, in_arm: np.ndarray) -> float:
    """Observed minus expected collapses of the arm (``in_arm`` True) over the pooled risk sets."""
    time, event, in_arm = (np.asarray(time, dtype=float), np.asarray(event, dtype=bool),
                           np.asarray(in_arm, dtype=bool))
    statistic = 0.0
    for t in np.unique(time[event]):
        at_risk = time >= t
        total = np.count_nonzero(at_risk)
        collapses = np.count_nonzero((time == t) & event)
        statistic += np.count_nonzero((time == t) & event & in_arm) - collapses * np.count_nonzero(at_risk & in_arm) / total
    return float(statistic)


def paired_logrank_pvalue(a_time: np.ndarray, a_event: np.ndarray, b_time: np.ndarray, b_event: np.ndarray, *,
                          rng: np.random.Generator, reps: int = 9999) -> float:
    """Two-sided p of "collapse times do not depend on the arm", swapping arms within each seed."""
    a_time, b_time = np.asarray(a_time, dtype=float), np.asarray(b_time, dtype=float)
    a_event, b_event = np.asarray(a_event, dtype=bool), np.asarray(b_event, dtype=bool)
    n = a_time.size
    if n == 0 or not (a_event.any() or b_event.any()):
        return math.nan if n == 0 else 1.0

    def statistic(swap: np.ndarray) -> float:
        time = np.concatenate([np.where(swap, b_time, a_time), np.where(swap, a_time, b_time)])
        event = np.concatenate([np.where(swap, b_event, a_event), np.where(swap, a_event, b_event)])
        return abs(logrank_statistic(time, event, np.arange(2 * n) < n))

    observed = statistic(np.zeros(n, dtype=bool)) - 1e-12
    if n <= EXACT_MAX_N:
        swaps = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(bool)
        return float(np.mean([statistic(s) >= observed for s in swaps]))
    hits = sum(statistic(rng.random(n) < 0.5) >= observed for _ in range(reps))
    return (1 + hits) / (1 + reps)


def survival_table(times: pd.DataFrame, keys: Sequence[str] = (), *, baseline: str = "none",
                   seed: int = 0) -> pd.DataFrame:
    """Per arm: seeds, collapses, the median step of collapse (NaN while half survive) and the
    paired log-rank p against ``baseline`` of the same context."""
    rows = []
    for context_values, part in (times.groupby(list(keys), sort=False, dropna=False) if keys else [((), times)]):
        context = dict(zip(keys, context_values if isinstance(context_values, tuple) else (context_values,)))
        control = part[part["policy"] == baseline].set_index("seed")
        for (policy, budget), arm in part.groupby(["policy", "budget"], sort=False):
            curve = kaplan_meier(arm["time"], arm["event"])
            below = curve.loc[curve["survival"] <= 0.5, "step"]
            p = math.nan
            if policy != baseline and not control.empty:
                shared = sorted(set(arm["seed"]) & set(control.index), key=str)
                mine = arm.set_index("seed").loc[shared]
                theirs = control.loc[shared]
                rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(len(rows),)))
                p = paired_logrank_pvalue(mine["time"], mine["event"], theirs["time"], theirs["event"], rng=rng)
            rows.append({**context, "policy": policy, "budget": float(budget), "n_seeds": len(arm),
                         "collapses": int(arm["event"].sum()),
                         "median_collapse_step": float(below.iloc[0]) if not below.empty else math.nan,
                         f"p_logrank_vs_{baseline}": p})
    return pd.DataFrame(rows)
