"""Statistics over seeds: hand-checkable arrays, scipy cross-checks, reproducibility."""

import itertools

import numpy as np
import pytest
import scipy.stats

from ablate.analysis.stats import (
    adjust_pvalues,
    bootstrap_ci,
    iqm,
    min_achievable_pvalue,
    min_seeds_for_interval,
    min_seeds_for_sign_flip,
    probability_of_improvement,
    ratio_of_means_ci,
    sign_flip_pvalue,
)


def paired_bootstrap_ci(a, b, *, rng):
    """The percentile bootstrap interval of an effect row (ablate.analysis.paired)."""
    from ablate.analysis.paired import paired_effect

    numbers = paired_effect(a, b, rng=rng, method="percentile", min_seeds=2)
    return numbers["ci_low"], numbers["ci_high"]


def test_iqm_hand_checkable():
    # Flattened and sorted: [1, 1, 1, 1, 2, 2, 2, 2]; drop 2 from each end -> [1, 1, 2, 2] -> 1.5.
    assert iqm(np.array([[1, 2], [2, 2], [1, 1], [2, 1]])) == 1.5
    x = np.random.default_rng(0).normal(size=(7, 13))
    np.testing.assert_allclose(iqm(x, axis=1), [np.sort(row)[3:10].mean() for row in x])


def test_bootstrap_ci_contains_mean_and_is_reproducible():
    x = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    low, high = bootstrap_ci(x, rng=np.random.default_rng(1))
    assert low < x.mean() < high
    assert bootstrap_ci(x, rng=np.random.default_rng(1)) == (low, high)
    assert bootstrap_ci(x, rng=np.random.default_rng(2)) != (low, high)
    assert bootstrap_ci(x, iqm, rng=np.random.default_rng(1))[0] >= x.min()


def test_bca_differs_from_percentile_on_skewed_values_and_both_cover_the_mean():
    x = np.random.default_rng(3).lognormal(size=12)
    percentile = bootstrap_ci(x, reps=4000, rng=np.random.default_rng(4))
    bca = bootstrap_ci(x, reps=4000, rng=np.random.default_rng(4), method="BCa")
    assert percentile != bca
    assert bca[1] > percentile[1]  # BCa shifts the interval towards the long right tail
    for low, high in (percentile, bca):
        assert low < x.mean() < high
    with pytest.raises(ValueError, match="method='studentized'"):
        bootstrap_ci(x, rng=np.random.default_rng(0), method="studentized")


def test_constant_values_give_a_point_interval_and_float32_residues_print_as_zero():
    assert bootstrap_ci([0.5] * 6, rng=np.random.default_rng(0), method="BCa") == (0.5, 0.5)
    # Rewards logged from float32 tensors: two arms equal in exact arithmetic differ by 2**-27.
    a = np.full(6, np.float32(0.7), dtype=float)
    b = a - 2.0**-27
    low, high = paired_bootstrap_ci(a, b, rng=np.random.default_rng(0))
    assert (low, high) == (0.0, 0.0)
    assert str(low) == "0.0"
    # A real difference of the same arms is kept.
    assert paired_bootstrap_ci(a, a - 0.01, rng=np.random.default_rng(0))[0] == pytest.approx(0.01)


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


def test_ratio_of_means_interval():
    rng = np.random.default_rng(9)
    full = 1.0 + rng.normal(scale=0.05, size=20)
    arm = 0.3 * full + rng.normal(scale=0.02, size=20)
    ratio, low, high = ratio_of_means_ci(arm, full, rng=np.random.default_rng(0))
    assert ratio == pytest.approx(arm.mean() / full.mean())
    assert low < 0.3 < high and high - low < 0.05


def _brute_force_pvalue(d):
    d = np.asarray(d, dtype=float)
    observed = abs(d.mean())
    flips = [abs(np.mean(np.array(signs) * d)) >= observed - 1e-12
             for signs in itertools.product([-1, 1], repeat=d.size)]
    return sum(flips) / len(flips)


