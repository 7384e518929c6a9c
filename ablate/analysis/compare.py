"""Paired comparisons of two values of one config key: ``--compare policy.per_layer=true:false``.

The effects table compares policies (against ``none``, ``full`` and ``random``). Many sweeps ask a
different question: does a *setting* matter (per-layer quotas against a global top-n, one Fisher
estimator against another, a temperature)? Such a key is an arm key, so the effects table treats
each of its values as a context of its own and never compares them. :func:`compare_values` does:
for every arm (the policy, the budget and the other arm keys), ``Y(key=a) - Y(key=b)`` paired by
seed, with the same interval, sign-flip test and probability of improvement as an effect row.

Rows at several budgets of one policy also get a pooled row (per seed, the mean difference over
the budgets). The per-budget rows of a comparison form one multiplicity family and the pooled
rows another, adjusted with ``adjust`` (Holm by default). Comparing two policies
(``policy=mismatch:fisher``) is what :func:`ablate.analysis.tables.effects` does with
``comparisons``, and is delegated to it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.outcomes import HIGHER_IS_BETTER
from ablate.analysis.stats import Adjustment, CiMethod, adjust_pvalues
from ablate.analysis.tables import (
    EFFECT_COLUMNS,
    _pooled_rows,
    _row,
    _RowSettings,
    arm_keys,
    arm_values,
    canonical_order,
    check_frame,
    contexts,
    effects,
    resolve_min_seeds,
)
from ablate.arms import arm_name


def parse_comparison(text: str) -> tuple[str, str, str]:
    """``"policy.per_layer=true:false"`` -> ``("policy.per_layer", "true", "false")``."""
    key, _, values = text.partition("=")
    a, _, b = values.partition(":")
    if not key or not a or not b or a == b:
        raise ValueError(f"--compare {text!r}: expected KEY=A:B with two different values, "
                         "e.g. policy.per_layer=true:false or policy=mismatch:fisher")
    return key, a, b


def compare_values(
    df: pd.DataFrame,
    outcome: str,
    key: str,
    a: str,
    b: str,
    *,
    by: Sequence[str] | None = None,
    level: float = 0.95,
    reps: int = 2000,
    seed: int = 0,
    method: CiMethod = "percentile",
    min_seeds: int | None = None,
    adjust: Adjustment = "holm",
) -> pd.DataFrame:
    """``Y(key=a) - Y(key=b)`` per arm, paired by seed (see the module doc).

    ``a`` and ``b`` are matched against the key's values as text, case-insensitively, so
    ``true`` finds a boolean ``True``. Columns: the other arm keys, ``compare`` (``"key: a - b"``),
    then the effect table's columns (``effect`` is ``"compare"``, ``baseline`` is ``key=b``).
    """
    if key == "policy":
        missing = {a, b} - set(df["policy"])
        if missing:
            raise ValueError(f"--compare policy={a}:{b}: no policy {sorted(missing)} in this sweep; "
                             f"policies here: {', '.join(sorted(set(df['policy'])))}")
        table = effects(df, outcome, by=by, level=level, reps=reps, seed=seed, method=method,
                        min_seeds=min_seeds, comparisons=[(a, b)], adjust=adjust, matched=False)
        table = table[(table["policy"] == a) & (table["baseline"] == b)].reset_index(drop=True)
        _adjust(table, adjust)  # this comparison's own families, not the effects table's
        table.insert(0, "compare", f"policy: {a} - {b}")
        return table
    if key not in df.columns:
        raise KeyError(f"--compare {key}={a}:{b}: no column {key!r}; config keys that vary here: "
                       f"{df.attrs.get('config_keys', []) or 'none'}")
    if key.startswith("policy.") and key not in arm_keys(df, by):
        df = _without_setting_in_names(df, key)
    text = df[key].astype(str).str.lower()
    present = sorted(set(df[key].astype(str)))
    for value in (a, b):
        if not (text == value.lower()).any():
            raise ValueError(f"--compare {key}={a}:{b}: {key} is never {value!r} here; its values: {', '.join(present)}")
    keys = [k for k in arm_keys(df, by) if k != key]
    check_frame(df, outcome, [*keys, key])
    needed = resolve_min_seeds(min_seeds, level)
    settings = _RowSettings(outcome, level, reps, seed, method, needed, HIGHER_IS_BETTER.get(outcome) is not False)
    label = f"{key}={b}"
    rows: list[dict[str, Any]] = []
    for prefix, part in contexts(df, keys):
        side_a = arm_values(part[text.loc[part.index] == a.lower()], outcome)
        side_b = arm_values(part[text.loc[part.index] == b.lower()], outcome)
        block = []
        for arm in sorted(side_a.keys() & side_b.keys(), key=lambda k: (k[0], -1.0 if k[1] is None else k[1])):
            treated, control = side_a[arm], side_b[arm]
            shared = sorted(treated.keys() & control.keys(), key=str)
            unpaired = len(treated) + len(control) - 2 * len(shared)
            notes = [f"{unpaired} unpaired seed value(s) dropped"] if unpaired else []
            block.append(_row(settings, prefix, "compare", arm[0], label, arm[1], shared,
                              np.array([treated[s] for s in shared], dtype=float),
                              np.array([control[s] for s in shared], dtype=float), notes))
        rows += block + _pooled_rows(settings, prefix, block)
    table = pd.DataFrame([{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
                         columns=[*keys, *EFFECT_COLUMNS])
    if table.empty:
        raise ValueError(f"--compare {key}={a}:{b}: no arm (policy, budget{', ' if keys else ''}{', '.join(keys)}) "
                         f"was run with both values")
    table["pooled"] = table["pooled"].astype(bool)
    _adjust(table, adjust)
    table = table.iloc[canonical_order(table, keys)].reset_index(drop=True)
    table.insert(0, "compare", f"{key}: {a} - {b}")
    table.attrs.update(outcome=outcome, level=level, adjust=adjust, min_seeds=needed)
    return table


def _without_setting_in_names(df: pd.DataFrame, key: str) -> pd.DataFrame:
    """``df`` with ``key``'s entry taken out of each arm name: ``random[per_layer=True]`` -> ``random``.

    A policy setting that varies is part of the arm's name, so the two values to compare sit in
    differently named arms; without it in the names, they pair up.
    """
    entry = key[len("policy."):] + "="
    names = []
    for name, variant in zip(df["policy_name"], df["variant"].fillna("")):
        kept = [part for part in str(variant).split(",") if part and not part.startswith(entry)]
        names.append(arm_name(name, ",".join(kept)))
    out = df.copy()
    out["policy"] = names
    return out


def _adjust(table: pd.DataFrame, adjust: Adjustment) -> None:
    """``p_adj`` within the comparison: its per-budget rows one family, its pooled rows another."""
    for pooled in (False, True):
        members = table["pooled"] == pooled
        table.loc[members, "p_adj"] = adjust_pvalues(table.loc[members, "p_value"].to_numpy(), adjust)
