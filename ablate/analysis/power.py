"""Power and seed planning for the exact sign-flip test, from a pilot sweep.

Every number here is the power of the test the tables use (two-sided sign-flip, exact up to 16
seeds), computed by simulation, never by a normal formula: at few seeds the test is discrete
(2 / 2**n is its smallest p), and a normal formula promises power where the test has none.

**Model.** Paired differences are drawn normal with the row's paired standard deviation
``sd_diff`` and a mean ``delta``; the test is scale-free, so power depends on the standardized
effect ``delta / sd_diff``, the seed count ``n`` and the level ``alpha`` the row is tested at.
Draws are common random numbers (one ``(samples, n)`` array per seed count), so power is a
smooth, reproducible function of the effect.

**The row's level.** A row of a family of ``m`` tests under Holm (or BH) is planned at
``alpha / m``: Holm's first step, the level one true effect among nulls must clear. A row of
primary gate ``k`` is planned at ``alpha / m_k`` of its gate, assuming the earlier gates pass.
Without adjustment, ``alpha``.

Functions are pure over numbers; :func:`plan` takes an effect table (``ablate.analysis.effects``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ablate.analysis.signflip import row_pvalues
from ablate.analysis.stats import min_achievable_pvalue

#: Power a plan asks for.
TARGET_POWER = 0.8
#: The largest seed count a plan searches (beyond it "more than 64" is the answer).
MAX_SEEDS = 64
SAMPLES = 1000


@lru_cache(maxsize=4096)
def _null_draws(n: int, samples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(n,))).standard_normal((samples, n))


def power(standardized_effect: float, n: int, alpha: float, *, samples: int = SAMPLES, seed: int = 0) -> float:
    """Power of the two-sided exact sign-flip test at ``alpha`` with ``n`` paired seeds.

    ``standardized_effect`` is ``delta / sd_diff``; differences are simulated normal
    (``samples`` draws, common random numbers from ``seed``). 0 when ``2 / 2**n >= alpha``:
    such a test can never reject.
    """
    if n < 1 or min_achievable_pvalue(n) >= alpha:
        return 0.0
    return int(np.count_nonzero(_pvalues(n, abs(standardized_effect), samples, seed) < alpha)) / samples


@lru_cache(maxsize=4096)
def _pvalues(n: int, effect: float, samples: int, seed: int) -> np.ndarray:
    """The simulated rows' p-values at this effect, whatever the level: the searches of the
    detectable effect at different levels try the same effects first, and share them here."""
    draws = _null_draws(n, samples, seed) + effect
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(n, 1)))
    return row_pvalues(draws, rng=rng)


def min_detectable_effect(n: int, alpha: float, *, target: float = TARGET_POWER, samples: int = SAMPLES,
                          seed: int = 0) -> float:
    """Smallest standardized effect with power >= ``target`` at ``n`` seeds (inf when none is).

    Bisection over the effect to 0.01 standard deviations, on the common random numbers of
    :func:`power`; the answer is the upper end of the final bracket.
    """
    return _mde(n, round(alpha, 15), target, samples, seed)


@lru_cache(maxsize=1024)
def _mde(n: int, alpha: float, target: float, samples: int, seed: int) -> float:
    high = 12.0
    if power(high, n, alpha, samples=samples, seed=seed) < target:
        return math.inf
    low = 0.0
    while high - low > 0.01:
        middle = 0.5 * (low + high)
        if power(middle, n, alpha, samples=samples, seed=seed) >= target:
            high = middle
        else:
            low = middle
    return high


def seeds_needed(standardized_effect: float, alpha: float, *, target: float = TARGET_POWER, start: int = 2,
                 max_seeds: int = MAX_SEEDS, samples: int = SAMPLES, seed: int = 0) -> int | None:
    """Fewest seeds (from ``start``) whose minimum detectable effect at ``alpha`` is at most this effect.

    That is the fewest seeds with power ``target`` at this effect, read from the minimum detectable
    effect of each seed count (:func:`min_detectable_effect`, to 0.01 standard deviations: an
    effect within 0.01 above a count's may be given one count more than a simulation at the effect
    itself would). The detectable effects depend on the seed count and the level only, so they are
    simulated once per count and level and shared by every row of every table: planning 2,000
    rows costs what planning one does. ``None`` when even ``max_seeds`` do not reach it (or the
    effect is 0). The detectable effect shrinks as seeds are added (up to the discreteness of the
    exact test), so the count is found by bisection over counts.
    """
    effect = abs(standardized_effect)
    if not effect > 0 or not math.isfinite(effect):
        return None
    low = max(start, 2)
    while min_achievable_pvalue(low) >= alpha:  # below this count the test cannot reject at all
        low += 1
    if low > max_seeds:
        return None

    def enough(count: int) -> bool:
        return min_detectable_effect(count, alpha, target=target, samples=samples, seed=seed) <= effect

    if not enough(max_seeds):
        return None
    high = max_seeds  # enough(high) holds; find the first count of the bracket [low, high] that does
    while low < high:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle + 1
    return high


def row_alpha(table: pd.DataFrame, alpha: float) -> pd.Series:
    """The level each row of an effect table is planned at (module doc): alpha over its family's size."""
    adjust = table.attrs.get("adjust", "holm")
    sizes = table.groupby("family")["p_value"].transform(lambda p: int(p.notna().sum()))
    return alpha / sizes.clip(lower=1) if adjust != "none" else pd.Series(alpha, index=table.index)