@pytest.mark.parametrize("d", [[0.3, -0.1, 0.5, 0.2, 0.4, -0.2, 0.1], [1.0, 2.0, -3.0], [0.5, 0.0, 0.5, 0.5]])
def test_exact_sign_flip_matches_brute_force_and_scipy(d):
    assert sign_flip_pvalue(d) == pytest.approx(_brute_force_pvalue(d))
    exact = scipy.stats.permutation_test((np.array(d),), np.mean, permutation_type="samples",
                                         vectorized=True, n_resamples=2 ** len(d))
    assert sign_flip_pvalue(d) == pytest.approx(exact.pvalue)


def test_sign_flip_minimum_and_seed_counts():
    # All five signs agree: only the observed vector and its mirror are as extreme -> 2/32.
    assert sign_flip_pvalue([1, 2, 3, 4, 5]) == 2 / 32 > 0.05
    assert sign_flip_pvalue([1, 2, 3, 4, 5, 6]) == 2 / 64 < 0.05
    assert min_achievable_pvalue(5) == 0.0625
    assert min_seeds_for_sign_flip(0.05) == 6
    assert min_seeds_for_sign_flip(0.01) == 8
    assert min_seeds_for_interval(0.95) == 6 and min_seeds_for_interval(0.9) == 5


def test_monte_carlo_sign_flip_close_to_exact():
    d = np.random.default_rng(7).normal(0.3, 1.0, size=12)
    exact = sign_flip_pvalue(d)
    approx = sign_flip_pvalue(d, exact_max_n=5, reps=40_000, rng=np.random.default_rng(8))
    assert approx == pytest.approx(exact, abs=0.01)
    with pytest.raises(TypeError, match="Monte Carlo"):
        sign_flip_pvalue(d, exact_max_n=5)


def test_holm_by_hand_and_against_its_definition():
    # Sorted 0.01, 0.02, 0.03, 0.5 with m = 4: 4*0.01, 3*0.02, 2*0.03, 1*0.5 -> 0.04, 0.06, 0.06, 0.5.
    p = np.array([0.03, 0.01, 0.5, 0.02, np.nan])
    np.testing.assert_allclose(adjust_pvalues(p), [0.06, 0.04, 0.5, 0.06, np.nan])
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.uniform(size=rng.integers(1, 30)) ** 3
        order = np.argsort(p)
        m = p.size
        expected = np.empty(m)
        expected[order] = np.minimum(1.0, np.maximum.accumulate([(m - i) * p[j] for i, j in enumerate(order)]))
        np.testing.assert_allclose(adjust_pvalues(p), expected)
        assert np.all(adjust_pvalues(p) >= p)


def test_benjamini_hochberg_and_no_adjustment():
    p = np.array([0.01, 0.04, 0.03, 0.005])
    # Sorted 0.005, 0.01, 0.03, 0.04: 4/1*0.005, 4/2*0.01, 4/3*0.03, 4/4*0.04 -> 0.02, 0.02, 0.04, 0.04.
    np.testing.assert_allclose(adjust_pvalues(p, "bh"), [0.02, 0.04, 0.04, 0.02])
    np.testing.assert_allclose(adjust_pvalues(p, "none"), p)
    with pytest.raises(ValueError, match="adjust='bonferoni'"):
        adjust_pvalues(p, "bonferoni")


def test_probability_of_improvement_by_hand():
    # Pairs (a, b): 3 > 1, 3 > 2, 2 > 1, 2 = 2 (half) -> 3.5 / 4.
    assert probability_of_improvement([3, 2], [1, 2]) == 0.875
    assert probability_of_improvement([3, 2], [1, 2], higher_is_better=False) == 0.125
    assert probability_of_improvement([1, 1], [1, 1]) == 0.5
    assert np.isnan(probability_of_improvement([], [1.0]))
