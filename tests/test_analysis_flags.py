"""Flags judged against none and full of the same sweep, on planted frames where each must fire and must not."""

import warnings

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.flags import flag_policies as flag_table


def flag_policies(*args, **kwargs):
    """The flags indexed by arm, as these tests read them (the table has policy and budget as columns)."""
    return flag_table(*args, **kwargs).set_index(["policy", "budget"])

NONE = {"final_reward": 0.60, "reward_auc": 0.45, "reward_late_gain": 0.02, "expert_drift_final": 0.30,
        "kl_k3_mean": 8e-3, "extreme_token_frac_mean": 4e-3}
FULL = {**NONE, "kl_k3_mean": 0.4e-3, "extreme_token_frac_mean": 0.3e-3}


def flag_frame(rng, arms, *, n_seeds=10, noise=0.02):
    """One row per cell: each outcome = the arm's planted value x (1 + seed offset + noise)."""
    offsets = rng.normal(scale=0.05, size=n_seeds)
    rows = []
    for (policy, budget), values in arms.items():
        for seed in range(n_seeds):
            row = {"policy": policy, "budget": budget, "seed": seed}
            row.update({k: v * (1 + offsets[seed] + rng.normal(scale=noise)) for k, v in values.items()})
            rows.append(row)
    return pd.DataFrame(rows)


def planted_arms(overrides=None):
    arms = {("none", 0.0): NONE, ("full", 1.0): FULL}
    # A healthy arm: full's mismatch reduction, none's learning.
    arms[("mismatch", 0.25)] = {**FULL}
    arms.update(overrides or {})
    return arms


def test_too_restrictive_fires_on_a_planted_drop_and_not_without_one():
    rng = np.random.default_rng(0)
    frame = flag_frame(rng, planted_arms({
        ("full", 1.0): {**FULL, "expert_drift_final": 0.15},  # replay held the experts back
        ("fisher", 0.5): {**FULL, "final_reward": 0.50},  # learns less than none
    }))
    flags = flag_policies(frame)
    assert flags.loc[("full", 1.0), "too_restrictive"]
    assert "expert_drift_final below none's" in flags.loc[("full", 1.0), "reason"]
    assert flags.loc[("fisher", 0.5), "too_restrictive"]
    assert flags.loc[("fisher", 0.5), "final_reward_vs_none"] == pytest.approx(-0.1, abs=0.02)
    assert flags.loc[("fisher", 0.5), "final_reward_vs_none_high"] < 0
    assert not flags.loc[("mismatch", 0.25), "too_restrictive"]
    assert ("none", 0.0) not in flags.index
    # The margin is a setting: a 17% drop does not clear a 25% margin.
    assert not flag_policies(frame, restrictive_margin=0.25).loc[("fisher", 0.5), "too_restrictive"]


def test_too_weak_fires_when_an_arm_is_confidently_as_bad_as_none():
    rng = np.random.default_rng(1)
    frame = flag_frame(rng, planted_arms({
        ("random", 0.05): {**NONE, "kl_k3_mean": 7.8e-3, "extreme_token_frac_mean": 3.9e-3},  # 3% of full's
        ("random", 0.5): {**NONE, "kl_k3_mean": 4.2e-3, "extreme_token_frac_mean": 2.2e-3},  # half of full's
    }))
    flags = flag_policies(frame)
    weak = flags.loc[("random", 0.05)]
    assert weak["too_weak"] and not weak["too_restrictive"]
    assert weak["kl_k3_mean_share"] == pytest.approx(0.03, abs=0.02) and weak["kl_k3_mean_share_high"] < 0.1
    assert "of full's kl_k3_mean reduction (< 10%)" in weak["reason"]
    assert not flags.loc[("random", 0.5), "too_weak"]
    assert not flags.loc[("mismatch", 0.25), "too_weak"]
    assert not flags.loc[("full", 1.0), "too_weak"]  # the reference is never too weak
    # weak_share is a setting: asking for 2% makes the 3% arm acceptable.
    assert not flag_policies(frame, weak_share=0.02).loc[("random", 0.05), "too_weak"]


def test_a_noisy_arm_is_not_called_weak_for_lack_of_evidence():
    rng = np.random.default_rng(2)
    arms = planted_arms({("random", 0.05): {**NONE}})
    noisy = flag_frame(rng, arms, noise=0.6)
    flags = flag_policies(noisy)
    assert not flags.loc[("random", 0.05), "too_weak"]
    assert flags.loc[("random", 0.05), "kl_k3_mean_share_high"] > 0.1


def test_nothing_is_judged_with_too_few_seeds_or_without_none_and_full():
    rng = np.random.default_rng(3)
    arms = planted_arms({("fisher", 0.5): {**NONE, "final_reward": 0.3}})
    few = flag_policies(flag_frame(rng, arms, n_seeds=3))
    assert not few[["too_restrictive", "too_weak"]].any().any()
    assert "not judged: 3 seeds paired with none < 6" in few.loc[("fisher", 0.5), "note"]
    no_full = flag_policies(flag_frame(rng, {k: v for k, v in arms.items() if k[0] != "full"}))
    assert no_full.loc[("fisher", 0.5), "too_restrictive"]
    assert "too weak not judged: needs none and full" in no_full.loc[("fisher", 0.5), "note"]


