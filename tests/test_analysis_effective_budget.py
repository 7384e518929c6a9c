"""The effective budget: per-cell outcome, random's curve, and the matched-effective-budget decomposition."""

import math

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.matched import interpolate, matched_pairs, seed_curves
from ablate.outcomes import cell_outcomes
from ablate.analysis.tables import effects, summarize

BUDGETS = (0.05, 0.1, 0.25, 0.5, 0.75)


def test_effective_budget_from_logged_key_else_from_realized_budget_and_override_rate():
    records = pd.DataFrame({
        "step": [0, 1, 2],
        "replay/budget_realized": [0.25, 0.25, 0.25],
        "replay/override_rate": [0.2, 0.4, np.nan],
        "replay/effective_budget": [np.nan, np.nan, 0.3],
    })
    # Steps 0 and 1 derive it (0.05, 0.1), step 2 logged it (0.3).
    assert cell_outcomes(records)["effective_budget_mean"] == pytest.approx(0.15)
    none = pd.DataFrame({"step": [0, 1], "replay/budget_realized": [0.0, 0.0], "replay/override_rate": [np.nan] * 2})
    assert cell_outcomes(none)["effective_budget_mean"] == 0.0
    assert math.isnan(cell_outcomes(pd.DataFrame({"step": [0]}))["effective_budget_mean"])


def test_curve_interpolation_and_its_ends():
    curve = seed_curves([({0: 0.0}, {0: 1.0}), ({0: 0.1}, {0: 2.0}), ({0: 0.1}, {0: 4.0}), ({0: 0.2}, {0: 5.0})])[0]
    np.testing.assert_allclose(curve[0], [0.0, 0.1, 0.2])
    np.testing.assert_allclose(curve[1], [1.0, 3.0, 5.0])  # two points at e = 0.1 averaged
    assert interpolate(curve, 0.05, 0.0) == pytest.approx(2.0)
    assert interpolate(curve, 0.21, 0.1) == 5.0  # within 10% of the span beyond the end: the end's value
    assert math.isnan(interpolate(curve, 0.23, 0.1))
    assert math.isnan(interpolate(curve, 0.21, 0.0))
    seeds, a, b, outside, no_curve = matched_pairs({0: 7.0, 1: 1.0, 2: 1.0}, {0: 0.15, 1: 0.5, 2: 0.1},
                                                   {0: curve, 1: curve}, extrapolate=0.1)
    assert seeds == [0] and a.tolist() == [7.0] and b.tolist() == [4.0] and (outside, no_curve) == (1, 1)


def response(e):
    """How the outcome responds to the share of routes changed: concave, as replay saturates."""
    return 3.0 * e - 6.0 * e**2


def decomposition_frame(rng, *, n_seeds=30, fisher_bonus=0.05, noise=0.01):
    """Planted: Y depends on the effective budget e through ``response`` plus a seed offset.

    - random: e = b x m (m, the seed's mismatch rate, about 12%): the budget-only control;
    - fisher: the same e as random at each b, and ``fisher_bonus`` more outcome (which routes);
    - mismatch: e = min(b, m), far more than random at small b, and no bonus (only how many);
    - none at e = 0 and full at e = m.
    """
    rows = []
    for seed in range(n_seeds):
        m = 0.12 + rng.normal(scale=0.004)
        offset = rng.normal(scale=0.2)

        def cell(policy, budget, e, bonus=0.0):
            rows.append({"policy": policy, "budget": budget, "seed": seed, "effective_budget_mean": e,
                         "final_reward": offset + response(e) + bonus + rng.normal(scale=noise)})

        cell("none", 0.0, 0.0)
        cell("full", 1.0, m)
        for b in BUDGETS:
            cell("random", b, b * m * (1 + rng.normal(scale=0.03)))
            cell("fisher", b, b * m * (1 + rng.normal(scale=0.03)), fisher_bonus)
            cell("mismatch", b, min(b, m) * (1 + rng.normal(scale=0.01)))
    return pd.DataFrame(rows)


