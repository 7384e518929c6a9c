"""Intervals that agree with the tests, primary gates, equivalence, power: the statistics of docs/statistics.md."""

import math

import numpy as np
import pytest

from ablate.analysis.selectors import parse_selector
from ablate.analysis.paired import paired_effect
from ablate.analysis.power import min_detectable_effect, plan, power, seeds_needed
from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.signflip import SignFlip, rejection_rate, t_interval


def sign_flip_interval(d, *, level=0.95):
    return SignFlip(d).interval(1.0 - level)


def tost_pvalue(d, margin):
    return SignFlip(d).tost(margin)
from ablate.analysis.stats import adjust_pvalues, interval_alphas, sign_flip_pvalue
from ablate.analysis.tables import effects, summarize
from tests.test_analysis_tables import planted_frame


def test_sign_flip_pvalue_by_hand_and_against_the_reference():
    d = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert SignFlip(d).pvalue() == 2 / 64  # only the observed pattern and its mirror are as extreme
    assert SignFlip(d).pvalue(alternative="greater") == 1 / 64
    rng = np.random.default_rng(1)
    for n in (3, 6, 9, 12, 16):
        x = rng.normal(0.3, 1.0, size=n)
        assert SignFlip(x).pvalue() == sign_flip_pvalue(x)


@pytest.mark.parametrize("n", [6, 8, 11, 16, 19])
def test_interval_excludes_zero_exactly_when_the_test_rejects(n):
    rng = np.random.default_rng(n)
    for trial in range(40):
        d = rng.normal(rng.choice([0.0, 0.5, 1.0]), 1.0, size=n)
        test = SignFlip(d, rng=np.random.default_rng(trial))
        low, high = test.interval(0.05)
        assert (low > 0 or high < 0) == (test.pvalue() < 0.05)
        # The bounds are the edge of the acceptance region: accepted there, rejected just beyond.
        eps = 1e-6 * (1 + abs(low) + abs(high))
        assert test.pvalue(low) >= 0.05 and test.pvalue(high) >= 0.05
        assert test.pvalue(low - eps) < 0.05 and test.pvalue(high + eps) < 0.05


def test_interval_is_the_whole_line_where_no_data_could_reject():
    assert sign_flip_interval(np.arange(1.0, 6.0), level=0.95) == (-math.inf, math.inf)  # 2/32 > 0.05
    assert sign_flip_interval(np.full(7, 2.0), level=0.95) == (2.0, 2.0)
    low, high = sign_flip_interval(np.arange(1.0, 7.0), level=0.95)
    assert low == pytest.approx(1.0) and high == pytest.approx(6.0)  # 2/64 beyond the data, 4/64 on its edge


@pytest.mark.parametrize("method", ["holm", "bh", "none"])
def test_interval_levels_agree_with_adjusted_pvalues(method):
    rng = np.random.default_rng(2)
    for _ in range(300):
        m = int(rng.integers(1, 12))
        p = rng.choice([1 / 64, 2 / 64, 4 / 64, 0.001, 0.004, 0.01, 0.2, 0.6, 1.0], size=m)
        adjusted = adjust_pvalues(p, method)
        levels = interval_alphas(p, 0.05, method)
        assert np.array_equal(p < levels, adjusted < 0.05)


def test_tost_shows_equivalence_only_within_the_margin():
    d = np.array([0.01, -0.02, 0.015, -0.005, 0.0, 0.02, -0.01, 0.005])
    assert tost_pvalue(d, 0.05) < 0.05  # every difference well inside +-0.05
    assert tost_pvalue(d, 0.005) > 0.3  # the margin is inside the spread of the data: no claim
    shifted = d + 0.2
    assert tost_pvalue(shifted, 0.05) > 0.5  # a real effect is never "equivalent"


def test_t_interval_covers_near_nominal_at_six_seeds():
    rng = np.random.default_rng(3)
    samples = rng.normal(1.0, 2.0, size=(2000, 6))
    covered = np.mean([low < 1.0 < high for low, high in (t_interval(x) for x in samples)])
    assert 0.93 < covered < 0.97


def test_paired_effect_counts_seeds_that_improved():
    a, b = np.array([1.0, 2, 3, 4, 5, 6]), np.array([0.5, 1.9, 3.5, 3, 4, 5])
    numbers = paired_effect(a, b, rng=np.random.default_rng(0))
    assert numbers["share_improved"] == 5 / 6
    assert numbers["p_value"] == SignFlip(a - b).pvalue()
    lower = paired_effect(a, b, rng=np.random.default_rng(0), higher_is_better=False)
    assert lower["share_improved"] == 1 / 6


