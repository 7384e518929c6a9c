"""Summary tables and the effect decomposition over seeds.

Both functions work on any tidy frame with one row per cell and the columns ``policy``,
``budget``, ``seed`` and the outcome (what :func:`ablate.analysis.load.load_runs` returns, or a
frame you build yourself). A NaN outcome drops that cell from the statistic; ``n_seeds`` counts
the seeds actually used.

**Arms.** A cell's arm is its policy (with its settings, ``fisher[tau=1.0]``), its budget and
every other config key that varies in the sweep (``df.attrs["config_keys"]``, filled by
``load_runs``, plus ``schema_version`` when it varies); ``by=`` names the keys explicitly
instead. Tables have one row per arm, and effects compare policies only within one value of
those other keys (a *context*), so a sweep over ``backend.router_noise`` gets its replay,
budget and selection effects at each noise level.

``none`` and ``full`` do not depend on the budget (docs/design.md section 3): their rows carry a
fixed budget (0 and 1) and, in :func:`effects`, one row per seed serves as the baseline at every
budget.

**Few seeds.** Below ``min_seeds`` (default :func:`~ablate.analysis.stats.min_seeds_for_interval`,
6 at level 0.95: the fewest for which an exact sign-flip test can reach ``p < 0.05``) no
interval is reported, and the ``note`` column says so.

Every interval is reproducible: each table row draws from its own generator, seeded from
``seed`` and the row's identity, so adding a policy never changes another row's interval.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.families import assign_families, families_legend
from ablate.analysis.matched import matched_pairs, seed_curves
from ablate.outcomes import HIGHER_IS_BETTER
from ablate.analysis.paired import paired_effect
from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.signflip import t_interval
from ablate.analysis.stats import bootstrap_ci, iqm
from ablate.arms import arm_policy
from ablate.diagnostics.schema import comparable_version
from ablate.policies import fixed_budget_policies
from ablate.policies.roles import (
    BUDGET_CONTROL,
    FULL_REPLAY,
    NO_REPLAY,
    POLICY_ORDER,
    SELECTION_BASELINES,
    SELECTION_TREATMENT,
)

#: Policies with one budget by definition (none: 0, full: 1), from their ``fixed_budget`` trait.
FIXED_BUDGET_POLICIES = fixed_budget_policies()
#: The control whose budget-response curve matched-effective-budget comparisons are read from.
CURVE_POLICY = BUDGET_CONTROL
EFFECTIVE_BUDGET = "effective_budget_mean"
SUMMARY_COLUMNS: tuple[str, ...] = (
    "mean", "std", "iqm", "ci_low", "ci_high", "n_seeds", "effective_budget", "note",
)
EFFECT_COLUMNS: tuple[str, ...] = (
    "effect", "policy", "baseline", "budget", "pooled", "mean", "ci_low", "ci_high", "p_value", "p_adj",
    "ci_adj_low", "ci_adj_high", "family", "margin", "p_equiv", "p_equiv_adj", "claim",
    "prob_improvement", "share_improved", "sd_diff", "n_seeds", "note",
)

Arms = dict[tuple[str, float | None], dict[Hashable, float]]


def arm_keys(df: pd.DataFrame, by: Sequence[str] | None = None) -> list[str]:
    """The keys besides policy and budget that make an arm (module doc); ``by`` overrides them."""
    if by is not None:
        missing = [key for key in by if key not in df.columns]
        if missing:
            varied = df.attrs.get("config_keys", [])
            raise KeyError(f"by={list(by)}: no column {missing}; config keys that vary here: {varied or 'none'}")
        return [key for key in by if key not in ("policy", "budget", "seed")]
    keys = [key for key in df.attrs.get("config_keys", []) if key in df.columns and df[key].nunique(dropna=False) > 1]
    if "schema_version" in df.columns and df["schema_version"].map(comparable_version).nunique(dropna=False) > 1:
        keys.append("schema_version")  # versions whose records only add keys to each other's are one
    if "streams" in df.columns and df["streams"].nunique(dropna=False) > 1:
        keys.append("streams")  # a seed draws other data under each seed scheme
    return list(dict.fromkeys(keys))


def contexts(df: pd.DataFrame, keys: Sequence[str]) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """``({key: value}, rows)`` for each combination of the arm keys besides policy and budget, in
    the order of their values: the tables, the verdict and the figures' panels list them alike."""
    if not keys:
        return [({}, df)]
    return [(dict(zip(keys, values if isinstance(values, tuple) else (values,))), part)
            for values, part in df.groupby(list(keys), sort=True, dropna=False)]


