"""Flag replay arms that are too restrictive or too weak, judged against ``none`` and ``full``
measured in the same sweep (docs/design.md section 4).

An arm (policy at a budget, within one context of the other arm keys; see
:mod:`ablate.analysis.tables`) is

- **too restrictive** when replay held back learning or adaptation: for at least one of
  ``restrictive_outcomes`` (default ``final_reward``, ``reward_auc``, ``expert_drift_final``)
  its paired difference from ``none`` is negative with an interval at ``level`` whose upper
  bound is below ``-restrictive_margin x |mean of none|`` (a margin of 0, the default, flags any
  drop whose interval excludes 0; 0.05 asks for a drop of at least 5%). ``full`` is judged too:
  full replay is the arm most likely to constrain the experts. The late reward gain is not among
  the defaults: an arm that learned faster has less left to gain at the end, so a drop there
  can mean better, not restricted.
- **too weak** when its mismatch outcomes cannot be told apart from ``none``'s in the sense that
  matters: for every one of ``weak_outcomes`` (default ``kl_k3_mean``,
  ``extreme_token_frac_mean``) the share of ``full``'s reduction of that outcome (against
  ``none``) that the arm achieves, ``mean(none - arm) / mean(none - full)`` with its bootstrap
  interval, has an upper bound below ``weak_share`` (default 0.1: we are confident it achieves
  less than a tenth of what full replay does). This is an equivalence-style judgement: a noisy
  arm whose interval is wide is *not* flagged, because "no evidence of an effect" is not
  evidence of no effect. ``full`` is the reference and is never too weak.

Each judgement also needs an exact sign-flip test of the same question (for "too weak", of
``mean(reduction - weak_share x full's reduction) < 0``, on every weak outcome: the arm's p is
the largest of its outcomes', an intersection-union test) to reject after adjustment for
multiplicity. A sweep asks many such questions, and unadjusted per-arm screens fired on about
half of the sweeps where nothing was planted. So within each context (one combination of the
other arm keys), the p-values of every "too restrictive" question (arm x outcome) form one
family and those of every "too weak" question (arm) another, each adjusted with ``adjust``
(default Holm: the chance of even one false flag in a context is at most ``(1 - level)``). The
bootstrap interval must agree too: it is somewhat too narrow at few seeds, the exact test holds
its level at any seed count. Nothing is judged below ``min_seeds`` paired seeds (no interval is
made there; see :func:`ablate.analysis.stats.min_seeds_for_interval`), nor without ``none``
(and, for "too weak", ``full``) in the same context; the ``note`` column says why. ``none`` is
never flagged.

**With an equivalence margin** for a weak outcome (``margins``, ``--margin kl_k3_mean=0.01``,
in the outcome's units), "too weak" on that outcome is a claim of equivalence instead: two
one-sided sign-flip tests (TOST) show ``|mean(none - arm)| < margin``, its p-value adjusted in
the same family. "No evidence of a reduction" never counts; "a reduction shown to be smaller
than the margin" does.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ablate.outcomes import HIGHER_IS_BETTER
from ablate.analysis.compact import fit
from ablate.analysis.paired import paired_interval
from ablate.analysis.settings import AnalysisSettings
from ablate.analysis.signflip import SignFlip
from ablate.analysis.stats import adjust_pvalues, min_achievable_pvalue, ratio_of_means_ci, sign_flip_pvalue
from ablate.analysis.tables import (
    arm_keys,
    arm_seeds,
    arm_values,
    canonical_order,
    check_frame,
    contexts,
    row_rng,
)
from ablate.policies.roles import FULL_REPLAY, NO_REPLAY

RESTRICTIVE_OUTCOMES: tuple[str, ...] = ("final_reward", "reward_auc", "expert_drift_final")
WEAK_OUTCOMES: tuple[str, ...] = ("kl_k3_mean", "extreme_token_frac_mean")


def flag_policies(
    df: pd.DataFrame,
    *,
    settings: AnalysisSettings | None = None,
    restrictive_outcomes: Sequence[str] = RESTRICTIVE_OUTCOMES,
    restrictive_margin: float = 0.0,
    weak_outcomes: Sequence[str] = WEAK_OUTCOMES,
    weak_share: float = 0.1,
    **options: Any,
) -> pd.DataFrame:
    """Per-arm flags from a per-cell frame (what ``load_runs`` returns); see the module doc.

    Columns: the arm keys, ``policy``, ``budget``, ``too_restrictive``, ``too_weak`` (bool),
    ``n_seeds`` (seeds paired with ``none``), per restrictive outcome ``<o>_vs_none`` and
    ``<o>_vs_none_high`` (mean difference and interval upper bound), per weak outcome
    ``<o>_share`` and ``<o>_share_high``, ``restrictive_p_adj`` (the smallest adjusted p of the
    arm's restrictive questions) and ``weak_p_adj``, ``reason`` (what fired, with the numbers)
    and ``note`` (what could not be judged and why), one row per arm in the canonical order.
    Outcomes missing from the frame are skipped. ``attrs["questions"]`` holds, per kind of flag,
    the largest family of one context and the most seeds an arm was judged on: with
    :func:`smallest_p_adj` they say whether any flag could be reached.
    """
    if restrictive_margin < 0 or not 0.0 < weak_share <= 1.0:
        raise ValueError(
            f"restrictive_margin={restrictive_margin}, weak_share={weak_share}: expected a margin >= 0 "
            "and a share in (0, 1]"
        )
    settings = AnalysisSettings.of(settings, options, df)
    level, adjust = settings.level, settings.adjust
    restrictive = [o for o in restrictive_outcomes if o in df.columns]
    weak = [o for o in weak_outcomes if o in df.columns]
    keys = arm_keys(df, settings.by)
    for outcome in (*restrictive, *weak):
        check_frame(df, outcome, keys)
    needed = settings.needed
    judge = _Judge(settings)
    alpha = 1.0 - level
    rows = []
    # Per kind of flag, the largest family of one context and the most seeds a judged arm had:
    # what decides whether any flag can be reached at all (smallest_p_adj).
    questions = {"too restrictive": (0, 0, 1.0), "too weak": (0, 0, 1.0)}
    for prefix, part in contexts(df, keys):
        arms = {outcome: arm_values(part, outcome) for outcome in (*restrictive, *weak)}
        judged = []
        for policy, budget in part[["policy", "budget"]].drop_duplicates().itertuples(index=False):
            if policy == NO_REPLAY:
                continue
            row: dict[str, Any] = {**prefix, "policy": policy, "budget": float(budget)}
            restrictive_verdicts = [
                judge.restrictive(arms[outcome], policy, budget, outcome, restrictive_margin, prefix)
                for outcome in restrictive
            ]
            weak_verdicts = [] if policy == FULL_REPLAY else [
                judge.weak(arms[outcome], policy, budget, outcome, weak_share, prefix) for outcome in weak
            ]
            for outcome, verdict in zip(restrictive, restrictive_verdicts):
                row[f"{outcome}_vs_none"], row[f"{outcome}_vs_none_high"] = verdict["mean"], verdict["high"]
            for outcome, verdict in zip(weak, weak_verdicts):
                row[f"{outcome}_share"], row[f"{outcome}_share_high"] = verdict["share"], verdict["high"]
            row["n_seeds"] = max((v["n"] for v in restrictive_verdicts), default=0)
            # Too weak is an intersection-union question: every outcome must show it, so the
            # arm's p is the largest of its outcomes' (NaN when any could not be judged).
            weak_p = [v["p"] for v in weak_verdicts]
            weak_arm_p = max(weak_p) if weak_p and all(np.isfinite(weak_p)) else math.nan
            judged.append((row, restrictive_verdicts, weak_verdicts, weak_arm_p))
        restrictive_p = np.array([v["p"] for _, verdicts, _, _ in judged for v in verdicts])
        weak_ps = np.array([p for *_, p in judged])
        # A weak outcome with a margin is judged by TOST, whose smallest p is half the two-sided one.
        weak_two_sided = not weak or any(outcome not in settings.margins for outcome in weak)
        _count_questions(questions, judged, {"too restrictive": (restrictive_p, True),
                                             "too weak": (weak_ps, weak_two_sided)})
        restrictive_adj = iter(adjust_pvalues(restrictive_p, adjust))
        weak_adj = iter(adjust_pvalues(weak_ps, adjust))
        for row, restrictive_verdicts, weak_verdicts, weak_arm_p in judged:
            fired, notes = [], []
            arm_adj = []
            for verdict in restrictive_verdicts:
                p_adj = next(restrictive_adj)
                arm_adj.append(p_adj)
                if verdict["candidate"] and p_adj < alpha:
                    fired.append(f"{verdict['reason']}, p_adj {p_adj:.2g}")
                notes += [verdict["note"]] if verdict["note"] else []
            row["too_restrictive"] = bool(fired)
            row["restrictive_p_adj"] = min((p for p in arm_adj if np.isfinite(p)), default=math.nan)
            weak_p_adj = next(weak_adj)
            row["weak_p_adj"] = weak_p_adj
            for verdict in weak_verdicts:
                notes += [verdict["note"]] if verdict["note"] else []
            row["too_weak"] = (bool(weak_verdicts) and all(v["candidate"] for v in weak_verdicts)
                               and weak_p_adj < alpha)
            if row["too_weak"]:
                fired += [f"{v['reason']}, p_adj {weak_p_adj:.2g}" for v in weak_verdicts]
            row["reason"] = "; ".join(fired)
            row["note"] = "; ".join(dict.fromkeys(notes))
            rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    first = [*keys, "policy", "budget", "too_restrictive", "too_weak", "n_seeds"]
    table = table[first + [c for c in table.columns if c not in first]]
    table = table.iloc[canonical_order(table, keys)].reset_index(drop=True)
    table.attrs.update(level=level, min_seeds=needed, restrictive_margin=restrictive_margin, weak_share=weak_share,
                       adjust=adjust, by=keys, questions=questions)
    return table


def smallest_p_adj(questions: int, smallest_p: float, adjust: str) -> float:
    """The smallest adjusted p a family of ``questions`` tests, each at best ``smallest_p``, can reach.

    Holm multiplies the smallest p by the family's size; BH and no adjustment leave it. A flag
    needs it below ``1 - level``; where it is not, no data of these seeds can raise that flag,
    and the command line says so instead of "no arm flagged".
    """
    return min(1.0, questions * smallest_p) if adjust == "holm" else smallest_p


def _count_questions(questions: dict[str, tuple[int, int, float]], judged: list,
                     tests: dict[str, tuple[np.ndarray, bool]]) -> None:
    """Record one context's family sizes, seed counts and smallest p in ``questions`` (the largest
    family, the most seeds and the smallest p so far): ``tests`` maps a kind of flag to its
    p-values and whether they are two-sided."""
    seeds = max((row["n_seeds"] for row, *_ in judged), default=0)
    for kind, (p, two_sided) in tests.items():
        m = int(np.isfinite(p).sum())
        if m:
            smallest = min_achievable_pvalue(seeds) / (1.0 if two_sided else 2.0)
            m_so_far, seeds_so_far, p_so_far = questions[kind]
            questions[kind] = (max(m_so_far, m), max(seeds_so_far, seeds), min(p_so_far, smallest))


class _Judge:
    """One question each: the interval's verdict (``candidate``) and the raw sign-flip ``p``."""

    def __init__(self, settings: AnalysisSettings) -> None:
        self.settings = settings
        self.level, self.reps, self.seed, self.needed = settings.level, settings.reps, settings.seed, settings.needed
        # A ratio of means has no sign-flip inversion: its interval is a bootstrap (percentile
        # unless BCa is asked for).
        self.ratio_method = "BCa" if settings.method == "BCa" else "percentile"

    def restrictive(self, arms: dict, policy: str, budget: float, outcome: str, margin: float,
                    prefix: dict[str, Any]) -> dict[str, Any]:
        treated, control = arm_seeds(arms, policy, budget), arm_seeds(arms, NO_REPLAY, None)
        shared = sorted(treated.keys() & control.keys(), key=str)
        n = len(shared)
        verdict = {"n": n, "mean": math.nan, "high": math.nan, "p": math.nan, "candidate": False,
                   "reason": "", "note": ""}
        if not control:
            verdict["note"] = "not judged: no none in this context"
            return verdict
        a = np.array([treated[s] for s in shared])
        b = np.array([control[s] for s in shared])
        if n:
            verdict["mean"] = float((a - b).mean())
        if n < self.needed:
            verdict["note"] = f"not judged: {n} seeds paired with none < {self.needed}"
            return verdict
        rng = row_rng(self.seed, "restrictive", outcome, *prefix.values(), policy, budget)
        low, high = paired_interval(SignFlip(a - b, rng=rng), 1.0 - self.level, method=self.settings.method,
                                    reps=self.reps, rng=rng)
        verdict["high"] = high
        threshold = -margin * abs(float(b.mean()))
        shifted = a - b - threshold
        # One-sided question (a drop): a rise gets p = 1, so it never uses up the family's level.
        verdict["p"] = sign_flip_pvalue(shifted, rng=rng) if shifted.mean() < 0 else 1.0
        if high < threshold:
            verdict["candidate"] = True
            verdict["reason"] = (f"too restrictive: {outcome} below none's by {verdict['mean']:+.3g} "
                                 f"[{low:.3g}, {high:.3g}]")
        return verdict

    def weak(self, arms: dict, policy: str, budget: float, outcome: str, weak_share: float,
             prefix: dict[str, Any]) -> dict[str, Any]:
        treated, none, full = arm_seeds(arms, policy, budget), arm_seeds(arms, NO_REPLAY, None), arm_seeds(arms, FULL_REPLAY, None)
        shared = sorted(treated.keys() & none.keys() & full.keys(), key=str)
        verdict = {"share": math.nan, "high": math.nan, "p": math.nan, "candidate": False, "reason": "", "note": ""}
        if not none or not full:
            verdict["note"] = "too weak not judged: needs none and full in this context"
            return verdict
        if len(shared) < self.needed:
            verdict["note"] = f"too weak not judged: {len(shared)} seeds with none and full < {self.needed}"
            return verdict
        sign = -1.0 if HIGHER_IS_BETTER.get(outcome) is True else 1.0  # reduction = none - arm for lower-is-better
        reduction = sign * np.array([none[s] - treated[s] for s in shared])
        full_reduction = sign * np.array([none[s] - full[s] for s in shared])
        if full_reduction.mean() <= 0:
            verdict["note"] = f"too weak not judged on {outcome}: full does not improve it over none here"
            return verdict
        rng = row_rng(self.seed, "weak", outcome, *prefix.values(), policy, budget)
        share, low, high = ratio_of_means_ci(reduction, full_reduction, level=self.level, reps=self.reps,
                                             rng=rng, method=self.ratio_method)
        verdict.update(share=share, high=high)
        margin_units = self.settings.margins.get(outcome)
        if margin_units:
            return self._equivalent_to_none(verdict, reduction, outcome, margin_units, rng)
        margin = reduction - weak_share * full_reduction  # share < weak_share <=> mean(margin) < 0
        verdict["p"] = sign_flip_pvalue(margin, rng=rng) if margin.mean() < 0 else 1.0
        if high < weak_share:
            verdict["candidate"] = True
            verdict["reason"] = (f"too weak: {share:.1%} [{low:.1%}, {high:.1%}] of full's {outcome} "
                                 f"reduction (< {weak_share:.0%})")
        return verdict

    def _equivalent_to_none(self, verdict: dict[str, Any], reduction: np.ndarray, outcome: str, margin: float,
                            rng: np.random.Generator) -> dict[str, Any]:
        """With a margin for ``outcome``: too weak when TOST shows ``|arm - none| < margin``."""
        verdict["p"] = SignFlip(reduction, rng=rng).tost(margin)
        if verdict["p"] < 1.0 - self.level:
            verdict["candidate"] = True
            verdict["reason"] = (f"too weak: {outcome} within ±{margin:g} of none's (reduction "
                                 f"{reduction.mean():+.3g}, equivalence p {verdict['p']:.2g})")
        return verdict


