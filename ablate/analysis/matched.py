"""Selection at a matched effective budget: a policy against ``random``'s budget-response curve.

Policies are matched on the budget ``b`` (routes replayed), but replaying a route whose rollout
and native experts agree changes nothing. What replay changed is the *effective budget* ``e``
(share of valid routes whose replayed experts differ from the native ones, the outcome
``effective_budget_mean``). A policy that picks mismatched routes changes many more routes
than ``random`` at the same ``b``, so ``Y(policy, b) - Y(random, b)`` mixes "how many routes
changed" with "which ones".

``random`` traces how the outcome responds to the number of changed routes when the choice
carries no information: its points ``(e, Y)`` at each budget, with ``none`` at ``(0, Y_none)``
and ``full`` at ``(e_full, Y_full)`` (random replay at b = 0 and b = 1 are exactly those), form
a curve ``f``. For each seed the curve is that seed's own cells, so a seed-level offset shared
by every arm cancels, and the matched selection effect of a policy at ``b`` is, per seed,
``Y(policy, b) - f(e_policy)``: what it achieved beyond what changing as many routes at random
achieves. The decomposition of a policy's effect against ``none`` is then

    Y(policy, b) - Y(none) = [f(e_policy) - Y(none)]  +  [Y(policy, b) - f(e_policy)]
                             how many routes changed      which routes changed

Interpolation is linear between the curve's points. A response that bends between two of
random's budgets biases the matched value by at most the curve's departure from its chord
there: denser random budgets shrink it. An effective budget outside the seed's curve is not
extrapolated, except by ``extrapolate`` times the curve's span beyond an end, where it takes
the end's value: ``full`` changes every mismatched route, so a policy that replays all of them
(``mismatch`` at a budget above the mismatch rate) sits at the curve's end up to run-to-run
noise in the mismatch rate itself.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping

import numpy as np

Curve = tuple[np.ndarray, np.ndarray]


def seed_curves(points: list[tuple[Mapping[Hashable, float], Mapping[Hashable, float]]]) -> dict[Hashable, Curve]:
    """Per seed, the sorted ``(e, Y)`` points of the arms in ``points`` (each ``({seed: e}, {seed: Y})``).

    Points whose ``e`` or ``Y`` is missing or not finite are left out; equal ``e`` values are
    averaged into one point so the curve is a function.
    """
    gathered: dict[Hashable, list[tuple[float, float]]] = {}
    for effective, outcome in points:
        for seed in effective.keys() & outcome.keys():
            e, y = effective[seed], outcome[seed]
            if math.isfinite(e) and math.isfinite(y):
                gathered.setdefault(seed, []).append((e, y))
    curves = {}
    for seed, pairs in gathered.items():
        e = np.array([p[0] for p in pairs])
        y = np.array([p[1] for p in pairs])
        unique, inverse = np.unique(e, return_inverse=True)
        curves[seed] = (unique, np.bincount(inverse, weights=y) / np.bincount(inverse))
    return curves


def interpolate(curve: Curve, e: float, extrapolate: float) -> float:
    """``f(e)`` on ``curve`` (linear), the end's value within ``extrapolate x span`` beyond an end, else NaN."""
    xs, ys = curve
    if xs.size < 2 or not math.isfinite(e):
        return math.nan
    low, high = float(xs[0]), float(xs[-1])
    slack = extrapolate * (high - low)
    if e < low - slack or e > high + slack:
        return math.nan
    return float(np.interp(e, xs, ys))  # np.interp holds the end values outside [low, high]


def matched_pairs(
    outcome: Mapping[Hashable, float],
    effective: Mapping[Hashable, float],
    curves: Mapping[Hashable, Curve],
    *,
    extrapolate: float,
) -> tuple[list[Hashable], np.ndarray, np.ndarray, int, int]:
    """Per seed, the policy's outcome and random's curve at the policy's effective budget.

    Returns ``(seeds, y_policy, y_random_at_e, outside, no_curve)``: the seeds matched, their
    values, and how many of the policy's seeds fell outside their curve or had no curve of
    two points or more (those are dropped, never extrapolated).
    """
    if extrapolate < 0:
        raise ValueError(f"extrapolate={extrapolate}: expected a non-negative share of the curve's span")
    seeds, treated, control = [], [], []
    outside = no_curve = 0
    for seed in sorted(outcome.keys() & effective.keys(), key=str):
        curve = curves.get(seed)
        if curve is None or curve[0].size < 2:
            no_curve += 1
            continue
        matched = interpolate(curve, effective[seed], extrapolate)
        if math.isnan(matched):
            outside += 1
            continue
        seeds.append(seed)
        treated.append(outcome[seed])
        control.append(matched)
    return seeds, np.array(treated, dtype=float), np.array(control, dtype=float), outside, no_curve
