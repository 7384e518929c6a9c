"""Statistics over seeds, rliable style: pure functions over numpy arrays.

Shape convention: a 1-D array holds one value per seed; for paired statistics ``a[i]`` and
``b[i]`` come from the same seed. Inputs must be finite (the table layer drops NaN outcomes
and reports how many seeds remain). Randomness always comes from an explicit
``numpy.random.Generator`` argument, never from global state, so the same call with a
generator in the same state gives the same interval.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

Statistic = Callable[..., np.ndarray]


def iqm(x: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """Interquartile mean: the mean of the middle 50% of the values.

    Same convention as ``scipy.stats.trim_mean(x, 0.25)`` (and rliable): sort, drop
    ``floor(0.25 * n)`` values from each end, average the rest. It is robust to a few
    diverged seeds while using more data than the median. ``axis=None`` flattens.
    """
    values = np.asarray(x, dtype=float)
    if axis is None:
        values, axis = values.ravel(), 0
    n = values.shape[axis]
    if n == 0:
        raise ValueError("iqm of an empty array")
    cut = int(0.25 * n)
    ordered = np.sort(values, axis=axis)
    middle = np.take(ordered, np.arange(cut, n - cut), axis=axis)
    result = middle.mean(axis=axis)
    return float(result) if np.ndim(result) == 0 else result


def bootstrap_ci(
    x: np.ndarray,
    stat: Statistic = np.mean,
    *,
    level: float = 0.95,
    reps: int = 2000,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``stat(x)`` over seeds.

    Draws ``reps`` resamples of the seeds with replacement, computes ``stat`` on each
    (``stat`` must accept ``axis=``, as ``np.mean``, ``np.median`` and :func:`iqm` do) and
    returns the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles. The interval describes
    the uncertainty of the statistic from seed-to-seed variation only; with few seeds the
    percentile interval is somewhat too narrow (its coverage is below ``level``), which is one
    reason to report the seed count beside it. Returns ``(nan, nan)`` for fewer than two values.
    """
    values = _finite_1d(x, "x")
    _check_level(level)
    if reps < 1:
        raise ValueError(f"reps={reps}: expected a positive number of bootstrap resamples")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng={rng!r}: expected a numpy.random.Generator (np.random.default_rng(seed))")
    if values.size < 2:
        return math.nan, math.nan
    samples = values[rng.integers(0, values.size, size=(reps, values.size))]
    estimates = np.asarray(stat(samples, axis=1), dtype=float)
    alpha = 1.0 - level
    low, high = np.quantile(estimates, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


def paired_bootstrap_ci(
    a: np.ndarray,
    b: np.ndarray,
    stat: Statistic = np.mean,
    *,
    level: float = 0.95,
    reps: int = 2000,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat(a - b)`` over seed-paired differences.

    Pairing resamples seeds, not runs: a seed-level offset shared by both arms (same data
    order, same initial weights) cancels in ``a - b``, so the interval is narrower than an
    unpaired one whenever arms are positively correlated across seeds.
    """
    a_values, b_values = _finite_1d(a, "a"), _finite_1d(b, "b")
    if a_values.shape != b_values.shape:
        raise ValueError(
            f"paired arrays differ in length: a has {a_values.size} seeds, b has {b_values.size}"
        )
    return bootstrap_ci(a_values - b_values, stat, level=level, reps=reps, rng=rng)


def sign_flip_pvalue(
    d: np.ndarray,
    *,
    exact_max_n: int = 20,
    reps: int = 100_000,
    rng: np.random.Generator | None = None,
) -> float:
    """Two-sided sign-flip (paired permutation) p-value for "the mean difference is zero".

    Under the null each paired difference is symmetric about zero, so flipping its sign is
    equally likely. The p-value is the share of sign assignments whose ``|mean|`` is at least
    the observed ``|mean(d)|``. For ``n <= exact_max_n`` all ``2**n`` assignments are
    enumerated (exact; the smallest attainable value is ``2 / 2**n``); above that ``reps``
    random assignments are drawn from ``rng`` (required then) and ``(1 + hits) / (1 + reps)``
    is returned, which is a valid p-value. An empty vector gives ``nan``.
    """
    values = _finite_1d(d, "d")
    n = values.size
    if n == 0:
        return math.nan
    observed = abs(values.mean())
    tolerance = 1e-12 * max(1.0, float(np.abs(values).max()))
    if n <= exact_max_n:
        hits = 0
        chunk = 1 << 16
        bits = np.arange(n)
        for first in range(0, 1 << n, chunk):
            codes = np.arange(first, min(first + chunk, 1 << n))
            signs = 1.0 - 2.0 * ((codes[:, None] >> bits) & 1)
            hits += int(np.count_nonzero(np.abs(signs @ values) / n >= observed - tolerance))
        return hits / float(1 << n)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"sign_flip_pvalue with n={n} > exact_max_n={exact_max_n} is Monte Carlo: "
            "pass rng=numpy.random.Generator"
        )
    hits = 0
    remaining = reps
    while remaining:
        size = min(remaining, max(1, (1 << 22) // n))
        signs = rng.choice(np.array([-1.0, 1.0]), size=(size, n))
        hits += int(np.count_nonzero(np.abs(signs @ values) / n >= observed - tolerance))
        remaining -= size
    return (1.0 + hits) / (1.0 + reps)


def min_achievable_pvalue(n: int) -> float:
    """Smallest two-sided p-value an exact sign-flip test can give with ``n`` paired seeds.

    It is ``2 / 2**n`` (all signs agree, in either direction), reached only when no difference
    is zero; ``1.0`` for ``n = 0``.
    """
    if n < 0:
        raise ValueError(f"n={n}: expected a non-negative seed count")
    return min(1.0, 2.0 / 2.0**n)


def min_seeds_for_sign_flip(alpha: float = 0.05) -> int:
    """Fewest paired seeds for which an exact sign-flip test can give ``p <= alpha``.

    ``alpha = 0.05`` needs 6 seeds (``2/2**5 = 0.0625``, ``2/2**6 = 0.031``); 0.01 needs 8.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha}: expected a significance level in (0, 1)")
    n = 1
    while min_achievable_pvalue(n) > alpha:
        n += 1
    return n


def _finite_1d(x: np.ndarray, name: str) -> np.ndarray:
    values = np.asarray(x, dtype=float).ravel()
    if not np.all(np.isfinite(values)):
        raise ValueError(
            f"{name} holds {int(np.count_nonzero(~np.isfinite(values)))} non-finite values: "
            "drop NaN seeds before computing statistics"
        )
    return values


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: expected a confidence level in (0, 1), e.g. 0.95")
