"""Statistics over seeds: hand-checkable arrays, scipy cross-checks, reproducibility."""

import itertools

import numpy as np
import pytest
import scipy.stats

from ablate.analysis.stats import (
    bootstrap_ci,
    iqm,
    min_achievable_pvalue,
    min_seeds_for_sign_flip,
    paired_bootstrap_ci,
    sign_flip_pvalue,
)


def test_iqm_hand_checkable():
    # Flattened and sorted: [1, 1, 1, 1, 2, 2, 2, 2]; drop 2 from each end -> [1, 1, 2, 2] -> 1.5.
    assert iqm(np.array([[1, 2], [2, 2], [1, 1], [2, 1]])) == 1.5


def test_iqm_matches_scipy_trim_mean_and_axis():
    x = np.random.default_rng(0).normal(size=(7, 13))
    assert iqm(x) == pytest.approx(scipy.stats.trim_mean(x.ravel(), 0.25))
    np.testing.assert_allclose(iqm(x, axis=1), scipy.stats.trim_mean(x, 0.25, axis=1))


def test_bootstrap_ci_contains_mean_and_is_reproducible():
    x = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    low, high = bootstrap_ci(x, rng=np.random.default_rng(1))
    assert low < x.mean() < high
    assert bootstrap_ci(x, rng=np.random.default_rng(1)) == (low, high)
    assert bootstrap_ci(x, rng=np.random.default_rng(2)) != (low, high)
    assert bootstrap_ci(x, iqm, rng=np.random.default_rng(1))[0] >= x.min()


def test_bootstrap_ci_matches_scipy_percentile():
    x = np.random.default_rng(3).gamma(2.0, size=15)
    ours = bootstrap_ci(x, level=0.9, reps=40_000, rng=np.random.default_rng(4))
    theirs = scipy.stats.bootstrap(
        (x,), np.mean, confidence_level=0.9, n_resamples=40_000, method="percentile",
        rng=np.random.default_rng(5),
    ).confidence_interval
    standard_error = x.std(ddof=1) / np.sqrt(x.size)
    assert ours[0] == pytest.approx(theirs.low, abs=0.05 * standard_error)
    assert ours[1] == pytest.approx(theirs.high, abs=0.05 * standard_error)


def test_paired_interval_removes_shared_seed_offsets():
    rng = np.random.default_rng(6)
    offsets = rng.normal(scale=5.0, size=10)
    a = offsets + 1.0 + rng.normal(scale=0.1, size=10)
    b = offsets + rng.normal(scale=0.1, size=10)
    low, high = paired_bootstrap_ci(a, b, rng=np.random.default_rng(0))
    assert 0.8 < low < 1.0 < high < 1.2
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap_ci(a, b[:-1], rng=np.random.default_rng(0))


def test_bootstrap_rejects_nan_and_global_state():
    with pytest.raises(ValueError, match="non-finite"):
        bootstrap_ci([1.0, np.nan, 2.0], rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match="Generator"):
        bootstrap_ci([1.0, 2.0], rng=0)
    assert all(np.isnan(bootstrap_ci([1.0], rng=np.random.default_rng(0))))


def _brute_force_pvalue(d):
    d = np.asarray(d, dtype=float)
    observed = abs(d.mean())
    flips = [abs(np.mean(np.array(signs) * d)) >= observed - 1e-12
             for signs in itertools.product([-1, 1], repeat=d.size)]
    return sum(flips) / len(flips)


@pytest.mark.parametrize("d", [[0.3, -0.1, 0.5, 0.2, 0.4, -0.2, 0.1], [1.0, 2.0, -3.0], [0.5, 0.0, 0.5, 0.5]])
def test_exact_sign_flip_matches_brute_force(d):
    assert sign_flip_pvalue(d) == pytest.approx(_brute_force_pvalue(d))


def test_sign_flip_minimum_and_seed_counts():
    # All five signs agree: only the observed vector and its mirror are as extreme -> 2/32.
    assert sign_flip_pvalue([1, 2, 3, 4, 5]) == 2 / 32 > 0.05
    assert sign_flip_pvalue([1, 2, 3, 4, 5, 6]) == 2 / 64 < 0.05
    assert min_achievable_pvalue(5) == 0.0625
    assert min_seeds_for_sign_flip(0.05) == 6
    assert min_seeds_for_sign_flip(0.01) == 8


def test_monte_carlo_sign_flip_close_to_exact():
    d = np.random.default_rng(7).normal(0.3, 1.0, size=12)
    exact = sign_flip_pvalue(d)
    approx = sign_flip_pvalue(d, exact_max_n=5, reps=40_000, rng=np.random.default_rng(8))
    assert approx == pytest.approx(exact, abs=0.01)
    with pytest.raises(TypeError, match="Monte Carlo"):
        sign_flip_pvalue(d, exact_max_n=5)