def plan(effect_table: pd.DataFrame, *, detect: float | None = None, target: float = TARGET_POWER,
         seed: int = 0, rows: Sequence[Any] | None = None) -> pd.DataFrame:
    """Per effect row: paired sd, the minimum detectable effect now, and the seeds needed.

    Columns: ``effect``, ``policy``, ``baseline``, ``budget``, ``pooled`` (and the arm keys),
    ``family``, ``n_seeds``, ``sd_diff``, ``alpha_row`` (the level planned at), ``mde`` (minimum
    detectable effect at ``n_seeds`` with power ``target``, in the outcome's units),
    ``mean`` (the observed effect), ``seeds_for_observed`` (seeds needed to detect an effect
    as large as the observed one), and with ``detect`` (an effect size in the outcome's units)
    ``detect`` and ``seeds_for_detect``. A seed count of NaN means more than
    :data:`MAX_SEEDS` (or no effect to detect). ``rows`` (index labels of ``effect_table``)
    plans those rows only, each still at its whole family's level: what the verdict needs, at a
    fraction of the simulations.
    """
    alpha = 1.0 - float(effect_table.attrs.get("level", 0.95))
    keys = list(effect_table.attrs.get("by", []))
    out = effect_table[[*keys, "effect", "policy", "baseline", "budget", "pooled", "family", "n_seeds",
                        "sd_diff", "mean"]].copy()
    out["alpha_row"] = row_alpha(effect_table, alpha)
    if rows is not None:
        out = out.loc[list(rows)]
    mde, observed, wanted = [], [], []
    for row in out.itertuples(index=False):
        sd, n, level = float(row.sd_diff), int(row.n_seeds), float(row.alpha_row)
        if not (sd > 0 and np.isfinite(level)):
            mde.append(math.nan), observed.append(math.nan), wanted.append(math.nan)
            continue
        mde.append(min_detectable_effect(n, level, target=target, seed=seed) * sd)
        observed.append(_count(seeds_needed(float(row.mean) / sd, level, target=target, seed=seed)))
        wanted.append(_count(seeds_needed(detect / sd, level, target=target, seed=seed)) if detect else math.nan)
    out["mde"], out["seeds_for_observed"] = mde, observed
    if detect:
        out["detect"], out["seeds_for_detect"] = detect, wanted
    out.attrs.update(effect_table.attrs, target_power=target)
    return out


def _count(n: int | None) -> float:
    return math.nan if n is None else float(n)


def extension_command(sweep: str, seeds: int, policies: Sequence[str] = ()) -> str:
    """The command that runs sweep ``sweep`` with ``seeds`` seeds, only for ``policies`` when given.

    The run store skips complete cells, so only the new seeds run; limiting the policies to those
    the planned rows compare (``none,full`` for the replay effect) spends nothing on the others.
    """
    arms = f" policy={','.join(policies)}" if policies else ""  # a command-line axis replaces the file's
    return f"python -m ablate sweeps={sweep}{arms} 'seed=range({seeds})'"


def seeds_to_run(plans: Mapping[str, pd.DataFrame], rows: Mapping[str, pd.Series]) -> int | None:
    """The largest finite seed count asked for by the selected rows of each outcome's plan."""
    counts = []
    for outcome, table in plans.items():
        column = "seeds_for_detect" if "seeds_for_detect" in table.columns else "seeds_for_observed"
        counts += [float(v) for v in table.loc[rows[outcome], column] if np.isfinite(v)]
    return int(max(counts)) if counts else None