def _by(table, effect, policy, pooled=False):
    rows = table[(table.effect == effect) & (table.policy == policy) & (table.pooled == pooled)]
    return rows.set_index("budget") if not pooled else rows.iloc[0]


def test_decomposition_separates_how_many_routes_from_which_routes():
    df = decomposition_frame(np.random.default_rng(0))
    # 16 intervals are read at once: a wide level keeps the test from failing by chance.
    table = effects(df, level=0.999, reps=5000, others_vs_random=True)

    # mismatch: only its effective budget differs. The raw selection effect is large at small
    # budgets, and all of it is explained by random's curve at mismatch's effective budget.
    raw = _by(table, "selection", "mismatch")
    assert (raw.loc[[0.05, 0.1, 0.25], "ci_low"] > 0.0).all() and (raw.loc[[0.05, 0.1], "p_adj"] < 0.01).all()
    matched = _by(table, "matched_selection", "mismatch")
    assert list(matched.index) == list(BUDGETS) and (matched["n_seeds"] == 30).all()
    assert ((matched["ci_low"] < 0.0) & (0.0 < matched["ci_high"])).all()
    assert (matched["p_adj"] > 0.05).all() and _by(table, "matched_selection", "mismatch", pooled=True).p_adj > 0.05

    # fisher: the same effective budget as random, a different selection: the planted 0.05 is
    # found at a matched effective budget, at every budget and pooled over budgets.
    fisher = _by(table, "matched_selection", "fisher")
    assert ((fisher["ci_low"] < 0.05) & (0.05 < fisher["ci_high"])).all()
    assert (fisher["ci_low"] > 0.0).all() and (fisher["p_adj"] < 0.01).all()
    pooled = _by(table, "matched_selection", "fisher", pooled=True)
    assert pooled["mean"] == pytest.approx(0.05, abs=0.01) and pooled.p_adj < 0.01

    # The summary reports each arm's effective budget.
    summary = summarize(df, reps=200)
    assert summary.loc[("none", 0.0), "effective_budget"] == 0.0
    assert summary.loc[("mismatch", 0.05), "effective_budget"] > 5 * summary.loc[("random", 0.05), "effective_budget"]


def test_no_selection_effect_is_reported_when_only_the_effective_budget_differs():
    """Across many planted sweeps with no selection effect at all, matched comparisons make a
    false claim (after Holm) no more often than the level allows, while raw ones almost always do."""
    rng = np.random.default_rng(1)
    sweeps = 100
    false_matched = raw_claims = 0
    for i in range(sweeps):
        table = effects(decomposition_frame(rng, n_seeds=12, fisher_bonus=0.0), seed=i, others_vs_random=True,
                        min_seeds=13, pooled=False)
        matched = table[table.effect == "matched_selection"]
        false_matched += bool((matched["p_adj"] <= 0.05).any())
        raw = table[(table.effect == "selection") & (table.policy == "mismatch")]
        raw_claims += bool((raw["p_adj"] <= 0.05).any())
    print(f"sweeps with a false matched claim: {false_matched / sweeps:.2f}; with a raw claim: {raw_claims / sweeps:.2f}")
    assert false_matched / sweeps <= 0.05 + 0.045  # 2 standard deviations of a 5% rate over 100 sweeps
    assert raw_claims == sweeps


def test_seeds_beyond_random_range_are_dropped_and_said():
    df = decomposition_frame(np.random.default_rng(2), n_seeds=8)
    far = (df.policy == "mismatch") & (df.budget == 0.5)
    df.loc[far, "effective_budget_mean"] = 0.5  # far above full's effective budget of about 0.12
    table = effects(df, reps=200, others_vs_random=True)
    row = table[(table.effect == "matched_selection") & (table.policy == "mismatch") & (table.budget == 0.5)].iloc[0]
    assert row.n_seeds == 0 and math.isnan(row["mean"])
    assert "8 seed(s) outside random's effective-budget range, dropped" in row.note
    no_random = effects(df[df.policy != "random"], reps=200)
    assert not (no_random.effect == "matched_selection").any()
