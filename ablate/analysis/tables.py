"""Summary tables and the effect decomposition over seeds.

Both functions work on any tidy frame with one row per cell and the columns ``policy``,
``budget``, ``seed`` and the outcome (what :func:`ablate.analysis.load.load_runs` returns, or a
frame you build yourself). A NaN outcome drops that cell from the statistic; ``n_seeds`` counts
the seeds actually used.

``none`` and ``full`` do not depend on the budget (DESIGN.md section 3): their rows carry a
fixed budget (0 and 1) and, in :func:`effects`, one row per seed serves as the baseline at every
budget.

Every interval is reproducible: each table row draws from its own generator, seeded from
``seed`` and the row's identity, so adding a policy never changes another row's interval.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.stats import (
    bootstrap_ci,
    iqm,
    min_seeds_for_sign_flip,
    paired_bootstrap_ci,
    sign_flip_pvalue,
)
from ablate.budget import FIXED_BUDGETS

#: Policies with one budget by definition (none: 0, full: 1), from the shared budget rule.
FIXED_BUDGET_POLICIES = FIXED_BUDGETS
POLICY_ORDER: tuple[str, ...] = ("none", "full", "random", "uniform", "fisher", "mismatch")
SELECTION_BASELINES: tuple[str, ...] = ("random", "uniform")
EFFECT_COLUMNS: tuple[str, ...] = (
    "effect", "policy", "baseline", "budget", "mean", "ci_low", "ci_high", "p_value", "n_seeds", "note",
)


def summarize(
    df: pd.DataFrame,
    outcome: str = "final_reward",
    *,
    level: float = 0.95,
    reps: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Per-(policy, budget) summary of one outcome over seeds.

    Columns: ``mean``, ``std`` (sample standard deviation, ddof=1), ``iqm`` (interquartile
    mean), ``ci_low``/``ci_high`` (percentile bootstrap interval of the mean at ``level``,
    ``reps`` resamples), ``n_seeds``. Indexed by ``(policy, budget)``, policies in the
    canonical order (none, full, random, uniform, fisher, mismatch, then others), budgets
    ascending.
    """
    _check_frame(df, outcome)
    rows = []
    for (policy, budget), group in df.groupby(["policy", "budget"], sort=False):
        values = _finite(group[outcome])
        n = values.size
        low, high = bootstrap_ci(
            values, level=level, reps=reps, rng=_row_rng(seed, "summary", outcome, policy, budget)
        ) if n else (math.nan, math.nan)
        rows.append({
            "policy": policy,
            "budget": float(budget),
            "mean": float(values.mean()) if n else math.nan,
            "std": float(values.std(ddof=1)) if n > 1 else math.nan,
            "iqm": iqm(values) if n else math.nan,
            "ci_low": low,
            "ci_high": high,
            "n_seeds": n,
        })
    table = pd.DataFrame(rows, columns=["policy", "budget", "mean", "std", "iqm", "ci_low", "ci_high", "n_seeds"])
    table = table.iloc[canonical_order(table)].set_index(["policy", "budget"])
    table.attrs["outcome"] = outcome
    table.attrs["level"] = level
    return table


def effects(
    df: pd.DataFrame,
    outcome: str = "final_reward",
    *,
    level: float = 0.95,
    reps: int = 2000,
    seed: int = 0,
    comparisons: Iterable[tuple[str, str]] | None = None,
    others_vs_random: bool = False,
) -> pd.DataFrame:
    """Effects of replay, budget and selection on ``outcome``, paired by seed.

    One row per (effect, policy, baseline, budget), each the mean over seeds of
    ``Y(policy) - Y(baseline)``:

    - ``replay``: ``full - none``; ``budget`` is NaN (the effect spans budget 0 to 1).
    - ``budget`` at b: ``random(b) - none``.
    - ``selection`` at b: ``fisher(b) - random(b)`` and ``fisher(b) - uniform(b)``.
    - ``comparisons``: extra ``(policy, baseline)`` pairs, e.g. ``("mismatch", "fisher")``;
      two budgeted policies give ``selection`` rows at each shared budget, a budgeted policy
      against ``none`` or ``full`` gives ``budget`` rows, ``full`` against ``none`` ``replay``.
    - ``others_vs_random``: also every other budgeted policy against ``random`` (selection).

    Only seeds present (with a finite outcome) in both arms are used; ``n_seeds`` counts them.
    ``ci_low``/``ci_high`` is the paired percentile bootstrap interval of the mean difference,
    ``p_value`` the two-sided sign-flip test (exact up to 20 seeds). ``note`` says in plain
    words when the seeds are too few for a claim at ``1 - level``, or when unpaired seeds were
    dropped. Rows whose arms are missing from ``df`` are skipped.
    """
    _check_frame(df, outcome)
    pairs = _effect_pairs(df, comparisons, others_vs_random)
    arms = _arms(df, outcome)
    alpha = 1.0 - level
    needed = min_seeds_for_sign_flip(alpha)
    rows = []
    for effect, policy, baseline, budget in pairs:
        treated, control = _arm(arms, policy, budget), _arm(arms, baseline, budget)
        shared = sorted(treated.keys() & control.keys())
        a = np.array([treated[s] for s in shared], dtype=float)
        b = np.array([control[s] for s in shared], dtype=float)
        diffs = a - b
        n = diffs.size
        rng = _row_rng(seed, effect, outcome, policy, baseline, budget)
        low, high = (
            paired_bootstrap_ci(a, b, level=level, reps=reps, rng=rng) if n else (math.nan, math.nan)
        )
        rows.append({
            "effect": effect,
            "policy": policy,
            "baseline": baseline,
            "budget": math.nan if budget is None else float(budget),
            "mean": float(diffs.mean()) if n else math.nan,
            "ci_low": low,
            "ci_high": high,
            "p_value": sign_flip_pvalue(diffs, rng=rng) if n else math.nan,
            "n_seeds": n,
            "note": _note(n, needed, alpha, len(treated) + len(control) - 2 * n),
        })
    table = pd.DataFrame(rows, columns=list(EFFECT_COLUMNS))
    table.attrs["outcome"] = outcome
    table.attrs["level"] = level
    return table