def test_effect_table_intervals_agree_with_p_and_p_adj():
    df = planted_frame(np.random.default_rng(4), n_seeds=8, selection=0.15, noise=0.12)
    table = effects(df)
    tested = table[table["n_seeds"] >= 6]
    assert len(tested) > 10
    excludes = (tested["ci_low"] > 0) | (tested["ci_high"] < 0)
    assert (excludes == (tested["p_value"] < 0.05)).all()
    excludes_adj = (tested["ci_adj_low"] > 0) | (tested["ci_adj_high"] < 0)
    assert (excludes_adj == (tested["p_adj"] < 0.05)).all()
    assert set(tested["family"]) == {"exploratory per-budget", "exploratory pooled"}
    # The adjusted interval is never narrower than the unadjusted one.
    assert ((tested["ci_adj_low"] <= tested["ci_low"]) & (tested["ci_adj_high"] >= tested["ci_high"])).all()


def test_primary_gates_spend_alpha_in_order():
    df = planted_frame(np.random.default_rng(5), n_seeds=8, selection=0.3)
    table = effects(df, primary=("replay", "selection:fisher:random@pooled", "selection:fisher:random"))
    replay = table[table["effect"] == "replay"].iloc[0]
    assert replay["family"] == "primary 1: replay"
    assert replay["p_adj"] == replay["p_value"] == 2 / 256  # one test, the whole alpha
    pooled = table[(table["family"] == "primary 2: selection:fisher:random@pooled")]
    assert len(pooled) == 1 and pooled["p_adj"].iloc[0] == max(replay["p_value"], pooled["p_value"].iloc[0])
    gate3 = table[table["family"] == "primary 3: selection:fisher:random"]
    assert len(gate3) == 3 and (gate3["p_adj"] < 0.05).all()
    rest = table[~table["family"].str.startswith("primary")]
    assert rest["family"].str.startswith("exploratory").all()

    null = planted_frame(np.random.default_rng(6), n_seeds=8, replay=0.0, noise=1.0)
    closed = effects(null, primary=("replay", "selection:fisher:random@pooled"))
    first = closed[closed["effect"] == "replay"].iloc[0]
    if first["p_adj"] >= 0.05:  # the first gate failed: the second is not tested, its interval says so
        second = closed[closed["family"].str.startswith("primary 2")].iloc[0]
        assert second["p_adj"] >= 0.05 and second["ci_adj_low"] == -math.inf


def test_selector_errors_name_the_bad_text():
    with pytest.raises(ValueError, match="'selektion'.*KIND 'selektion' is not one of"):
        parse_selector("selektion")
    with pytest.raises(ValueError, match="@half is neither a budget nor 'pooled'"):
        parse_selector("selection:fisher:random@half")
    assert parse_selector("budget:random:none@0.25").budget == 0.25


def test_margins_give_an_equivalence_claim():
    df = planted_frame(np.random.default_rng(7), n_seeds=10, selection=0.0, noise=0.01)
    table = effects(df, margins={"final_reward": 0.05})
    selection = table[(table["effect"] == "selection") & ~table["pooled"]]
    assert (selection["claim"] == "within ±0.05").all()
    assert (table.loc[table["effect"] == "replay", "claim"] == "differs").all()


def test_primary_rows_test_their_margins_as_one_family():
    """Gates order the difference tests only: the primary rows' equivalence tests are one Holm family."""
    df = planted_frame(np.random.default_rng(7), n_seeds=10, selection=0.0, noise=0.01)
    primary = ("replay", "selection:fisher:random@pooled", "selection:uniform:random@pooled")
    table = effects(df, primary=primary, margins={"final_reward": 0.05})
    rows = table[table["family"].str.startswith("primary")]
    assert len(rows) == 3
    expected = adjust_pvalues(rows["p_equiv"].to_numpy(dtype=float), "holm")
    assert rows["p_equiv_adj"].to_numpy() == pytest.approx(expected)
    assert (rows["p_equiv_adj"] > rows["p_equiv"]).any()  # three margins do not each get the full alpha
    exploratory = table[table["family"] == "exploratory pooled"]
    assert exploratory["p_equiv_adj"].to_numpy() == pytest.approx(
        adjust_pvalues(exploratory["p_equiv"].to_numpy(dtype=float), "holm"))