def context_label(values: Mapping[str, Any]) -> str:
    """A context as it is printed: ``"backend.router_noise=0.07"`` ("" for none)."""
    return ", ".join(f"{key}={value}" for key, value in values.items())


def summarize(
    df: pd.DataFrame,
    outcome: str = "final_reward",
    *,
    settings: AnalysisSettings | None = None,
    **options: Any,
) -> pd.DataFrame:
    """Per-arm summary of one outcome over seeds.

    ``settings`` (or keywords of :class:`~ablate.analysis.settings.AnalysisSettings`: ``by``,
    ``level``, ``method``, ``reps``, ``seed``, ``min_seeds``) say how. Columns: ``mean``,
    ``std`` (sample standard deviation, ddof=1), ``iqm`` (interquartile mean),
    ``ci_low``/``ci_high`` (interval of the mean at ``level``: Student's t for ``method`` exact
    or t, whose coverage at 6 seeds is near nominal; a bootstrap for percentile or BCa; none
    below ``min_seeds``), ``n_seeds``, ``effective_budget`` (mean of ``effective_budget_mean``,
    when the frame has it) and ``note``. Indexed by the arm keys, then ``(policy, budget)``;
    policies in the canonical order (none, full, random, uniform, fisher, mismatch, then
    others), budgets ascending.
    """
    settings = AnalysisSettings.of(settings, options, df)
    keys = arm_keys(df, settings.by)
    check_frame(df, outcome, keys)
    needed = settings.needed
    rows = []
    for group_key, group in df.groupby([*keys, "policy", "budget"], sort=False, dropna=False):
        *context, policy, budget = group_key
        values = _finite(group[outcome])
        n = values.size
        if n < needed:
            low, high = math.nan, math.nan
        elif settings.method in ("exact", "t"):
            low, high = t_interval(values, level=settings.level)
        else:
            low, high = bootstrap_ci(values, level=settings.level, reps=settings.reps, method=settings.method,
                                     rng=row_rng(settings.seed, "summary", outcome, *context, policy, budget))
        effective = _finite(group[EFFECTIVE_BUDGET]) if EFFECTIVE_BUDGET in group.columns else np.array([])
        rows.append({
            **dict(zip(keys, context)),
            "policy": policy,
            "budget": float(budget),
            "mean": float(values.mean()) if n else math.nan,
            "std": float(values.std(ddof=1)) if n > 1 else math.nan,
            "iqm": iqm(values) if n else math.nan,
            "ci_low": low,
            "ci_high": high,
            "n_seeds": n,
            "effective_budget": float(effective.mean()) if effective.size else math.nan,
            "note": _seeds_note(n, needed, "seed"),
        })
    table = pd.DataFrame(rows, columns=[*keys, "policy", "budget", *SUMMARY_COLUMNS])
    table = table.iloc[canonical_order(table, keys)].set_index([*keys, "policy", "budget"])
    interval = "t" if settings.method in ("exact", "t") else f"{settings.method} bootstrap"
    table.attrs.update(outcome=outcome, level=settings.level, method=settings.method, interval=interval,
                       min_seeds=needed, by=keys)
    return table


