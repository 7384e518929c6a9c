"""Flag replay policies that are too restrictive or too weak (DESIGN.md section 4).

A cell is **too restrictive** when replay overrides many routes while the policy has stopped
improving: ``override_rate_mean >= restrictive_override`` and
``reward_late_gain <= restrictive_max_gain`` (the reward over the last window of steps is no
better than over the window before it).

A cell is **too weak** when replay leaves the mismatch in place: ``residual_mismatch_mean >=
weak_residual`` and ``extreme_token_frac_mean >= weak_extreme``.

``none`` is never flagged: it replays nothing, and its mismatch is the baseline the others are
judged against. A (policy, budget) is flagged when at least ``min_share`` of its seeds are. A cell whose inputs
are NaN (``none`` has no override rate) is never flagged by that rule. Defaults:
``restrictive_override=0.10`` (one replayed route in ten changed the routing),
``restrictive_max_gain=0.0``, ``weak_residual=0.05`` (half of the ~10% raw route mismatch
reported for Qwen3-30B-A3B left after replay), ``weak_extreme=0.01``, ``min_share=0.5``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ablate.analysis.tables import canonical_order

FLAG_INPUTS: tuple[str, ...] = (
    "override_rate_mean", "reward_late_gain", "residual_mismatch_mean", "extreme_token_frac_mean",
)


def flag_policies(
    df: pd.DataFrame,
    *,
    restrictive_override: float = 0.10,
    restrictive_max_gain: float = 0.0,
    weak_residual: float = 0.05,
    weak_extreme: float = 0.01,
    min_share: float = 0.5,
) -> pd.DataFrame:
    """Per-(policy, budget) flags from a per-cell frame (what ``load_runs`` returns).

    Columns: ``too_restrictive``, ``too_weak`` (bool), ``restrictive_share``, ``weak_share``
    (share of seeds flagged), ``n_seeds``, the median over seeds of each input outcome, and
    ``reason``, a plain-language line naming the thresholds that fired.
    """
    missing = [c for c in ("policy", "budget", "seed", *FLAG_INPUTS) if c not in df.columns]
    if missing:
        raise KeyError(f"flag_policies needs column(s) {missing}; the frame has {list(df.columns)}")
    cells = df.copy()
    cells["_restrictive"] = (cells["override_rate_mean"] >= restrictive_override) & (
        cells["reward_late_gain"] <= restrictive_max_gain
    )
    cells["_weak"] = (
        (cells["residual_mismatch_mean"] >= weak_residual)
        & (cells["extreme_token_frac_mean"] >= weak_extreme)
        & (cells["policy"] != "none")
    )
    rows = []
    for (policy, budget), group in cells.groupby(["policy", "budget"], sort=False):
        restrictive_share = float(group["_restrictive"].mean())
        weak_share = float(group["_weak"].mean())
        row = {
            "policy": policy,
            "budget": float(budget),
            "too_restrictive": restrictive_share >= min_share,
            "too_weak": weak_share >= min_share,
            "restrictive_share": restrictive_share,
            "weak_share": weak_share,
            "n_seeds": len(group),
        }
        row.update({key: float(np.nanmedian(group[key])) if group[key].notna().any() else np.nan
                    for key in FLAG_INPUTS})
        reasons = []
        if row["too_restrictive"]:
            reasons.append(
                f"too restrictive in {restrictive_share:.0%} of seeds: override rate >= "
                f"{restrictive_override:g} while reward_late_gain <= {restrictive_max_gain:g}"
            )
        if row["too_weak"]:
            reasons.append(
                f"too weak in {weak_share:.0%} of seeds: residual mismatch >= {weak_residual:g} "
                f"and extreme-token fraction >= {weak_extreme:g}"
            )
        row["reason"] = "; ".join(reasons)
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    return table.iloc[canonical_order(table)].set_index(["policy", "budget"])
