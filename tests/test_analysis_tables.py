"""Summary tables and effects on planted frames: recovery, multiplicity, few seeds, arms, exports."""

import math

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.export import export_table, to_markdown
from ablate.analysis.stats import adjust_pvalues, min_achievable_pvalue
from ablate.analysis.tables import arm_keys, effects, summarize

BUDGETS = (0.1, 0.25, 0.5)
POLICIES = ("random", "uniform", "fisher", "mismatch")


def planted_frame(rng, *, n_seeds=10, budget_slope=2.0, selection=0.3, replay=1.0, noise=0.1, seed_scale=1.0,
                  budgets=BUDGETS, policies=("random", "uniform", "fisher")):
    """One row per cell: Y = seed offset (shared by every policy) + planted mean + noise.

    none = 0, full = ``replay``, every budgeted policy at b = ``budget_slope * b``, and fisher
    ``selection`` above that.
    """
    offsets = rng.normal(scale=seed_scale, size=n_seeds)
    cells = [("none", 0.0, 0.0), ("full", 1.0, replay)]
    for b in budgets:
        cells += [(p, b, budget_slope * b + (selection if p == "fisher" else 0.0)) for p in policies]
    rows = [
        {"policy": p, "budget": b, "seed": s, "final_reward": offsets[s] + mu + rng.normal(scale=noise)}
        for p, b, mu in cells
        for s in range(n_seeds)
    ]
    return pd.DataFrame(rows)


def _rows(table):
    return {(r.effect, r.policy, r.baseline, None if math.isnan(r.budget) else r.budget, r.pooled): r
            for r in table.itertuples()}


def test_summarize_known_numbers():
    df = pd.DataFrame({
        "policy": ["none"] * 3 + ["fisher"] * 6,
        "budget": [0.0] * 3 + [0.5] * 6,
        "seed": [0, 1, 2, 0, 1, 2, 3, 4, 5],
        "final_reward": [1.0, 2.0, 3.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0],
    })
    table = summarize(df, reps=500, seed=0)
    assert list(table.index) == [("none", 0.0), ("fisher", 0.5)]
    none, fisher = table.loc[("none", 0.0)], table.loc[("fisher", 0.5)]
    assert (none["mean"], none["std"], none["n_seeds"]) == (2.0, 1.0, 3)
    assert (fisher["mean"], fisher["iqm"], fisher["n_seeds"]) == (1.5, 1.5, 6)
    assert fisher["std"] == pytest.approx(np.std([1, 2, 2, 1, 1, 2], ddof=1))
    # 3 seeds: no interval, and the note says why; 6 seeds: an interval.
    assert math.isnan(none["ci_low"]) and none["note"] == "3 seeds < 6: no interval, too few for a claim"
    assert fisher["ci_low"] < 1.5 < fisher["ci_high"] and fisher["note"] == ""
    assert summarize(df, reps=500, min_seeds=3).loc[("none", 0.0), "ci_low"] <= 2.0
    pd.testing.assert_frame_equal(table, summarize(df, reps=500, seed=0))


def test_summarize_drops_nan_and_rejects_duplicate_cells():
    df = pd.DataFrame({"policy": ["none"] * 3, "budget": [0.0] * 3, "seed": [0, 1, 2],
                       "final_reward": [1.0, np.nan, 3.0]})
    assert summarize(df, reps=100).loc[("none", 0.0), "n_seeds"] == 2
    with pytest.raises(ValueError, match="rows share an arm and seed"):
        summarize(pd.concat([df, df]), reps=100)


def test_effects_recover_planted_budget_and_selection_effects_after_holm():
    # Ten intervals are checked at once, so use a wide level: each misses its truth 0.1% of the time.
    df = planted_frame(np.random.default_rng(0), n_seeds=30)
    table = effects(df, level=0.999, reps=10_000, seed=0, pooled=False)
    rows = _rows(table)
    replay = rows[("replay", "full", "none", None, False)]
    assert replay.ci_low < 1.0 < replay.ci_high
    for b in BUDGETS:
        budget = rows[("budget", "random", "none", b, False)]
        assert budget.ci_low < 2.0 * b < budget.ci_high
        for baseline in ("random", "uniform"):
            selection = rows[("selection", "fisher", baseline, b, False)]
            assert 0.0 < selection.ci_low < 0.3 < selection.ci_high
            assert selection.p_value < 1e-4 and selection.p_adj < 1e-3  # 30 seeds: Monte Carlo sign-flip test
            assert selection.prob_improvement > 0.5
            assert selection.n_seeds == 30 and selection.note == ""
    assert len(table) == 1 + 3 + 6 + 3  # uniform - random too (others_vs_random, the CLI's families)
    assert table.attrs["families"] == {"exploratory per-budget": 13}
    assert (table["p_adj"] >= table["p_value"]).all()