def effects(
    df: pd.DataFrame,
    outcome: str = "final_reward",
    *,
    settings: AnalysisSettings | None = None,
    comparisons: Iterable[tuple[str, str]] | None = None,
    others_vs_random: bool = True,
    pooled: bool = True,
    matched: bool = True,
    extrapolate: float = 0.1,
    **options: Any,
) -> pd.DataFrame:
    """Effects of replay, budget and selection on ``outcome``, paired by seed, per context.

    One row per (effect, policy, baseline, budget), each the mean over seeds of
    ``Y(policy) - Y(baseline)``:

    - ``replay``: ``full - none``; ``budget`` is NaN (the effect spans budget 0 to 1).
    - ``budget`` at b: ``random(b) - none``.
    - ``selection`` at b: ``fisher(b) - random(b)`` and ``fisher(b) - uniform(b)``.
    - ``comparisons``: extra ``(policy, baseline)`` pairs, e.g. ``("mismatch", "fisher")``;
      two budgeted policies give ``selection`` rows at each shared budget, a budgeted policy
      against ``none`` or ``full`` gives ``budget`` rows, ``full`` against ``none`` ``replay``.
    - ``others_vs_random`` (default True, as ``ablate-analyze``, so both build the same
      families): also every other budgeted policy against ``random`` (selection).
    - ``matched_selection`` at b (``matched=True``, when the frame has ``effective_budget_mean``):
      every budgeted policy other than ``random`` against ``random``'s budget-response curve at
      the policy's effective budget, per seed (:mod:`ablate.analysis.matched`; ``extrapolate``
      is its tolerance beyond the curve's ends).
    - ``pooled=True``: for each comparison above made at two budgets or more, one row with
      ``pooled`` True and ``budget`` NaN: per seed the mean difference over the budgets, for
      claims that span budgets ("fisher beats random") with one test instead of one per budget.

    Only seeds present (with a finite outcome) in both arms are used; ``n_seeds`` counts them.
    The numbers of each row come from :func:`ablate.analysis.paired.paired_effect`:
    ``ci_low``/``ci_high`` the unadjusted interval at ``level`` (by default the inverted exact
    sign-flip test: it excludes 0 exactly when ``p_value < 1 - level``; none below
    ``min_seeds`` paired seeds), ``p_value`` the two-sided sign-flip test (exact up to 16
    seeds, Monte Carlo above), ``p_equiv`` the equivalence test of ``|effect| < margin`` when
    ``margins`` names the outcome, ``prob_improvement`` rliable's probability that a run of
    the policy beats a run of the baseline (unpaired), ``share_improved`` the share of seeds
    whose own paired difference improved (the direction from ``HIGHER_IS_BETTER``; for
    outcomes with no better side, a larger value), ``sd_diff`` the paired standard deviation.

    **Multiplicity** (:mod:`ablate.analysis.families`). ``family`` names each row's family:
    the ordered ``primary`` gates (serial gatekeeping), else the exploratory default, one
    family per context (a combination of the arm keys besides policy and budget) with
    per-budget and pooled rows apart. ``p_adj`` is adjusted within it (``adjust``: Holm by
    default), ``ci_adj_low``/``ci_adj_high`` is the interval adjusted to the same family (it
    excludes 0 exactly when ``p_adj < 1 - level``), ``p_equiv_adj`` the equivalence p adjusted
    the same way, and ``claim`` says what the row supports: ``differs``, ``within ±margin``
    or ``inconclusive``. ``note`` says in plain words when the seeds are too few for an
    interval or a claim, and when seeds were dropped.
    """
    rows, keys, row_settings = effect_rows(
        df, outcome, AnalysisSettings.of(settings, options, df), comparisons=comparisons,
        others_vs_random=others_vs_random, pooled=pooled, matched=matched, extrapolate=extrapolate,
    )
    return effect_table(rows, keys, row_settings)


def effect_rows(
    df: pd.DataFrame,
    outcome: str,
    settings: AnalysisSettings,
    *,
    comparisons: Iterable[tuple[str, str]] | None = None,
    others_vs_random: bool = True,
    pooled: bool = True,
    matched: bool = True,
    extrapolate: float = 0.1,
) -> tuple[list[dict[str, Any]], list[str], "RowSettings"]:
    """The rows of :func:`effects` before families are formed: ``(rows, arm keys, row settings)``.

    For a caller that keeps some rows and forms its own families (:mod:`ablate.analysis.compare`)
    with :func:`effect_table`.
    """
    keys = arm_keys(df, settings.by)
    check_frame(df, outcome, keys)
    rows: list[dict[str, Any]] = []
    row_settings = RowSettings(outcome, settings)
    for prefix, part in contexts(df, keys):
        arms = arm_values(part, outcome)
        comparisons_here = _effect_pairs(part, comparisons, others_vs_random)
        block = [_paired_row(row_settings, prefix, kind, policy, baseline, budget, arms)
                 for kind, policy, baseline, budget in comparisons_here]
        if matched and EFFECTIVE_BUDGET in part.columns:
            block += _matched_rows(row_settings, prefix, part, arms, extrapolate)
        if pooled:
            block += pooled_rows(row_settings, prefix, block)
        rows += block
    return rows, keys, row_settings


@dataclass(frozen=True)
class RowSettings:
    """What every effect row of one table is computed with: the outcome and the analysis settings."""

    outcome: str
    analysis: AnalysisSettings

    @property
    def higher_is_better(self) -> bool | None:
        return HIGHER_IS_BETTER.get(self.outcome)

    @property
    def margin(self) -> float | None:
        return self.analysis.margins.get(self.outcome)