def test_flags_rarely_fire_in_a_sweep_where_nothing_is_wrong():
    # Five healthy arms beside none and full: 6 arms x 3 restrictive questions and 5 weak ones
    # per sweep. Unadjusted, some flag fired in about half of such sweeps; adjusted per context
    # (Holm), a false flag anywhere in a sweep is at most a (1 - level) event.
    rng = np.random.default_rng(4)
    healthy = {("random", b): {**FULL} for b in (0.1, 0.25, 0.5)} | {("fisher", 0.25): {**FULL}}
    trials, sweeps_with_a_flag = 40, 0
    for i in range(trials):
        flags = flag_policies(flag_frame(rng, planted_arms(healthy), n_seeds=8), reps=300, seed=i)
        sweeps_with_a_flag += bool(flags["too_restrictive"].any() or flags["too_weak"].any())
        assert flags["restrictive_p_adj"].notna().all()
    assert sweeps_with_a_flag / trials <= 0.1


def test_unadjusted_flags_are_a_setting_and_fire_more_often():
    rng = np.random.default_rng(5)
    healthy = {("random", b): {**FULL} for b in (0.1, 0.25, 0.5)}
    fired = {"holm": 0, "none": 0}
    for i in range(30):
        frame = flag_frame(rng, planted_arms(healthy), n_seeds=8)
        for adjust in fired:
            flags = flag_policies(frame, reps=300, seed=i, adjust=adjust)
            fired[adjust] += int(flags["too_restrictive"].sum())
    assert fired["holm"] < fired["none"]
    with pytest.raises(ValueError, match="adjust='sidak'"):
        flag_policies(flag_frame(rng, planted_arms()), adjust="sidak")


def test_an_arm_that_learned_faster_is_not_too_restrictive():
    # It reached none's final reward early, so it gained less at the end: not a restriction.
    rng = np.random.default_rng(6)
    faster = {**FULL, "reward_auc": 0.52, "reward_late_gain": 0.002}
    flags = flag_policies(flag_frame(rng, planted_arms({("fisher", 0.25): faster})))
    assert not flags.loc[("fisher", 0.25), "too_restrictive"]
    assert flags.loc[("fisher", 0.25), "reward_auc_vs_none"] > 0


def test_too_weak_share_has_an_interval_when_most_seeds_give_full_no_reduction():
    # Seeds where full and none agree exactly (a regime with little mismatch) give resamples
    # with no ratio; they are dropped, not turned into a NaN interval (and a warning) that
    # could never flag.
    rng = np.random.default_rng(7)
    frame = flag_frame(rng, planted_arms({("random", 0.05): {**NONE, "kl_k3_mean": 7.9e-3,
                                                              "extreme_token_frac_mean": 3.95e-3}}))
    for outcome in ("kl_k3_mean", "extreme_token_frac_mean"):
        for seed in range(6):
            none_value = frame.loc[(frame["policy"] == "none") & (frame["seed"] == seed), outcome].iloc[0]
            frame.loc[frame["policy"].isin(["full", "random"]) & (frame["seed"] == seed), outcome] = none_value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags = flag_policies(frame)
    share, high = flags.loc[("random", 0.05), ["kl_k3_mean_share", "kl_k3_mean_share_high"]]
    assert np.isfinite(high) and share <= high < 0.5


def test_the_flags_table_has_policy_and_budget_as_columns_as_its_docs_say():
    rng = np.random.default_rng(8)
    frame = flag_frame(rng, planted_arms({("fisher", 0.5): {**FULL, "final_reward": 0.50}}))
    flags = flag_table(frame)
    assert list(flags.columns[:4]) == ["policy", "budget", "too_restrictive", "too_weak"]
    assert isinstance(flags.index, pd.RangeIndex)
    assert flags.loc[flags["policy"] == "fisher", "too_restrictive"].item()
    # What a context could reach: 3 arms x 3 restrictive outcomes, 10 seeds.
    questions, seeds, smallest = flags.attrs["questions"]["too restrictive"]
    assert (questions, seeds, smallest) == (9, 10, 2 / 2**10)


def test_where_no_flag_can_be_reached_the_flags_section_says_so_and_why():
    from ablate.analysis.flags import flags_text

    rng = np.random.default_rng(9)
    healthy = {("random", b): {**FULL} for b in (0.1, 0.25, 0.5)}
    text = " ".join(flags_text(flag_table(flag_frame(rng, planted_arms(healthy), n_seeds=6))))
    # 6 seeds: the smallest p is 2/64; Holm over 5 arms x 3 outcomes makes it 0.47, over 4 weak questions 0.12.
    assert text.startswith("no flag can be reached at these seeds (6 paired with none)")
    assert "a 'too restrictive' question 0.47 (15 questions, each at best p 0.031)" in text
    assert "a 'too weak' question 0.12 (4 questions" in text
    reachable = " ".join(flags_text(flag_table(flag_frame(rng, planted_arms(healthy), n_seeds=10))))
    assert reachable.startswith("no arm flagged as too restrictive or too weak")
