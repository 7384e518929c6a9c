"""Budget against selection from counterfactual probes (docs/probes.md): per step, per cell, across cells.

A probed cell logs, on its probed steps, what each probe's mask would have left of the mismatch
(``probe/<id>/mismatch/...``) and how many routes it would have changed
(``probe/<id>/replay/effective_budget``), all scored on the same batch with the same weights.
The differences between two probes of one step are what the masks change at that state, with
no seed noise: a paired design with common random numbers.

Three levels, each saying what it is a statement about:

- :func:`step_effects`: per cell and probed step, the effects of one key: ``replay``
  (``full - none``), ``budget`` at b (``random@b - none``), ``selection`` at b (``policy@b -
  random@b`` and ``- uniform@b``) and ``matched_selection`` at b (``policy@b - f(e_policy)``,
  ``f`` that step's curve of ``random`` probes at several budgets with ``none`` at ``(0,
  Y_none)`` and ``full`` at ``(e_full, Y_full)``, read at the policy's effective budget with
  :mod:`ablate.analysis.matched`).
- :func:`within_run`: per cell, the mean of each effect over its probed steps with a HAC
  (Newey-West) interval. Neighbouring steps share weights, so their effects are autocorrelated;
  the HAC variance accounts for it. The interval is **conditional on that cell's trajectory**: it
  says what the masks change along this run, not what training with them would do.
- :func:`across_cells`: per cell and probe, the mean over probed steps (``kl_k3_mean`` is the
  mean of the probe's ``mismatch/kl_k3``, as a sweep's outcome is of the cell's own key), then
  :func:`ablate.analysis.tables.effects` on those values with the host cell's seed as the unit:
  the same rows, intervals, tests and families as a sweep's effects, over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from ablate.analysis.matched import interpolate, seed_curves
from ablate.analysis.tables import (
    CURVE_POLICY,
    EFFECTIVE_BUDGET,
    FIXED_BUDGET_POLICIES,
    SELECTION_BASELINES,
    effects,
    order_policies,
)
from ablate.diagnostics.schema import probe_key
from ablate.policies.roles import FULL_REPLAY, NO_REPLAY

#: Probe outcomes: the mean over probed steps of one probe key, named like a sweep's outcome.
PROBE_OUTCOMES: dict[str, str] = {
    "kl_k3_mean": "mismatch/kl_k3",
    "kl_k1_mean": "mismatch/kl_k1",
    "extreme_token_frac_mean": "mismatch/extreme_token_frac",
    "abs_logratio_mean": "mismatch/abs_logratio_mean",
}
EFFECTIVE_KEY = "replay/effective_budget"
#: Config keys of the host cell that are no context of a probe effect: the probe settings themselves.
NOT_CONTEXT = ("probes", "probe_every")
WITHIN_RUN_NOTE = "one run's probed steps: conditional on its trajectory (HAC, Newey-West)"
STEP_COLUMNS = ("effect", "policy", "baseline", "budget", "difference")
EFFECT_ORDER = ("replay", "budget", "selection", "matched_selection")


def probe_arms(table: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, float | None]]:
    """Probe id -> its arm ``(policy, budget)``: ``fisher[tau=1]`` for settings, no budget for none/full."""
    arms = {}
    for probe_id, row in table.items():
        settings = row.get("settings") or {}
        name = row["policy"]
        if settings:
            name += "[" + ",".join(f"{k}={v}" for k, v in sorted(settings.items())) + "]"
        arms[probe_id] = (name, None if row["policy"] in FIXED_BUDGET_POLICIES else round(float(row["budget"]), 12))
    return arms


def host_keys(steps: pd.DataFrame) -> list[str]:
    """Columns that tell host cells apart in a context: their policy, budget and varied config keys."""
    varied = [key for key in steps.attrs.get("config_keys", []) if key not in NOT_CONTEXT]
    return ["host_policy", "host_budget", *varied]


def _step_values(steps: pd.DataFrame, arms: Mapping[str, tuple[str, float | None]], key: str):
    """Per (cell, step) row of the probed steps: ``{arm: (value, effective budget)}``."""
    for _, row in steps.iterrows():
        values = {}
        for probe_id, arm in arms.items():
            value = row.get(probe_key(probe_id, key), math.nan)
            if value is not None and np.isfinite(value):
                values[arm] = (float(value), float(row.get(probe_key(probe_id, EFFECTIVE_KEY), math.nan)))
        if values:
            yield row, values


def step_effects(steps: pd.DataFrame, table: Mapping[str, Mapping[str, Any]], key: str = "mismatch/kl_k3",
                 *, extrapolate: float = 0.1) -> pd.DataFrame:
    """Every effect of ``key`` at every probed step of every cell (``load_runs(per_step=True)`` rows)."""
    arms = probe_arms(table)
    context = host_keys(steps)
    rows = []
    for row, values in _step_values(steps, arms, key):
        head = {"cell_id": row["cell_id"], "seed": row["seed"], "host_policy": row["policy"],
                "host_budget": row["budget"], **{k: row[k] for k in context[2:]}, "step": int(row["step"])}
        rows += [{**head, **dict(zip(STEP_COLUMNS, effect))} for effect in _effects_of_step(values, extrapolate)]
    return pd.DataFrame(rows, columns=["cell_id", "seed", *context, "step", *STEP_COLUMNS])


def _effects_of_step(values: Mapping[tuple[str, float | None], tuple[float, float]], extrapolate: float):
    y = {arm: value for arm, (value, _) in values.items()}
    if (FULL_REPLAY, None) in y and (NO_REPLAY, None) in y:
        yield "replay", FULL_REPLAY, NO_REPLAY, math.nan, y[(FULL_REPLAY, None)] - y[(NO_REPLAY, None)]
    budgeted = sorted((arm for arm in y if arm[1] is not None), key=lambda arm: (arm[0], arm[1]))
    for policy, budget in budgeted:
        if policy == CURVE_POLICY and (NO_REPLAY, None) in y:
            yield "budget", policy, NO_REPLAY, budget, y[(policy, budget)] - y[(NO_REPLAY, None)]
        for baseline in SELECTION_BASELINES:
            if policy not in (baseline, CURVE_POLICY) and (baseline, budget) in y:
                yield "selection", policy, baseline, budget, y[(policy, budget)] - y[(baseline, budget)]
    curve_points = [({0: values[arm][1]}, {0: values[arm][0]}) for arm in values
                    if arm[0] == CURVE_POLICY or arm[0] in FIXED_BUDGET_POLICIES]
    curve = seed_curves(curve_points).get(0)
    if curve is None or not any(arm[0] == CURVE_POLICY for arm in values):
        return
    for policy, budget in budgeted:
        if policy != CURVE_POLICY:
            matched = interpolate(curve, values[(policy, budget)][1], extrapolate)
            if math.isfinite(matched):
                yield "matched_selection", policy, CURVE_POLICY, budget, y[(policy, budget)] - matched


def hac_interval(values: np.ndarray, level: float = 0.95, lags: int | None = None) -> tuple[float, float, float, int]:
    """Mean of a series of steps with a Newey-West (Bartlett kernel) normal interval.

    ``lags`` defaults to ``floor(4 (n / 100) ^ (2/9))`` (Newey and West's rule), at least 1. The
    variance of the mean is ``(gamma_0 + 2 sum_{j <= L} (1 - j / (L + 1)) gamma_j) / n``: positive
    autocorrelation between neighbouring steps widens the interval as it should. Returns
    ``(mean, low, high, lags)``; fewer than three values give no interval.
    """
    from scipy.stats import norm

    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    n = x.size
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(x.mean())
    if n < 3:
        return mean, math.nan, math.nan, 0
    lags = max(1, int(4 * (n / 100) ** (2 / 9))) if lags is None else lags
    lags = min(lags, n - 1)
    centred = x - mean
    variance = centred @ centred / n
    for j in range(1, lags + 1):
        variance += 2 * (1 - j / (lags + 1)) * (centred[j:] @ centred[:-j]) / n
    half = float(norm.ppf((1 + level) / 2)) * math.sqrt(max(variance, 0.0) / n)
    return mean, mean - half, mean + half, lags


def within_run(step_table: pd.DataFrame, *, level: float = 0.95) -> pd.DataFrame:
    """Per cell and effect, the mean over its probed steps and a HAC interval, conditional on the trajectory."""
    group = [c for c in step_table.columns if c not in ("step", "difference")]
    rows = []
    for identity, part in step_table.sort_values("step").groupby(group, sort=False, dropna=False):
        mean, low, high, lags = hac_interval(part["difference"].to_numpy(), level)
        rows.append({**dict(zip(group, identity)), "mean": mean, "ci_low": low, "ci_high": high,
                     "n_steps": int(part["difference"].notna().sum()), "hac_lags": lags, "note": WITHIN_RUN_NOTE})
    table = pd.DataFrame(rows, columns=[*group, "mean", "ci_low", "ci_high", "n_steps", "hac_lags", "note"])
    effect_rank = table["effect"].map({name: i for i, name in enumerate(EFFECT_ORDER)})
    policy_rank = table["policy"].map({name: i for i, name in enumerate(order_policies(table["policy"].unique()))})
    order = pd.DataFrame({"seed": table["seed"], "cell": table["cell_id"], "e": effect_rank, "p": policy_rank,
                          "b": table["baseline"], "budget": table["budget"]}).sort_values(["seed", "cell", "e", "p", "b", "budget"])
    return table.loc[order.index].reset_index(drop=True)


def probe_cells(steps: pd.DataFrame, table: Mapping[str, Mapping[str, Any]], outcome: str = "kl_k3_mean") -> pd.DataFrame:
    """One row per (host cell, probe): the probe's arm, the host's seed and context, the mean over probed steps."""
    key = _outcome_key(outcome)
    arms = probe_arms(table)
    context = host_keys(steps)
    rows = []
    for cell_id, cell in steps.groupby("cell_id", sort=False):
        first = cell.iloc[0]
        head = {"cell_id": cell_id, "seed": first["seed"], "host_policy": first["policy"],
                "host_budget": first["budget"], **{k: first[k] for k in context[2:]}}
        for probe_id, (policy, budget) in arms.items():
            column = probe_key(probe_id, key)
            if column not in cell.columns:
                continue
            rows.append({**head, "policy": policy, "budget": FIXED_BUDGET_POLICIES.get(policy, budget),
                         outcome: _mean(cell[column]), EFFECTIVE_BUDGET: _mean(cell.get(probe_key(probe_id, EFFECTIVE_KEY)))})
    frame = pd.DataFrame(rows, columns=["cell_id", "seed", *context, "policy", "budget", outcome, EFFECTIVE_BUDGET])
    frame["budget"] = frame["budget"].astype(float)
    return frame


def across_cells(steps: pd.DataFrame, table: Mapping[str, Mapping[str, Any]], outcome: str = "kl_k3_mean",
                 **effect_settings: Any) -> pd.DataFrame:
    """:func:`ablate.analysis.tables.effects` over the host cells' seeds, on per-cell probe means."""
    frame = probe_cells(steps, table, outcome)
    context = [key for key in host_keys(steps) if frame[key].astype(str).nunique() > 1]
    return effects(frame, outcome, by=context, others_vs_random=True, **effect_settings)


def _outcome_key(outcome: str) -> str:
    if outcome not in PROBE_OUTCOMES:
        raise ValueError(f"probe outcome {outcome!r}: expected one of {', '.join(PROBE_OUTCOMES)}")
    return PROBE_OUTCOMES[outcome]


def _mean(values: pd.Series | None) -> float:
    if values is None:
        return math.nan
    array = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float)
    array = array[np.isfinite(array)]
    return float(array.mean()) if array.size else math.nan