def effect_row(
    settings: RowSettings, prefix: dict[str, Any], kind: str, policy: str, baseline: str, budget: float | None,
    seeds: list[Hashable], a: np.ndarray, b: np.ndarray, notes: list[str], *, pooled: bool = False,
) -> dict[str, Any]:
    """One effect row from seed-paired values ``a`` (policy) and ``b`` (baseline).

    Keys starting with ``_`` (the seed-paired values, the row's test and generator) are for
    :func:`pooled_rows` and :func:`effect_table` and never reach the table.
    """
    analysis = settings.analysis
    rng = row_rng(analysis.seed, kind, settings.outcome, *prefix.values(), policy, baseline, budget, pooled)
    numbers = paired_effect(a, b, rng=rng, level=analysis.level, method=analysis.method, reps=analysis.reps,
                            min_seeds=analysis.needed, margin=settings.margin,
                            higher_is_better=settings.higher_is_better)
    n = numbers["n_seeds"]
    return {
        **prefix,
        "effect": kind,
        "policy": policy,
        "baseline": baseline,
        "budget": math.nan if budget is None else float(budget),
        "pooled": pooled,
        **{key: value for key, value in numbers.items() if key != "test"},
        "p_adj": math.nan,
        "margin": settings.margin if settings.margin else math.nan,
        "note": "; ".join(part for part in [_seeds_note(n, analysis.needed, "paired seed"), *notes] if part),
        "_by_seed": dict(zip(seeds, zip(a, b))),
        "_test": numbers["test"],
        "_rng": rng,
    }