def _effect_pairs(
    df: pd.DataFrame,
    comparisons: Iterable[tuple[str, str]] | None,
    others_vs_random: bool,
) -> list[tuple[str, str, str, float | None]]:
    present = set(df["policy"].unique())
    budgets = {
        policy: sorted(float(b) for b in df.loc[df["policy"] == policy, "budget"].unique())
        for policy in present
        if policy not in FIXED_BUDGET_POLICIES
    }
    requested: list[tuple[str, str]] = [("full", "none"), ("random", "none")]
    requested += [("fisher", baseline) for baseline in SELECTION_BASELINES]
    if others_vs_random:
        requested += [(p, "random") for p in order_policies(budgets) if p not in ("random", "fisher")]
    requested += [tuple(pair) for pair in comparisons or ()]
    pairs: list[tuple[str, str, str, float | None]] = []
    for policy, baseline in dict.fromkeys(requested):
        if policy not in present or baseline not in present or policy == baseline:
            continue
        if policy in FIXED_BUDGET_POLICIES and baseline in FIXED_BUDGET_POLICIES:
            pairs.append(("replay", policy, baseline, None))
            continue
        if policy in FIXED_BUDGET_POLICIES:
            kind, shared = "budget", budgets[baseline]
        elif baseline in FIXED_BUDGET_POLICIES:
            kind, shared = "budget", budgets[policy]
        else:
            kind, shared = "selection", sorted(set(budgets[policy]) & set(budgets[baseline]))
        pairs.extend((kind, policy, baseline, b) for b in shared)
    return pairs


def _arms(df: pd.DataFrame, outcome: str) -> dict[tuple[str, float | None], dict[object, float]]:
    """Finite outcome per seed for each arm; ``none``/``full`` are keyed without a budget."""
    values = pd.to_numeric(df[outcome], errors="coerce").to_numpy(dtype=float)
    arms: dict[tuple[str, float | None], dict[object, float]] = {}
    for policy, budget, seed, value in zip(df["policy"], df["budget"].astype(float), df["seed"], values):
        key = (policy, None if policy in FIXED_BUDGET_POLICIES else round(float(budget), 12))
        arm = arms.setdefault(key, {})
        if seed in arm:
            raise ValueError(
                f"policy={policy} has several rows for seed {seed}: "
                f"{policy} runs once per seed at its fixed budget"
            )
        if np.isfinite(value):
            arm[seed] = float(value)
    return arms


def _arm(arms: dict, policy: str, budget: float | None) -> dict[object, float]:
    key = (policy, None if policy in FIXED_BUDGET_POLICIES or budget is None else round(float(budget), 12))
    return arms.get(key, {})


def _note(n: int, needed: int, alpha: float, unpaired: int) -> str:
    parts = []
    if n == 0:
        parts.append("no paired seeds")
    elif n < needed:
        parts.append(
            f"only {n} paired seed{'s' if n > 1 else ''}: "
            + ("no interval; " if n == 1 else "")
            + f"an exact sign-flip test cannot reach p<{alpha:g} (needs >= {needed})"
        )
    if unpaired:
        parts.append(f"{unpaired} unpaired seed value(s) dropped")
    return "; ".join(parts)


def _check_frame(df: pd.DataFrame, outcome: str) -> None:
    missing = [c for c in ("policy", "budget", "seed", outcome) if c not in df.columns]
    if missing:
        raise KeyError(f"results frame lacks column(s) {missing}; it has {list(df.columns)}")
    duplicated = df.duplicated(["policy", "budget", "seed"], keep=False)
    if duplicated.any():
        first = df.loc[duplicated, ["policy", "budget", "seed"]].iloc[0].to_dict()
        raise ValueError(
            f"{int(duplicated.sum())} rows share (policy, budget, seed), e.g. {first}: "
            "one row per cell expected (filter by backend or sweep first)"
        )


def _finite(values: pd.Series) -> np.ndarray:
    array = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float)
    return array[np.isfinite(array)]


def _row_rng(seed: int, *identity: object) -> np.random.Generator:
    key = zlib.crc32("|".join(str(part) for part in identity).encode())
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(key,)))


def order_policies(policies: Iterable[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(POLICY_ORDER)}
    return sorted(policies, key=lambda p: (rank.get(p, len(rank)), p))


def canonical_order(table: pd.DataFrame) -> Sequence[int]:
    rank = {name: i for i, name in enumerate(order_policies(table["policy"].unique()))}
    keys = list(zip(table["policy"].map(rank), table["budget"]))
    return sorted(range(len(table)), key=lambda i: keys[i])
