"""Per-cell outcomes from hand-made records frames."""

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from ablate.outcomes import OUTCOME_NAMES, cell_outcomes


def _records(reward, **columns):
    return pd.DataFrame({"step": np.arange(len(reward)), "train/reward": reward, **columns})


def test_final_reward_auc_and_late_gain_on_a_line():
    out = cell_outcomes(_records(np.arange(10.0)))
    assert set(out) == set(OUTCOME_NAMES)
    assert out["final_reward"] == 8.5  # last ceil(0.2 * 10) = 2 steps: (8 + 9) / 2
    assert out["reward_auc"] == 4.5  # trapezoid of a line over [0, 9], divided by 9
    assert out["reward_late_gain"] == 2.0  # 8.5 - (6 + 7) / 2


def test_auc_uses_step_spacing_and_sorts_steps():
    records = pd.DataFrame({"step": [3, 0, 1], "train/reward": [2.0, 0.0, 2.0]})
    # (0 + 2) / 2 * 1 + (2 + 2) / 2 * 2 = 5 over a span of 3 steps.
    assert cell_outcomes(records)["reward_auc"] == pytest.approx(5 / 3)


def test_mismatch_outcomes_are_nan_safe_and_missing_columns_give_nan():
    records = _records(
        [1.0, 1.0, 1.0],
        **{"mismatch/kl_k3": [0.1, np.nan, 0.3], "drift/experts": [0.0, 0.2, np.nan]},
    )
    out = cell_outcomes(records)
    assert out["kl_k3_mean"] == pytest.approx(0.2)
    assert out["kl_k3_worst"] == pytest.approx(0.3)
    assert out["expert_drift_final"] == pytest.approx(0.2)
    assert math.isnan(out["override_rate_mean"])
    assert math.isnan(out["residual_mismatch_mean"])
    assert all(math.isnan(v) for v in cell_outcomes(pd.DataFrame({"step": [0, 1]})).values())


def _rise_then(level, steps_after, recover=False):
    tail = [level] * steps_after + ([1.0] * 5 if recover else [])
    return np.array([0.0, 0.5, 1.0] + tail)


def test_collapse_rule_both_ways():
    settings = dict(collapse_fraction=0.5, collapse_patience=10, smoothing_window=1)
    assert cell_outcomes(_records(_rise_then(0.2, 12)), **settings)["collapsed"] == 1.0
    assert cell_outcomes(_records(_rise_then(0.6, 12)), **settings)["collapsed"] == 0.0
    assert cell_outcomes(_records(_rise_then(0.2, 9, recover=True)), **settings)["collapsed"] == 0.0
    assert cell_outcomes(_records(np.zeros(20)), **settings)["collapsed"] == 0.0


def test_collapse_with_negative_rewards_is_relative_to_the_gain():
    settings = dict(collapse_fraction=0.5, collapse_patience=3, smoothing_window=1)
    # start -1, best -0.2: scale = max(0.8, 0.2) = 0.8, threshold = -0.2 - 0.4 = -0.6.
    held = np.array([-1.0, -0.6, -0.2, -0.5, -0.5, -0.5, -0.5])
    fell = np.array([-1.0, -0.6, -0.2, -0.8, -0.8, -0.8, -0.8])
    assert cell_outcomes(_records(held), **settings)["collapsed"] == 0.0
    assert cell_outcomes(_records(fell), **settings)["collapsed"] == 1.0


def test_collapse_is_relative_to_chance_when_the_records_carry_it():
    settings = dict(collapse_fraction=0.5, collapse_patience=3, smoothing_window=1)
    # Chance 0.2, best 0.3: the threshold is 0.2 + 0.5 * 0.1 = 0.25. Without a chance level it
    # is half the best, 0.15, and falling back to chance would not count.
    back_to_chance = np.array([0.2, 0.25, 0.3, 0.2, 0.2, 0.2, 0.2])
    held = np.array([0.2, 0.25, 0.3, 0.27, 0.27, 0.27, 0.27])
    assert cell_outcomes(_records(back_to_chance), **settings)["collapsed"] == 0.0
    chance = {"train/reward_chance": np.full(7, 0.2)}
    assert cell_outcomes(_records(back_to_chance, **chance), **settings)["collapsed"] == 1.0
    assert cell_outcomes(_records(held, **chance), **settings)["collapsed"] == 0.0
    assert cell_outcomes(_records(back_to_chance), chance_reward=0.2, **settings)["collapsed"] == 1.0
    never_beat_chance = {"train/reward_chance": np.full(7, 0.5)}
    assert cell_outcomes(_records(back_to_chance, **never_beat_chance), **settings)["collapsed"] == 0.0


def test_the_drop_a_task_shift_causes_is_not_a_collapse():
    settings = dict(collapse_fraction=0.5, collapse_patience=3, smoothing_window=1)
    before, relearned, fell = [0.1, 0.5, 0.8, 0.8], [0.0, 0.0, 0.0, 0.3, 0.6, 0.6], [0.0, 0.3, 0.6, 0.1, 0.1, 0.1]
    shifted = {"train/task_shifted": np.r_[np.zeros(4), np.ones(6)], "train/reward_chance": np.full(10, 0.1)}
    assert cell_outcomes(_records(np.r_[before, relearned], **shifted), **settings)["collapsed"] == 0.0
    assert cell_outcomes(_records(np.r_[before, fell], **shifted), **settings)["collapsed"] == 1.0
    unshifted = {**shifted, "train/task_shifted": np.zeros(10)}
    assert cell_outcomes(_records(np.r_[before, relearned], **unshifted), **settings)["collapsed"] == 1.0


def test_smoothing_ignores_a_single_bad_step():
    reward = np.r_[np.ones(10), [0.0], np.ones(10)]
    assert cell_outcomes(_records(reward), collapse_patience=1, smoothing_window=5)["collapsed"] == 0.0
    assert cell_outcomes(_records(reward), collapse_patience=1, smoothing_window=1)["collapsed"] == 1.0


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="final_fraction=0"):
        cell_outcomes(_records([1.0]), final_fraction=0)


def test_core_modules_import_without_plotting_or_scipy():
    # The cell runner imports cell_outcomes in every cell: it must stay numpy/pandas only.
    code = (
        "import sys, ablate.analysis, ablate.outcomes, ablate.analysis.stats, "
        "ablate.analysis.tables, ablate.analysis.load, ablate.analysis.flags, ablate.analysis.export, "
        "ablate.analysis.cli\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'scipy', 'wandb'})\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