def effect_table(rows: list[dict[str, Any]], keys: Sequence[str], settings: RowSettings,
                 family_keys: Sequence[str] | None = None) -> pd.DataFrame:
    """Rows of :func:`effect_row` as a table, with families, adjusted p and intervals filled in.

    Families are formed per context of ``family_keys`` (default: the arm keys ``keys``).
    """
    table = pd.DataFrame([{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
                         columns=[*keys, *EFFECT_COLUMNS])
    table["pooled"] = table["pooled"].astype(bool)
    tests = {i: row["_test"] for i, row in enumerate(rows)}
    assign_families(table, keys if family_keys is None else family_keys, settings.analysis, tests,
                    lambda i: rows[i]["_rng"])
    analysis, direction = settings.analysis, settings.higher_is_better
    table.attrs.update(
        outcome=settings.outcome, level=analysis.level, method=analysis.method, min_seeds=analysis.needed,
        by=list(keys), adjust=analysis.adjust, primary=list(analysis.primary or ()), margin=settings.margin,
        families=families_legend(table),
        improvement={True: "higher is better", False: "lower is better"}.get(direction, "P(policy > baseline)"),
    )
    return table


def _paired_row(settings: RowSettings, prefix: dict[str, Any], kind: str, policy: str, baseline: str,
                budget: float | None, arms: Arms) -> dict[str, Any]:
    treated, control = arm_seeds(arms, policy, budget), _control_seeds(arms, baseline, budget)
    shared = sorted(treated.keys() & control.keys(), key=str)
    unpaired = len(treated) + len(control) - 2 * len(shared)
    notes = [f"{unpaired} unpaired seed value(s) dropped"] if unpaired else []
    a = np.array([treated[s] for s in shared], dtype=float)
    b = np.array([control[s] for s in shared], dtype=float)
    return effect_row(settings, prefix, kind, policy, baseline, budget, shared, a, b, notes)


def _matched_rows(settings: RowSettings, prefix: dict[str, Any], part: pd.DataFrame, arms: Arms,
                  extrapolate: float) -> list[dict[str, Any]]:
    """``matched_selection`` rows: each budgeted policy against random's curve at its effective budget."""
    effective = arm_values(part, EFFECTIVE_BUDGET)
    curve_arms = [key for key in arms if key[0] in FIXED_BUDGET_POLICIES or key[0] == CURVE_POLICY]
    if not any(key[0] == CURVE_POLICY and effective.get(key) for key in curve_arms):
        return []  # no random arm with a known effective budget: no curve to read from
    curves = seed_curves([(effective.get(key, {}), arms[key]) for key in curve_arms])
    rows = []
    for policy, budget in _budgeted_arms(arms):
        if policy == CURVE_POLICY:
            continue
        known = effective.get((policy, budget), {})
        seeds, a, b, outside, no_curve = matched_pairs(arms[(policy, budget)], known, curves, extrapolate=extrapolate)
        notes = [] if known else ["no effective budget logged"]
        if outside:
            notes.append(f"{outside} seed(s) outside random's effective-budget range, dropped")
        if no_curve:
            notes.append(f"{no_curve} seed(s) without a random curve, dropped")
        rows.append(effect_row(settings, prefix, "matched_selection", policy, CURVE_POLICY, budget, seeds, a, b, notes))
    return rows


def pooled_rows(settings: RowSettings, prefix: dict[str, Any], block: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per comparison made at several budgets: per seed, the mean difference over those budgets."""
    by_comparison: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in block:
        if not math.isnan(row["budget"]):
            by_comparison.setdefault((row["effect"], row["policy"], row["baseline"]), []).append(row)
    pooled = []
    for (kind, policy, baseline), rows in by_comparison.items():
        if len(rows) < 2 or not any(row["_by_seed"] for row in rows):
            continue
        everywhere = set.intersection(*(set(row["_by_seed"]) for row in rows))
        seeds = sorted(everywhere, key=str)
        dropped = len(set().union(*(set(row["_by_seed"]) for row in rows))) - len(seeds)
        a = np.array([np.mean([row["_by_seed"][s][0] for row in rows]) for s in seeds], dtype=float)
        b = np.array([np.mean([row["_by_seed"][s][1] for row in rows]) for s in seeds], dtype=float)
        budgets = ", ".join(f"{row['budget']:g}" for row in rows)
        notes = [f"pooled over budgets {budgets}"]
        if dropped:
            union = set().union(*(set(row["_by_seed"]) for row in rows))
            notes.append(_missing_note(dropped, [row for row in rows if set(row["_by_seed"]) != union]))
        pooled.append(effect_row(settings, prefix, kind, policy, baseline, None, seeds, a, b, notes, pooled=True))
    return pooled


def _missing_note(dropped: int, short: list[dict[str, Any]]) -> str:
    """The pooled row's note on the seeds it drops: at which budgets they were missing, and why (those
    rows' own notes), so that a row with fewer seeds than its arms says where they went."""
    budgets = ", ".join(f"{row['budget']:g}" for row in short)
    reasons = dict.fromkeys(match.group(1) for row in short for part in row["note"].split("; ")
                            if (match := re.fullmatch(r"\d+ seed\(s\) (.+), dropped", part)))
    return f"{dropped} seed(s) dropped, missing at budget {budgets}" + (f": {'; '.join(reasons)}" if reasons else "")


def _budgeted_arms(arms: Arms) -> list[tuple[str, float]]:
    budgeted = [key for key in arms if key[1] is not None]
    rank = {name: i for i, name in enumerate(order_policies({policy for policy, _ in budgeted}))}
    return sorted(budgeted, key=lambda key: (rank[key[0]], key[1]))  # type: ignore[return-value]


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
    requested: list[tuple[str, str]] = [(FULL_REPLAY, NO_REPLAY), (BUDGET_CONTROL, NO_REPLAY)]
    requested += [(SELECTION_TREATMENT, baseline) for baseline in SELECTION_BASELINES]
    if others_vs_random:
        requested += [(p, BUDGET_CONTROL) for p in order_policies(budgets) if p not in (BUDGET_CONTROL, SELECTION_TREATMENT)]
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
            kind, shared = "selection", sorted(set(budgets[policy]) & _control_budgets(baseline, budgets, present))
        pairs.extend((kind, policy, baseline, b) for b in shared)
    return pairs


def _control_budgets(baseline: str, budgets: Mapping[str, list[float]], present: set[str]) -> set[float]:
    """The budgets ``baseline`` was run at; ``random`` at 0 and at 1 is ``none`` and ``full`` by definition.

    So a variant of ``full`` (its routes replayed otherwise, or gated) meets ``random`` at budget 1.
    """
    shared = set(budgets[baseline])
    if baseline == CURVE_POLICY:
        shared |= {budget for policy, budget in FIXED_BUDGET_POLICIES.items() if policy in present}
    return shared


def _control_seeds(arms: Arms, baseline: str, budget: float | None) -> dict[Hashable, float]:
    """The baseline's values at ``budget`` (:func:`arm_seeds`); ``random`` at 0 and 1 is ``none`` and ``full``."""
    found = arm_seeds(arms, baseline, budget)
    if found or baseline != CURVE_POLICY or budget is None:
        return found
    same = next((policy for policy, fixed in FIXED_BUDGET_POLICIES.items() if fixed == float(budget)), None)
    return arm_seeds(arms, same, None) if same is not None else found


def arm_values(df: pd.DataFrame, outcome: str) -> Arms:
    """Finite outcome per seed for each policy arm of one context; ``none``/``full`` are keyed without a budget."""
    values = pd.to_numeric(df[outcome], errors="coerce").to_numpy(dtype=float)
    arms: Arms = {}
    for policy, budget, seed, value in zip(df["policy"], df["budget"].astype(float), df["seed"], values):
        key = (policy, None if policy in FIXED_BUDGET_POLICIES else round(float(budget), 12))
        arm = arms.setdefault(key, {})
        if np.isfinite(value):
            arm[seed] = float(value)
    return arms


def arm_seeds(arms: Arms, policy: str, budget: float | None) -> dict[Hashable, float]:
    """``{seed: value}`` of one arm of :func:`arm_values` ({} when the sweep lacks it)."""
    key = (policy, None if policy in FIXED_BUDGET_POLICIES or budget is None else round(float(budget), 12))
    return arms.get(key, {})


def _seeds_note(n: int, needed: int, unit: str) -> str:
    if n == 0:
        return f"no {unit}s"
    if n < needed:
        return f"{n} {unit}{'s' if n > 1 else ''} < {needed}: no interval, too few for a claim"
    return ""


def check_frame(df: pd.DataFrame, outcome: str, keys: Sequence[str]) -> None:
    """The columns exist and each (arm, seed) has one row; a clash names the key that tells the rows apart."""
    missing = [c for c in ("policy", "budget", "seed", outcome) if c not in df.columns]
    if missing:
        raise KeyError(f"results frame lacks column(s) {missing}; it has {list(df.columns)}")
    identity = [*keys, "policy", "budget", "seed"]
    duplicated = df.duplicated(identity, keep=False)
    if not duplicated.any():
        return
    _, clash = next(iter(df.loc[duplicated].groupby(identity, sort=False, dropna=False)))
    first = clash.iloc[0]
    candidates = [*df.attrs.get("config_keys", []), "schema_version", "streams", "backend", "sweep", "cell_id"]
    differ = [key for key in candidates if key in clash.columns and key not in keys
              and clash[key].astype(str).nunique() > 1]
    shown = ", ".join(f"{key}={first[key]}" for key in identity)
    if differ:
        hint = (f"they differ in {differ[0]}: group by it (by=[..., {differ[0]!r}], --by {differ[0]}) "
                f"or keep one value (where={{{differ[0]!r}: ...}}, --where {differ[0]}=VALUE)")
    else:
        hint = "one row per cell expected (filter by backend or sweep first)"
    raise ValueError(f"{int(duplicated.sum())} rows share an arm and seed, e.g. {len(clash)} with {shown}; {hint}")


def _finite(values: pd.Series) -> np.ndarray:
    array = pd.to_numeric(values, errors="coerce").to_numpy(dtype=float)
    return array[np.isfinite(array)]


def row_rng(seed: int, *identity: object) -> np.random.Generator:
    """A generator of its own for each table row, from ``seed`` and the row's identity."""
    key = zlib.crc32("|".join(str(part) for part in identity).encode())
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(key,)))


def order_policies(policies: Iterable[str]) -> list[str]:
    """Canonical order: the built-in policies first (each followed by its settings variants), then others."""
    rank = {name: i for i, name in enumerate(POLICY_ORDER)}
    return sorted(policies, key=lambda p: (rank.get(arm_policy(p), len(rank)), p))


def canonical_order(table: pd.DataFrame, keys: Sequence[str] = ()) -> Sequence[int]:
    """Row order: context keys, then policy (canonical), then budget."""
    rank = {name: i for i, name in enumerate(order_policies(table["policy"].unique()))}
    sort_keys = [
        (*(_sortable(table[key].iloc[i]) for key in keys), rank[table["policy"].iloc[i]], table["budget"].iloc[i])
        for i in range(len(table))
    ]
    return sorted(range(len(table)), key=lambda i: sort_keys[i])


def _sortable(value: Any) -> tuple[int, Any]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (2, "")
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return (0, float(value))
    return (1, str(value))
