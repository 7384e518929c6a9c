"""Summary tables, planted effects, interval coverage, flags and exports."""

import math

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.export import export_table, to_markdown
from ablate.analysis.flags import flag_policies
from ablate.analysis.tables import effects, summarize

BUDGETS = (0.1, 0.25, 0.5)


def planted_frame(rng, *, n_seeds=10, budget_slope=2.0, selection=0.3, replay=1.0, noise=0.1, seed_scale=1.0):
    """One row per cell: Y = seed offset (shared by every policy) + planted mean + noise.

    none = 0, full = ``replay``, random(b) = uniform(b) = ``budget_slope * b``,
    fisher(b) = random(b) + ``selection``.
    """
    offsets = rng.normal(scale=seed_scale, size=n_seeds)
    cells = [("none", 0.0, 0.0), ("full", 1.0, replay)]
    for b in BUDGETS:
        cells += [("random", b, budget_slope * b), ("uniform", b, budget_slope * b),
                  ("fisher", b, budget_slope * b + selection)]
    rows = [
        {"policy": p, "budget": b, "seed": s, "final_reward": offsets[s] + mu + rng.normal(scale=noise)}
        for p, b, mu in cells
        for s in range(n_seeds)
    ]
    return pd.DataFrame(rows)


def test_summarize_known_numbers():
    df = pd.DataFrame({
        "policy": ["none"] * 3 + ["fisher"] * 4,
        "budget": [0.0] * 3 + [0.5] * 4,
        "seed": [0, 1, 2, 0, 1, 2, 3],
        "final_reward": [1.0, 2.0, 3.0, 1.0, 2.0, 2.0, 1.0],
    })
    table = summarize(df, reps=500, seed=0)
    assert list(table.index) == [("none", 0.0), ("fisher", 0.5)]
    none, fisher = table.loc[("none", 0.0)], table.loc[("fisher", 0.5)]
    assert (none["mean"], none["std"], none["n_seeds"]) == (2.0, 1.0, 3)
    assert (fisher["mean"], fisher["iqm"], fisher["n_seeds"]) == (1.5, 1.5, 4)
    assert fisher["std"] == pytest.approx(np.std([1, 2, 2, 1], ddof=1))
    assert none["ci_low"] <= 2.0 <= none["ci_high"]
    pd.testing.assert_frame_equal(table, summarize(df, reps=500, seed=0))


def test_summarize_drops_nan_and_rejects_duplicate_cells():
    df = pd.DataFrame({"policy": ["none"] * 3, "budget": [0.0] * 3, "seed": [0, 1, 2],
                       "final_reward": [1.0, np.nan, 3.0]})
    assert summarize(df, reps=100).loc[("none", 0.0), "n_seeds"] == 2
    with pytest.raises(ValueError, match="share \\(policy, budget, seed\\)"):
        summarize(pd.concat([df, df]), reps=100)


def test_effects_recover_planted_budget_and_selection_effects():
    # Ten intervals are checked at once, so use a wide level: each misses its truth 0.1% of the time.
    df = planted_frame(np.random.default_rng(0), n_seeds=30)
    table = effects(df, level=0.999, reps=10_000, seed=0)
    rows = {(r.effect, r.policy, r.baseline, None if math.isnan(r.budget) else r.budget): r
            for r in table.itertuples()}
    assert rows[("replay", "full", "none", None)].ci_low < 1.0 < rows[("replay", "full", "none", None)].ci_high
    for b in BUDGETS:
        budget = rows[("budget", "random", "none", b)]
        assert budget.ci_low < 2.0 * b < budget.ci_high
        for baseline in ("random", "uniform"):
            selection = rows[("selection", "fisher", baseline, b)]
            assert selection.ci_low < 0.3 < selection.ci_high
            assert selection.ci_low > 0.0
            assert selection.p_value < 1e-4  # 30 seeds: Monte Carlo sign-flip test
            assert selection.n_seeds == 30 and selection.note == ""
    assert len(table) == 1 + 3 + 6


def test_pairing_by_seed_matters():
    df = planted_frame(np.random.default_rng(1), seed_scale=5.0)
    row = effects(df, reps=1000).query("effect == 'selection' and baseline == 'random'").iloc[0]
    assert row.ci_high - row.ci_low < 0.5  # an unpaired interval would be about 5 wide


def test_unpaired_seeds_are_dropped_and_few_seeds_are_explained():
    df = planted_frame(np.random.default_rng(2), n_seeds=5)
    df = df[~((df["policy"] == "fisher") & (df["seed"] == 4))]
    row = effects(df, reps=200).query("effect == 'selection' and baseline == 'random'").iloc[0]
    assert row.n_seeds == 4
    assert "only 4 paired seeds: an exact sign-flip test cannot reach p<0.05 (needs >= 6)" in row.note
    assert "1 unpaired seed value(s) dropped" in row.note
    assert row.p_value >= 2 / 2**4


def test_custom_comparisons_and_others_vs_random():
    df = planted_frame(np.random.default_rng(3), n_seeds=6)
    table = effects(df, reps=200, comparisons=[("fisher", "full")], others_vs_random=True)
    assert set(table.loc[table.policy == "uniform", "baseline"]) == {"random"}
    custom = table[(table.policy == "fisher") & (table.baseline == "full")]
    assert list(custom.effect.unique()) == ["budget"] and len(custom) == 3


def test_interval_covers_zero_at_close_to_nominal_rate_without_selection_effect():
    rng = np.random.default_rng(123)
    covered = []
    for i in range(200):
        table = effects(planted_frame(rng, selection=0.0), reps=200, seed=i)
        rows = table[(table.effect == "selection") & (table.baseline == "random")]
        covered += list((rows.ci_low <= 0.0) & (0.0 <= rows.ci_high))
    assert 0.85 <= np.mean(covered) <= 0.99


def test_flags_fire_on_their_thresholds():
    base = {"reward_late_gain": 0.1, "override_rate_mean": 0.02,
            "residual_mismatch_mean": 0.01, "extreme_token_frac_mean": 0.001}
    rows = []
    for seed in range(4):
        rows.append({"policy": "fisher", "budget": 0.5, "seed": seed, **base,
                     "override_rate_mean": 0.4, "reward_late_gain": -0.01})
        rows.append({"policy": "random", "budget": 0.1, "seed": seed, **base,
                     "residual_mismatch_mean": 0.09, "extreme_token_frac_mean": 0.05 if seed < 3 else 0.0})
        rows.append({"policy": "none", "budget": 0.0, "seed": seed, **base, "override_rate_mean": np.nan})
    flags = flag_policies(pd.DataFrame(rows))
    assert flags.loc[("fisher", 0.5), "too_restrictive"] and not flags.loc[("fisher", 0.5), "too_weak"]
    assert flags.loc[("random", 0.1), "too_weak"] and flags.loc[("random", 0.1), "weak_share"] == 0.75
    assert not flags.loc[("none", 0.0), ["too_restrictive", "too_weak"]].any()
    assert "override rate >= 0.1" in flags.loc[("fisher", 0.5), "reason"]
    assert not flag_policies(pd.DataFrame(rows), restrictive_override=0.5).loc[("fisher", 0.5), "too_restrictive"]


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