def flags_text(flags: pd.DataFrame, width: int = 100) -> list[str]:
    """The flags that fired, or why none could: the lines of the flags section."""
    if flags.empty:
        return ["no arms to judge"]
    fired = flags[flags["too_restrictive"] | flags["too_weak"]]
    keys = list(flags.attrs.get("by", []))
    alpha = 1.0 - flags.attrs["level"]
    lines = []
    asked = {kind: counts for kind, counts in flags.attrs["questions"].items() if counts[0]}
    unreachable = {kind: smallest_p_adj(questions, smallest, flags.attrs["adjust"])
                   for kind, (questions, _, smallest) in asked.items()}
    unreachable = {kind: best for kind, best in unreachable.items() if best >= alpha}
    why = ", ".join(f"a '{kind}' question {best:.2g} ({asked[kind][0]} questions, each at best p "
                    f"{asked[kind][2]:.2g})" for kind, best in unreachable.items())
    seeds = max((counts[1] for counts in asked.values()), default=0)
    if not fired.empty:
        lines.append(fit(fired[[*keys, "policy", "budget", "reason"]], width))
    elif unreachable and len(unreachable) == len(asked):
        lines += textwrap.wrap(
            f"no flag can be reached at these seeds ({seeds} paired with none): after {flags.attrs['adjust']} "
            f"over the questions of a context, the smallest p_adj is for {why}; a flag needs it below "
            f"{alpha:.2g}, so more seeds, or fewer arms per context, are needed before an arm can be flagged", width)
    else:
        lines.append("no arm flagged as too restrictive or too weak")
    if unreachable and (not fired.empty or len(unreachable) < len(asked)):
        lines += textwrap.wrap(f"at these seeds some flags cannot be reached: the smallest p_adj is for {why}, "
                               f"not below {alpha:.2g}", width)
    unjudged = flags["note"][flags["note"] != ""]
    if not unjudged.empty:
        lines += textwrap.wrap(f"{len(unjudged)} of {len(flags)} arms not fully judged, e.g. {unjudged.iloc[0]}",
                               width)
    return lines