def test_holm_keeps_the_family_wise_false_positive_rate_at_its_level():
    """Many null comparisons (every policy the same at every budget): after Holm, a sweep makes
    even one false claim at most alpha of the time; without adjustment, most sweeps make one."""
    rng = np.random.default_rng(42)
    sweeps, alpha, n_seeds, family = 250, 0.05, 12, 1 + 3 + 6 + 6 + 3
    # Enough seeds that Holm can reject at all in a family this size (else the test is vacuous).
    assert family * min_achievable_pvalue(n_seeds) < alpha / 5
    any_raw = any_holm = any_bh = 0
    for i in range(sweeps):
        df = planted_frame(rng, n_seeds=n_seeds, budget_slope=0.0, selection=0.0, replay=0.0, policies=POLICIES)
        # min_seeds above the seed count: no bootstrap, only the tests are needed here.
        table = effects(df, seed=i, others_vs_random=True, comparisons=[("mismatch", "fisher")],
                        min_seeds=n_seeds + 1, pooled=False, matched=False)
        assert table.attrs["families"]["exploratory per-budget"] == family
        any_raw += bool((table["p_value"] <= alpha).any())
        any_holm += bool((table["p_adj"] <= alpha).any())
        any_bh += bool((adjust_pvalues(table["p_value"].to_numpy(), "bh") <= alpha).any())
    print(f"any false claim: raw {any_raw / sweeps:.3f}, Holm {any_holm / sweeps:.3f}, BH {any_bh / sweeps:.3f}")
    # Binomial noise of a 5% rate over 250 sweeps has a standard deviation of 1.4%.
    assert any_holm / sweeps <= alpha + 0.03
    assert any_bh / sweeps <= alpha + 0.03  # under the global null the FDR is the FWER
    assert any_raw / sweeps > 0.4


def test_pooled_test_makes_one_claim_across_budgets():
    # A small selection effect that no single budget's test can show after Holm with 8 seeds.
    df = planted_frame(np.random.default_rng(5), n_seeds=8, selection=0.05, noise=0.05,
                       budgets=(0.05, 0.1, 0.25, 0.5, 0.75))
    table = effects(df, reps=2000)
    rows = _rows(table)
    pooled = rows[("selection", "fisher", "random", None, True)]
    assert "pooled over budgets 0.05, 0.1, 0.25, 0.5, 0.75" in pooled.note
    assert pooled.n_seeds == 8
    assert pooled.p_value == 2 / 2**8 and pooled.p_adj <= 0.05  # every seed's mean difference is positive
    assert table.attrs["families"]["exploratory pooled"] == 4  # budget, fisher against random and uniform, uniform - random
    per_budget = table[(table.effect == "selection") & ~table.pooled]
    assert (per_budget["p_adj"] > 0.05).all()


def test_pairing_by_seed_matters():
    df = planted_frame(np.random.default_rng(1), seed_scale=5.0)
    row = effects(df, reps=1000).query("effect == 'selection' and baseline == 'random'").iloc[0]
    assert row.ci_high - row.ci_low < 0.5  # an unpaired interval would be about 5 wide


def test_few_seeds_give_no_interval_and_say_so():
    df = planted_frame(np.random.default_rng(2), n_seeds=5)
    df = df[~((df["policy"] == "fisher") & (df["seed"] == 4))]
    row = effects(df, reps=200).query("effect == 'selection' and baseline == 'random'").iloc[0]
    assert row.n_seeds == 4 and math.isnan(row.ci_low) and math.isnan(row.ci_high)
    assert "4 paired seeds < 6: no interval, too few for a claim" in row.note
    assert "1 unpaired seed value(s) dropped" in row.note
    assert row.p_value >= 2 / 2**4
    two = effects(planted_frame(np.random.default_rng(2), n_seeds=2), reps=200)
    assert two["ci_low"].isna().all() and not two["p_value"].isna().any()


def test_custom_comparisons_and_others_vs_random():
    df = planted_frame(np.random.default_rng(3), n_seeds=6)
    table = effects(df, reps=200, comparisons=[("fisher", "full")], others_vs_random=True, pooled=False)
    assert set(table.loc[table.policy == "uniform", "baseline"]) == {"random"}
    custom = table[(table.policy == "fisher") & (table.baseline == "full")]
    assert list(custom.effect.unique()) == ["budget"] and len(custom) == 3


def test_interval_covers_zero_at_close_to_nominal_rate_without_selection_effect():
    rng = np.random.default_rng(123)
    covered = []
    for i in range(200):
        table = effects(planted_frame(rng, selection=0.0), reps=200, seed=i, pooled=False)
        rows = table[(table.effect == "selection") & (table.baseline == "random")]
        covered += list((rows.ci_low <= 0.0) & (0.0 <= rows.ci_high))
    assert 0.85 <= np.mean(covered) <= 0.99


