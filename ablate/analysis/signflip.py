"""The exact sign-flip test of paired differences, and everything that must agree with it.

Shape convention: ``d`` is a 1-D array of seed-paired differences ``a[i] - b[i]``, one per seed;
``samples`` (for power) is ``(num_samples, num_seeds)``. Randomness comes only from an explicit
``numpy.random.Generator``.

**The test.** Under "the differences are symmetric about ``mu``" each sign of ``d[i] - mu`` is
equally likely to be flipped. The two-sided p-value of ``mu`` is the share of sign patterns ``s``
with ``|sum(s * (d - mu))| >= |sum(d - mu)|``. Up to :data:`EXACT_MAX_N` seeds every one of the
``2**n`` patterns is enumerated (exact; the smallest p is ``2 / 2**n``); above, :data:`DRAWS`
patterns drawn once from the caller's generator are used for every ``mu`` (Monte Carlo, the
observed pattern counted once more, so the p-value stays valid: ``(1 + hits) / (1 + DRAWS)``).

**The interval** is the set of ``mu`` the same test does not reject at ``alpha``:
``{mu : p(mu) >= alpha}``, its edges read off the sign patterns (:meth:`SignFlip._edges`), and
it excludes 0 exactly when ``p(0) < alpha``, whatever the data. Its coverage is
``1 - alpha`` or more wherever the differences are symmetric about their mean (it is exact under
that assumption, and robust to heavy tails); below the seed count where ``2 / 2**n >= alpha`` no
data can reject anything and the interval is the whole line (``-inf, inf``).

**Equivalence** (two one-sided tests, TOST): ``|mean| < margin`` is shown when both
"mean <= -margin" and "mean >= margin" are rejected by one-sided sign-flip tests at ``alpha``;
``p_equiv`` is the larger of the two one-sided p-values.

The one-sample summary interval of a single arm (no pairing to flip) is Student's t
(:func:`t_interval`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

import numpy as np

#: Up to this many seeds the sign patterns are enumerated (65,536 at 16).
EXACT_MAX_N = 16
#: Random sign patterns drawn above :data:`EXACT_MAX_N` seeds (p resolution 1/20,000).
DRAWS = 19_999
Alternative = Literal["two-sided", "greater", "less"]


@lru_cache(maxsize=EXACT_MAX_N + 1)
def all_sign_patterns(n: int) -> np.ndarray:
    """The ``2**n`` sign patterns of ``n`` seeds, ``(2**n, n)`` of +-1.0 (read-only, cached)."""
    codes = np.arange(1 << n)[:, None]
    signs = 1.0 - 2.0 * ((codes >> np.arange(n)) & 1)
    signs.setflags(write=False)
    return signs


class SignFlip:
    """The sign-flip distribution of one vector of paired differences ``d``.

    Built once per effect row; :meth:`pvalue`, :meth:`interval` and :meth:`tost` then reuse the
    same patterns, so the p-value, the interval and the equivalence test of a row agree.
    ``rng`` is needed only above :data:`EXACT_MAX_N` seeds.
    """

    def __init__(self, d: np.ndarray, *, rng: np.random.Generator | None = None,
                 exact_max_n: int = EXACT_MAX_N, draws: int = DRAWS) -> None:
        values = np.asarray(d, dtype=float).ravel()
        if not np.all(np.isfinite(values)):
            raise ValueError(f"d holds {int(np.count_nonzero(~np.isfinite(values)))} non-finite values: "
                             "drop NaN seeds before testing")
        self.d = values
        self.n = n = values.size
        self.exact = n <= exact_max_n
        if n == 0:
            signs = np.ones((1, 0))
        elif self.exact:
            signs = all_sign_patterns(n)
        else:
            if not isinstance(rng, np.random.Generator):
                raise TypeError(f"a sign-flip test of n={n} > {exact_max_n} seeds is Monte Carlo: "
                                "pass rng=numpy.random.Generator")
            signs = rng.choice(np.array([-1.0, 1.0]), size=(draws, n))
        self._flipped_sums = signs @ values  # sum(s * d) per pattern
        self._sign_sums = signs.sum(axis=1)  # sum(s) per pattern: sum(s * (d - mu)) = A - mu * c
        self._tolerance = 1e-12 * max(1.0, float(np.abs(values).max(initial=0.0)))

    @property
    def min_pvalue(self) -> float:
        """The smallest two-sided p-value these seeds can give: ``2 / 2**n`` (exact)."""
        return 1.0 if self.n == 0 else (math.ldexp(1.0, 1 - self.n) if self.exact else 1.0 / (1 + self._sign_sums.size))

    def pvalue(self, mu: float = 0.0, alternative: Alternative = "two-sided") -> float:
        """p-value of "the differences are symmetric about ``mu``" (NaN without seeds).

        ``"greater"`` asks whether the mean exceeds ``mu`` (small p when ``mean(d) >> mu``),
        ``"less"`` whether it falls below.
        """
        if self.n == 0:
            return math.nan
        flipped = (self._flipped_sums - mu * self._sign_sums) / self.n
        observed = float(np.mean(self.d - mu)) if mu else float(self.d.mean())
        tol = self._tolerance
        if alternative == "two-sided":
            hits = np.abs(flipped) >= abs(observed) - tol
        elif alternative == "greater":
            hits = flipped >= observed - tol
        elif alternative == "less":
            hits = flipped <= observed + tol
        else:
            raise ValueError(f"alternative={alternative!r}: expected two-sided, greater or less")
        count = int(np.count_nonzero(hits))
        return count / hits.size if self.exact else (1 + count) / (1 + hits.size)

    def interval(self, alpha: float) -> tuple[float, float]:
        """``{mu : p(mu) >= alpha}``: the interval at level ``1 - alpha`` that inverts the test.

        ``(-inf, inf)`` when no data of this size can reach ``p < alpha`` (or ``alpha == 0``,
        a question the family never lets this row ask); ``(nan, nan)`` without seeds.
        """
        if self.n == 0:
            return math.nan, math.nan
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha={alpha}: expected a significance level in [0, 1)")
        if alpha == 0.0 or self.min_pvalue >= alpha:
            return -math.inf, math.inf
        center = float(self.d.mean())
        if np.all(self.d == self.d[0]):
            return center, center
        low, high = self._edges(alpha)
        # 0 sits on the side p(0) puts it: the interval and the test agree even where 0 lies within
        # the test's rounding tolerance of an edge.
        if self.pvalue(0.0) >= alpha:
            low, high = min(low, 0.0), max(high, 0.0)
        return low, high

    def _edges(self, alpha: float) -> tuple[float, float]:
        """The edges of ``{mu : p(mu) >= alpha}``, read off the sign patterns, not searched for.

        A pattern splits the seeds into those it keeps (P) and those it flips (N); it counts
        against ``mu`` exactly when ``sum_P(d - mu)`` and ``sum_N(d - mu)`` do not have the same
        sign, that is when ``mu`` lies between the means of P and of N (every pattern counts when
        P or N is empty). Each such range holds the overall mean, so going up from the mean a
        pattern stops counting past the larger of its two means: the upper edge is the k-th
        largest of those, where k patterns must count for ``p >= alpha``, and the lower edge is
        the k-th smallest of the smaller means.
        """
        n, sign_sums, total = self.n, self._sign_sums, float(self.d.sum())
        kept = (n + sign_sums) / 2.0  # |P|
        flipped = n - kept  # |N|
        split = (kept > 0) & (flipped > 0)
        kept_sum = (self._flipped_sums + total) / 2.0
        kept_mean = kept_sum[split] / kept[split]
        flipped_mean = (total - kept_sum[split]) / flipped[split]
        always = int(np.count_nonzero(~split))  # patterns that count for every mu
        # p(mu) = count / size (exact) or (1 + count) / (1 + draws): the count p >= alpha needs.
        size = sign_sums.size
        needed = alpha * size if self.exact else alpha * (1 + size) - 1
        k = math.ceil(needed - always - 1e-9)
        if k < 1 or k > kept_mean.size:  # every mu accepted, or none but the mean's own
            return -math.inf, math.inf
        upper = np.maximum(kept_mean, flipped_mean)
        lower = np.minimum(kept_mean, flipped_mean)
        high = float(np.partition(upper, upper.size - k)[upper.size - k])
        low = float(np.partition(lower, k - 1)[k - 1])
        return low, high

    def tost(self, margin: float) -> float:
        """Equivalence p-value for ``|mean| < margin`` (two one-sided sign-flip tests).

        The larger of p("mean > -margin") and p("mean < margin"): equivalence within the margin
        is shown at ``alpha`` when it is below ``alpha``. NaN without seeds or margin.
        """
        if self.n == 0 or not margin > 0:
            return math.nan
        return max(self.pvalue(-margin, "greater"), self.pvalue(margin, "less"))


def t_interval(x: np.ndarray, *, level: float = 0.95) -> tuple[float, float]:
    """Student's t interval of the mean of one arm: ``mean +- t_{n-1} * sd / sqrt(n)``.

    Exact for normal values at any seed count (coverage 0.95 at 6 seeds where a percentile
    bootstrap gives about 0.87); on skewed values it undercovers less than the bootstrap does
    (the figures measured are in docs/statistics.md). ``(nan, nan)`` below two values.
    """
    from ablate.analysis.extras import import_extra

    values = np.asarray(x, dtype=float).ravel()
    if values.size < 2:
        return math.nan, math.nan
    stats = import_extra("scipy.stats", "t intervals")
    half = float(stats.t.ppf(0.5 + level / 2.0, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    center = float(values.mean())
    return center - half, center + half


def rejection_rate(samples: np.ndarray, alpha: float, *, rng: np.random.Generator,
                   exact_max_n: int = EXACT_MAX_N, draws: int = 999) -> float:
    """Share of the rows of ``samples`` (``(num_samples, n)``) whose two-sided sign-flip p < ``alpha``.

    The power of the exact test at that ``alpha`` when the rows are drawn under an alternative,
    its size under the null (:func:`row_pvalues`).
    """
    pvalues = row_pvalues(samples, rng=rng, exact_max_n=exact_max_n, draws=draws)
    return int(np.count_nonzero(pvalues < alpha)) / pvalues.size if pvalues.size else math.nan


def row_pvalues(samples: np.ndarray, *, rng: np.random.Generator, exact_max_n: int = EXACT_MAX_N,
                draws: int = 999) -> np.ndarray:
    """The two-sided sign-flip p-value of each row of ``samples`` (``(num_samples, n)``).

    Vectorised over rows (one pattern matrix for all of them); above ``exact_max_n`` seeds
    ``draws`` random patterns per call (plus the observed one). Empty when there are no rows or
    no seeds.
    """
    samples = np.asarray(samples, dtype=float)
    count, n = samples.shape
    if n == 0 or count == 0:
        return np.empty(0)
    tol = 1e-12 * np.maximum(1.0, np.abs(samples).max(axis=1)) * n
    if n <= exact_max_n:
        return _exact_hits(samples, np.abs(samples.sum(axis=1)) - tol) / 2.0**n
    signs = rng.choice(np.array([-1.0, 1.0]), size=(draws, n))
    hits = np.empty(count, dtype=np.int64)
    chunk = max(1, (1 << 22) // signs.shape[0])
    for first in range(0, count, chunk):
        block = samples[first:first + chunk]
        threshold = np.abs(block.sum(axis=1)) - tol[first:first + chunk]
        hits[first:first + chunk] = (np.abs(block @ signs.T) >= threshold[:, None]).sum(axis=1) + 1
    return hits / (draws + 1)


def _exact_hits(samples: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """Per row of ``samples``, how many of the ``2**n`` sign patterns ``s`` give ``|s . row| >= threshold``.

    Meet in the middle: the sums of the first half's patterns and the sorted sums of the second
    half's, ``2 * 2**(n/2)`` values per row, are paired by binary search, where enumerating
    every pattern costs ``2**n`` (65,536 at 16 seeds). A row with ``threshold <= 0`` counts them all.
    """
    count, n = samples.shape
    half = n // 2
    left = samples[:, :half] @ all_sign_patterns(half).T
    right = np.sort(samples[:, half:] @ all_sign_patterns(n - half).T, axis=1)
    hits = np.full(count, 1 << n, dtype=np.int64)
    pairs = right.shape[1] * left.shape[1]
    # The arrays' own methods: a row is a few microseconds of work, and numpy's function wrappers cost as much.
    for row in np.flatnonzero(threshold > 0).tolist():
        sums, sides, limit = right[row], left[row], threshold[row]
        above = pairs - sums.searchsorted(limit - sides, "left").sum()
        hits[row] = above + sums.searchsorted(-limit - sides, "right").sum()
    return hits
