"""One paired effect from seed-paired arrays: the numbers of one effect row.

``a[i]`` (the policy) and ``b[i]`` (the baseline) come from the same seed; both 1-D and finite.
:func:`paired_effect` is what every effect table (policies, ``--compare``, per-cell probes) calls
per row, and :func:`paired_interval` gives the same row's interval at another level (the
family-adjusted one) from the same test, so a row's test, intervals and equivalence agree.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ablate.analysis.settings import IntervalMethod
from ablate.analysis.signflip import SignFlip, t_interval
from ablate.analysis.stats import ZERO_TOLERANCE, bootstrap_ci, probability_of_improvement, snap_to_zero


def paired_differences(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """``a - b`` with differences within float32 rounding of the inputs set to 0, and that scale.

    Seeds that agree up to rounding must not read as a consistent sign in the test.
    """
    a, b = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if a.shape != b.shape:
        raise ValueError(f"paired arrays differ in length: a has {a.size} seeds, b has {b.size}")
    scale = float(max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0)))
    return np.where(np.abs(a - b) <= ZERO_TOLERANCE * scale, 0.0, a - b), scale


def paired_effect(
    a: np.ndarray,
    b: np.ndarray,
    *,
    rng: np.random.Generator,
    level: float = 0.95,
    method: IntervalMethod = "exact",
    reps: int = 2000,
    min_seeds: int = 6,
    margin: float | None = None,
    higher_is_better: bool | None = True,
) -> dict[str, Any]:
    """The statistics of ``mean(a - b)`` over seeds.

    Returns ``mean``; ``ci_low``/``ci_high`` at ``level`` (``method="exact"``: the interval
    inverting the sign-flip test, so it excludes 0 exactly when ``p_value < 1 - level``; NaN
    below ``min_seeds`` paired seeds); ``p_value`` (two-sided exact sign-flip test, Monte Carlo
    with ``rng`` above 16 seeds); ``p_equiv`` (TOST of ``|mean| < margin``, NaN without a
    margin); ``prob_improvement`` (rliable's, unpaired: a run of ``a`` beats a run of ``b``);
    ``share_improved`` (paired: the share of seeds whose own difference is an improvement,
    strictly); ``sd_diff`` (sample standard deviation of the differences, what power depends
    on); ``n_seeds``; and ``test``, the :class:`SignFlip` of the row, for
    :func:`paired_interval`. ``higher_is_better=None`` (no better side) counts a larger value
    as the improvement.
    """
    diffs, scale = paired_differences(a, b)
    n = diffs.size
    test = SignFlip(diffs, rng=rng)
    low, high = (paired_interval(test, 1.0 - level, method=method, reps=reps, rng=rng)
                 if n >= min_seeds else (math.nan, math.nan))
    better = diffs < 0 if higher_is_better is False else diffs > 0
    return {
        "mean": snap_to_zero(float(diffs.mean()), scale) if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        "p_value": test.pvalue() if n else math.nan,
        "p_equiv": test.tost(margin) if margin else math.nan,
        "prob_improvement": probability_of_improvement(a, b, higher_is_better=higher_is_better is not False),
        "share_improved": float(better.mean()) if n else math.nan,
        "sd_diff": float(diffs.std(ddof=1)) if n > 1 else math.nan,
        "n_seeds": n,
        "test": test,
    }


def paired_interval(test: SignFlip, alpha: float, *, method: IntervalMethod = "exact", reps: int = 2000,
                    rng: np.random.Generator) -> tuple[float, float]:
    """The interval of ``mean(test.d)`` at level ``1 - alpha`` by ``method``.

    ``"exact"`` inverts ``test`` itself; ``"t"`` is Student's t of the differences;
    ``"percentile"``/``"BCa"`` a paired bootstrap. ``alpha == 0`` (a question its family never
    lets this row ask) gives ``(-inf, inf)`` for every method.
    """
    if method == "exact" or alpha == 0.0 or test.n < 2:
        return test.interval(alpha)
    if method == "t":
        return t_interval(test.d, level=1.0 - alpha)
    return bootstrap_ci(test.d, level=1.0 - alpha, reps=reps, rng=rng, method=method)