def _with_noise_key(df, rng):
    """The same grid at two router noise levels (a varied config key), the effect only at 0.07."""
    low = df.assign(**{"backend.router_noise": 0.0})
    high = df.assign(**{"backend.router_noise": 0.07})
    high["final_reward"] += np.where(high["policy"] == "fisher", 0.5, 0.0) + rng.normal(scale=0.01, size=len(high))
    both = pd.concat([low, high], ignore_index=True)
    both.attrs["config_keys"] = ["backend.router_noise"]
    return both


def test_arms_group_by_every_varied_config_key():
    rng = np.random.default_rng(8)
    df = _with_noise_key(planted_frame(rng, n_seeds=6, selection=0.0, noise=0.01), rng)
    assert arm_keys(df) == ["backend.router_noise"]
    table = summarize(df, reps=200)
    assert table.index.names == ["backend.router_noise", "policy", "budget"]
    assert len(table) == 2 * (2 + 3 * 3) and (table["n_seeds"] == 6).all()
    fx = effects(df, reps=200, pooled=False)
    selection = fx[(fx.effect == "selection") & (fx.policy == "fisher") & (fx.baseline == "random")].set_index(["backend.router_noise", "budget"])
    assert (selection.loc[0.0, "mean"].abs() < 0.05).all()
    assert (selection.loc[0.07, "mean"] > 0.45).all()
    assert list(fx.columns[:2]) == ["backend.router_noise", "effect"]
    # Without the key the cells clash, and the error says which key tells them apart.
    with pytest.raises(ValueError, match="they differ in backend.router_noise: group by it"):
        summarize(df, by=[])
    # A key that does not vary after filtering is no longer part of the arm.
    only = df[df["backend.router_noise"] == 0.07]
    assert arm_keys(only) == [] and summarize(only, reps=100).index.names == ["policy", "budget"]
    with pytest.raises(KeyError, match="no column"):
        summarize(df, by=["backend.steps"])


def test_export_table_all_formats(tmp_path):
    df = planted_frame(np.random.default_rng(4), n_seeds=3)
    table = summarize(df, reps=100)
    paths = export_table(table, tmp_path / "table")
    assert [p.suffix for p in paths] == [".csv", ".parquet", ".md", ".tex"]
    assert len(pd.read_csv(paths[0])) == len(table) == 11
    assert list(pd.read_parquet(paths[1]).columns[:2]) == ["policy", "budget"]
    markdown = paths[2].read_text().splitlines()
    assert markdown[0].startswith("| policy | budget | mean") and len(markdown) == 2 + 11
    assert "\\toprule" in paths[3].read_text() and "n\\_seeds" in paths[3].read_text()
    assert "| a\\|b |" in to_markdown(pd.DataFrame({"x": ["a|b"]}))
    assert "| 0 |" in to_markdown(pd.DataFrame({"x": [0.0]}))


def test_each_context_is_its_own_multiplicity_family():
    """Two regimes asked the same question: neither regime's p-values are charged for the other's."""
    rng = np.random.default_rng(3)
    rows = []
    for regime, effect in (("sync", 1.0), ("async", 0.0)):
        for seed in range(8):
            base = rng.normal(0.0, 0.1)
            for policy, budget, value in (("none", 0.0, base), ("full", 1.0, base + effect + rng.normal(0, 0.01))):
                rows.append({"regime": regime, "policy": policy, "budget": budget, "seed": seed, "y": value})
    table = effects(pd.DataFrame(rows), "y", by=["regime"], reps=200)
    replay = table[table["effect"] == "replay"].set_index("regime")
    assert replay.loc["sync", "p_value"] == min_achievable_pvalue(8)
    # One replay test per regime: Holm within the regime leaves it as it is.
    assert replay.loc["sync", "p_adj"] == replay.loc["sync", "p_value"]
    assert set(table.attrs["families"]) == {"exploratory per-budget (regime=sync)",
                                            "exploratory per-budget (regime=async)"}


def test_differences_within_float32_rounding_are_no_effect_and_no_evidence():
    # Two arms that agree up to float32 rounding in every seed, the residues all of one sign:
    # the mean is 0, and the test must not read ten same-signed residues as p = 0.002.
    values = np.linspace(0.4, 0.6, 10)
    residue = values * 2.0**-24
    rows = [{"policy": policy, "budget": budget, "seed": s, "final_reward": v}
            for s, v in enumerate(values)
            for policy, budget in (("none", 0.0), ("full", 1.0), ("random", 0.5))]
    rows += [{"policy": "fisher", "budget": 0.5, "seed": s, "final_reward": v + r}
             for s, (v, r) in enumerate(zip(values, residue))]
    table = effects(pd.DataFrame(rows), "final_reward")
    row = table[(table["policy"] == "fisher") & (table["baseline"] == "random") & (table["effect"] == "selection")].iloc[0]
    assert row["mean"] == 0.0 and row["p_value"] == 1.0 and row["ci_low"] == row["ci_high"] == 0.0
