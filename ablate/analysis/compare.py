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

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.tables import (
    RowSettings,
    arm_keys,
    arm_values,
    canonical_order,
    check_frame,
    contexts,
    effect_row,
    effect_rows,
    effect_table,
    pooled_rows,
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
    settings: AnalysisSettings | None = None,
    **options: Any,
) -> pd.DataFrame:
    """``Y(key=a) - Y(key=b)`` per arm, paired by seed (see the module doc).

    ``settings`` (or its keywords) as for :func:`~ablate.analysis.tables.effects`; primary
    questions do not apply here: the comparison is its own question, with its own families.

    ``a`` and ``b`` are matched against the key's values as text, case-insensitively, so
    ``true`` finds a boolean ``True``. Columns: the other arm keys, ``compare`` (``"key: a - b"``),
    then the effect table's columns (``effect`` is ``"compare"``, ``baseline`` is ``key=b``).
    """
    settings = replace(AnalysisSettings.of(settings, options, df), primary=())
    by = settings.by
    if key == "policy":
        missing = {a, b} - set(df["policy"])
        if missing:
            raise ValueError(f"--compare policy={a}:{b}: no policy {sorted(missing)} in this sweep; "
                             f"policies here: {', '.join(sorted(set(df['policy'])))}")
        rows, keys, row_settings = effect_rows(df, outcome, settings, comparisons=[(a, b)],
                                               others_vs_random=False, matched=False)
        rows = [row for row in rows if row["policy"] == a and row["baseline"] == b]
        table = effect_table(rows, keys, row_settings, family_keys=())  # this comparison's own families
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
    row_settings = RowSettings(outcome, settings)
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
            block.append(effect_row(row_settings, prefix, "compare", arm[0], label, arm[1], shared,
                                    np.array([treated[s] for s in shared], dtype=float),
                                    np.array([control[s] for s in shared], dtype=float), notes))
        rows += block + pooled_rows(row_settings, prefix, block)
    if not rows:
        raise ValueError(f"--compare {key}={a}:{b}: no arm (policy, budget{', ' if keys else ''}{', '.join(keys)}) "
                         f"was run with both values")
    order = canonical_order(pd.DataFrame([{k: row[k] for k in ("policy", "budget", *keys)} for row in rows]), keys)
    table = effect_table([rows[i] for i in order], keys, row_settings, family_keys=())
    table.insert(0, "compare", f"{key}: {a} - {b}")
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
