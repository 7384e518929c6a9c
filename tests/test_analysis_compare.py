"""--compare KEY=A:B: two values of one setting, paired by seed within every arm."""

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.cli import main as analyze
from ablate.analysis.compare import compare_values, parse_comparison


def per_layer_frame(n_seeds=10, seed=0):
    """fisher gains 0.05 from per-layer quotas at every budget, random gains nothing."""
    rng = np.random.default_rng(seed)
    offsets = rng.normal(scale=0.05, size=n_seeds)
    rows = []
    for policy in ("random", "fisher"):
        for budget in (0.1, 0.5):
            for per_layer in (True, False):
                gain = 0.05 if (policy == "fisher" and per_layer) else 0.0
                for s in range(n_seeds):
                    rows.append({"policy": policy, "budget": budget, "seed": s, "policy.per_layer": per_layer,
                                 "final_reward": 0.5 + gain + offsets[s] + rng.normal(scale=0.005)})
    for policy in ("none", "full"):
        for s in range(n_seeds):
            rows.append({"policy": policy, "budget": 0.0 if policy == "none" else 1.0, "seed": s,
                         "policy.per_layer": False, "final_reward": 0.5 + offsets[s]})
    frame = pd.DataFrame(rows)
    frame.attrs["config_keys"] = ["policy.per_layer"]
    return frame


def test_a_setting_that_helps_one_policy_shows_there_and_only_there():
    table = compare_values(per_layer_frame(), "final_reward", "policy.per_layer", "true", "false")
    per_budget = table[~table["pooled"]].set_index(["policy", "budget"])
    assert set(per_budget.index) == {("random", 0.1), ("random", 0.5), ("fisher", 0.1), ("fisher", 0.5)}
    fisher = per_budget.loc[("fisher", 0.5)]
    assert fisher["mean"] == pytest.approx(0.05, abs=0.01) and fisher["ci_low"] > 0 and fisher["p_adj"] < 0.05
    assert fisher["baseline"] == "policy.per_layer=false" and fisher["n_seeds"] == 10
    random = per_budget.loc[("random", 0.5)]
    assert abs(random["mean"]) < 0.005 and random["p_adj"] > 0.05  # no claim where nothing was planted
    pooled = table[table["pooled"]].set_index("policy")
    assert set(pooled.index) == {"random", "fisher"} and "pooled over budgets 0.1, 0.5" in pooled.loc["fisher", "note"]
    # Holm within the per-budget family: never below the raw p-value.
    assert (per_budget["p_adj"] >= per_budget["p_value"]).all()
    assert (table["compare"] == "policy.per_layer: true - false").all()


def test_two_policies_are_compared_at_every_shared_budget():
    table = compare_values(per_layer_frame(), "final_reward", "policy", "fisher", "random", by=["policy.per_layer"])
    assert set(table["policy"]) == {"fisher"} and set(table["baseline"]) == {"random"}
    row = table[(table["policy.per_layer"] == True) & (table["budget"] == 0.1)].iloc[0]  # noqa: E712
    assert row["mean"] == pytest.approx(0.05, abs=0.01)


@pytest.mark.parametrize("text, error, message", [
    ("policy.per_layer=true", ValueError, "expected KEY=A:B"),
    ("policy.per_layer=true:true", ValueError, "expected KEY=A:B with two different values"),
])
def test_a_malformed_comparison_names_what_was_expected(text, error, message):
    with pytest.raises(error, match=message):
        parse_comparison(text)


def test_a_value_or_key_the_sweep_lacks_is_named():
    frame = per_layer_frame(n_seeds=6)
    with pytest.raises(ValueError, match=r"policy.per_layer is never 'maybe' here; its values: False, True"):
        compare_values(frame, "final_reward", "policy.per_layer", "true", "maybe")
    with pytest.raises(KeyError, match="no column 'policy.tau'"):
        compare_values(frame, "final_reward", "policy.tau", "0", "1")
    with pytest.raises(ValueError, match=r"no policy \['uniform'\]"):
        compare_values(frame, "final_reward", "policy", "uniform", "random")


def test_the_cli_rejects_a_malformed_comparison_before_reading_the_store(tmp_path, capsys):
    assert analyze([str(tmp_path / "nowhere"), "--compare", "policy.tau"]) == 1
    assert "--compare 'policy.tau': expected KEY=A:B" in capsys.readouterr().err


def test_a_policy_setting_in_the_arm_names_is_compared_too():
    # As load_runs gives it: per_layer is in the arm's name (random[per_layer=True]), with a
    # column of its own beside it, and is no arm key.
    frame = per_layer_frame()
    frame["policy_name"] = frame["policy"]
    frame["variant"] = np.where(frame["policy.per_layer"], "per_layer=True", "")
    frame["policy"] = [f"{p}[{v}]" if v else p for p, v in zip(frame["policy_name"], frame["variant"])]
    frame.attrs.update(config_keys=[], policy_settings=["policy.per_layer"])
    table = compare_values(frame, "final_reward", "policy.per_layer", "True", "False")
    per_budget = table[~table["pooled"]].set_index(["policy", "budget"])
    assert set(per_budget.index) == {("random", 0.1), ("random", 0.5), ("fisher", 0.1), ("fisher", 0.5)}
    assert per_budget.loc[("fisher", 0.1), "mean"] == pytest.approx(0.05, abs=0.01)
