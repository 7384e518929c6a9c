"""Multiplicity families of an effect table: primary questions first, the rest exploratory.

**Default (no primary questions).** One family per context (a combination of the arm keys
besides policy and budget) and kind: its per-budget rows (replay, budget, selection, matched
selection) and its pooled rows apart. Each is adjusted with ``adjust`` (Holm by default) and
labelled ``exploratory``: with 6 seeds and 17 rows no claim survives, and the table says so.

**Primary questions** (``--primary``, or ``analysis.primary`` in the sweep file) are row
selectors in the order they are asked (:mod:`ablate.analysis.selectors`). The rows
a selector matches (in every context) form gate ``k``; rows matched by an earlier selector stay
in the earlier gate. **Serial gatekeeping** spends the whole ``alpha`` in order: gate 1 is
tested with ``adjust`` (Holm) at ``alpha``; gate ``k + 1`` is tested only if every hypothesis of
gates 1..k was rejected. A row's ``p_adj`` is the larger of its Holm p within its gate and every
``p_adj`` of the earlier gates, so ``p_adj < alpha`` exactly when the procedure rejects it, and
the family-wise error over all primary rows is at most ``alpha`` (the gates are nested
closed tests). Rows no selector matches keep the default families, labelled exploratory.

**Adjusted intervals** (``ci_adj_low``/``ci_adj_high``) invert the row's test at the level
:func:`~ablate.analysis.stats.interval_alphas` gives its family (Holm: the step's level), so an
adjusted interval excludes 0 exactly when ``p_adj < alpha``; a row behind a closed gate gets
``(-inf, inf)``: the procedure asks it nothing.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.paired import paired_interval
from ablate.analysis.selectors import parse_selector
from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.stats import adjust_pvalues, interval_alphas


def default_families(table: pd.DataFrame, keys: Sequence[str]) -> pd.Series:
    """Each row's default family name: kind (per-budget or pooled) and context."""
    context = pd.Series("", index=table.index)
    for i, key in enumerate(keys):
        context += (", " if i else "") + f"{key}=" + table[key].astype(str)
    kind = np.where(table["pooled"].astype(bool), "pooled", "per-budget")
    return pd.Series([f"exploratory {k}" + (f" ({c})" if c else "") for k, c in zip(kind, context)],
                     index=table.index)


def assign_families(table: pd.DataFrame, keys: Sequence[str], settings: AnalysisSettings,
                    tests: dict[Any, Any], rng_of: Any) -> None:
    """Fill ``family``, ``p_adj``, ``ci_adj_low``/``ci_adj_high`` and ``p_equiv_adj`` in place.

    ``tests`` maps a row's index to its :class:`~ablate.analysis.signflip.SignFlip`;
    ``rng_of(index)`` gives the row's generator (bootstrap methods only).
    """
    family = default_families(table, keys)
    unassigned = pd.Series(True, index=table.index)
    gates: list[tuple[str, pd.Series]] = []
    for k, text in enumerate(settings.primary or (), start=1):
        selector = parse_selector(text)
        members = selector.matches(table) & unassigned
        unassigned &= ~members
        family[members] = f"primary {k}: {selector.text}"
        gates.append((family[members].iloc[0] if members.any() else f"primary {k}: {selector.text}", members))
    table["family"] = family
    alpha = settings.alpha
    levels = pd.Series(math.nan, index=table.index)
    previous_max, gate_open = 0.0, True
    for _, members in gates:
        if not members.any():
            continue
        p = table.loc[members, "p_value"].to_numpy(dtype=float)
        adjusted = np.maximum(adjust_pvalues(p, settings.adjust), previous_max)
        table.loc[members, "p_adj"] = adjusted
        levels[members] = interval_alphas(p, alpha, settings.adjust) if gate_open else np.where(np.isfinite(p), 0.0, np.nan)
        finite = adjusted[np.isfinite(adjusted)]
        previous_max = max(previous_max, float(finite.max(initial=0.0)))
        gate_open = gate_open and bool(np.all(finite < alpha))
    for name in dict.fromkeys(family[unassigned]):
        members = unassigned & (family == name)
        p = table.loc[members, "p_value"].to_numpy(dtype=float)
        table.loc[members, "p_adj"] = adjust_pvalues(p, settings.adjust)
        levels[members] = interval_alphas(p, alpha, settings.adjust)
    # Equivalence is not gated: a row that passes its difference gate says nothing of the next
    # row's margin. The primary rows' TOST p-values are therefore adjusted together, as one
    # family over every gate (one singleton gate each would test three primary margins at the
    # full alpha each); an exploratory family adjusts its own, as it does its difference tests.
    equivalence_family = family.where(unassigned, "primary")
    for name in dict.fromkeys(equivalence_family):
        members = equivalence_family == name
        table.loc[members, "p_equiv_adj"] = adjust_pvalues(table.loc[members, "p_equiv"].to_numpy(dtype=float),
                                                            settings.adjust)
    low, high = [], []
    for index in table.index:
        level_alpha, test = levels[index], tests.get(index)
        if test is None or not np.isfinite(level_alpha) or test.n < settings.needed:
            low.append(math.nan), high.append(math.nan)
            continue
        lo, hi = paired_interval(test, float(level_alpha), method=settings.method, reps=settings.reps,
                                 rng=rng_of(index))
        low.append(lo), high.append(hi)
    table["ci_adj_low"], table["ci_adj_high"] = low, high
    table["claim"] = [_claim(row, alpha) for _, row in table.iterrows()]


def _claim(row: pd.Series, alpha: float) -> str:
    """What the row supports after its family's adjustment, in words."""
    if not np.isfinite(row["p_adj"]):
        return ""
    if row["p_adj"] < alpha:
        return "differs"
    if np.isfinite(row["p_equiv_adj"]) and row["p_equiv_adj"] < alpha:
        return f"within ±{row['margin']:g}"
    return "inconclusive"


def families_legend(table: pd.DataFrame) -> dict[str, int]:
    """``{family: number of tested rows}`` in table order."""
    return {name: int(table.loc[table["family"] == name, "p_value"].notna().sum())
            for name in dict.fromkeys(table["family"])}