def test_settings_are_one_object_with_checked_values():
    settings = AnalysisSettings(level=0.9, adjust="bh")
    df = planted_frame(np.random.default_rng(8), n_seeds=6)
    assert effects(df, settings=settings).equals(effects(df, level=0.9, adjust="bh"))
    with pytest.raises(TypeError, match=r"unknown analysis option\(s\) \['levle'\]"):
        summarize(df, levle=0.9)
    with pytest.raises(ValueError, match="method='bootstrap': expected one of exact, t, percentile, BCa"):
        AnalysisSettings(method="bootstrap")
    assert summarize(df).attrs["interval"] == "t"


def test_power_matches_the_exact_test_table():
    # The table of the exact sign-flip test (raw 0.05): n=6 d=1 0.36, d=2 0.87; n=10 d=1 0.80.
    assert abs(power(1.0, 6, 0.05) - 0.36) < 0.05
    assert abs(power(2.0, 6, 0.05) - 0.87) < 0.05
    assert abs(power(1.0, 10, 0.05) - 0.80) < 0.05
    assert power(3.0, 6, 0.05 / 8) == 0.0  # 2/64 > 0.05/8: no data of 6 seeds can reject
    assert power(0.0, 8, 0.05) <= 0.06  # the size
    assert min_detectable_effect(5, 0.05) == math.inf
    assert min_detectable_effect(12, 0.05) < min_detectable_effect(8, 0.05)
    assert seeds_needed(1.0, 0.05) in (10, 11)


def test_rejection_rate_above_the_exact_limit_is_monte_carlo():
    rng = np.random.default_rng(9)
    assert rejection_rate(rng.normal(size=(400, 20)), 0.05, rng=rng) < 0.09


def test_plan_reports_mde_and_seeds_per_row():
    df = planted_frame(np.random.default_rng(10), n_seeds=6, noise=0.2)
    planned = plan(effects(df), detect=0.3)
    replay = planned[planned["effect"] == "replay"].iloc[0]
    assert replay["alpha_row"] == pytest.approx(0.05 / 13)
    assert replay["mde"] == math.inf  # 6 seeds in a family of 13: nothing is detectable
    assert replay["seeds_for_detect"] >= 9


def test_e_process_by_hand_and_its_error_under_repeated_looks():
    from ablate.analysis.sequential import BETS, confidence_sequence, e_values

    def rejects_at(d, alpha=0.05):
        """The first seed count at which the e-value reaches 1 / alpha, or None."""
        crossed = np.flatnonzero(e_values(d) >= 1.0 / alpha)
        return int(crossed[0]) + 1 if crossed.size else None

    # Six agreeing seeds of equal size: every bet wins its stake each time.
    e = e_values(np.ones(6))
    assert e[-1] == pytest.approx(np.mean((1 + BETS) ** 6))
    assert rejects_at(np.ones(7)) is None and rejects_at(np.ones(8)) == 8  # 20 is first crossed at seed 8
    rng = np.random.default_rng(11)
    crossed = sum(rejects_at(rng.standard_normal(20)) is not None for _ in range(400))
    assert crossed / 400 <= 0.05 + 0.03  # Ville: at most alpha over all 20 looks
    low, high = confidence_sequence(0.5 + rng.standard_normal(20))
    assert np.array_equal(low, np.maximum.accumulate(low)) and np.array_equal(high, np.minimum.accumulate(high))
    assert low[-1] < 0.5 < high[-1] and math.isinf(low[0])


def test_collapse_times_survival_curves_and_the_paired_logrank_test():
    import pandas as pd

    from ablate.outcomes import collapse_onset
    from ablate.analysis.survival import kaplan_meier, paired_logrank_pvalue, time_to_collapse

    reward = np.concatenate([np.linspace(0.0, 1.0, 20), np.full(30, 0.1)])
    onset = collapse_onset(reward, 0.5, 10, 1)
    assert onset == 20  # the first step below half the best, which stays there for 10 steps
    records = pd.DataFrame({"step": np.arange(50) * 2, "train/reward": reward})
    assert time_to_collapse(records, smoothing_window=1) == (40.0, True)
    assert time_to_collapse(records.iloc[:25], smoothing_window=1) == (48.0, False)  # censored

    curve = kaplan_meier(np.array([10, 20, 20, 30]), np.array([True, True, False, False]))
    assert list(curve["survival"]) == [0.75, 0.75 * (1 - 1 / 3), 0.75 * (1 - 1 / 3)]
    rng = np.random.default_rng(0)
    early, never = np.full(8, 10.0), np.full(8, 100.0)
    assert paired_logrank_pvalue(early, np.ones(8, bool), never, np.zeros(8, bool), rng=rng) == 2 / 256
    assert paired_logrank_pvalue(never, np.zeros(8, bool), never, np.zeros(8, bool), rng=rng) == 1.0
