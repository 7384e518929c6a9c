"""Looking after every batch of seeds without inflating the error: a sign-flip e-process.

Shape convention: ``d`` is a 1-D array of seed-paired differences **in the order the seeds were
run** (the first batch first); the functions return one value per prefix ``d[:t]``.

**The e-process.** The null of the exact test is that each difference is symmetric about 0
given the seeds before it. Then any bounded *odd* function ``f_t`` of ``d_t`` whose scale is
fixed by the earlier seeds has conditional mean 0, and for every fixed bet ``lam`` in (-1, 1)
``prod_t (1 + lam * f_t)`` is a nonnegative martingale starting at 1. The e-value after ``t``
seeds is the average over a grid of bets (positive and negative, so two-sided), itself such a
martingale. Here ``f_t = clip(d_t / s_{t-1}, -1, 1)``, with ``s_{t-1}`` the largest ``|d|``
of the earlier seeds (the sign of ``d_1`` for the first seed).

By Ville's inequality the chance that the e-value *ever* reaches ``1 / alpha``, at any of
arbitrarily many looks, is at most ``alpha``: a researcher may add seeds batch by batch, look
after each batch, and stop when the e-value crosses ``1 / alpha`` (or never). A fixed-n p-value
read after each batch does not have that guarantee (its error grows with the number of looks;
docs/statistics.md has the simulation). The price is power: with a grid whose largest bet is
0.9, ``1 / alpha = 20`` cannot be reached before 8 agreeing seeds, and a planted effect
needs more seeds than the fixed-n test would.

**The confidence sequence** at ``mu``: the e-process of ``d - mu``; the set of ``mu`` whose
e-value stays below ``1 / alpha`` covers the true mean at every look at once with probability
``1 - alpha`` (for differences symmetric about their mean).
"""

from __future__ import annotations

import math

import numpy as np

#: Bets averaged over: -0.9..0.9 in steps of 0.1, without 0.
BETS = np.array([b for b in np.round(np.arange(-0.9, 0.91, 0.1), 10) if b != 0.0])


def e_values(d: np.ndarray, mu: float = 0.0) -> np.ndarray:
    """The e-value against "symmetric about ``mu``" after each seed: ``e[t - 1]`` uses ``d[:t]``."""
    x = np.asarray(d, dtype=float).ravel() - mu
    if x.size == 0:
        return np.ones(0)
    scale = np.maximum.accumulate(np.abs(x))
    previous = np.concatenate([[0.0], scale[:-1]])
    with np.errstate(divide="ignore", invalid="ignore"):
        bets = np.where(previous > 0, np.clip(x / previous, -1.0, 1.0), np.sign(x))
    wealth = np.cumprod(1.0 + BETS[:, None] * bets[None, :], axis=1)
    return wealth.mean(axis=0)


def confidence_sequence(d: np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds after each seed: the running intersection of ``{mu : e(mu) < 1/alpha}``.

    Bounds are found per look by bisection from the running mean; ``-inf``/``inf`` while no
    ``mu`` can be rejected yet.
    """
    x = np.asarray(d, dtype=float).ravel()
    lows, highs = np.full(x.size, -math.inf), np.full(x.size, math.inf)
    for t in range(1, x.size + 1):
        prefix = x[:t]
        center = float(prefix.mean())
        span = float(prefix.max() - prefix.min()) + float(np.abs(prefix).max()) + 1.0
        for side, far in ((0, center - 64 * span), (1, center + 64 * span)):
            if e_values(prefix, far)[-1] < 1.0 / alpha:
                continue  # nothing rejected on this side yet
            inside, outside = center, far
            for _ in range(80):
                middle = 0.5 * (inside + outside)
                if e_values(prefix, middle)[-1] < 1.0 / alpha:
                    inside = middle
                else:
                    outside = middle
            if side == 0:
                lows[t - 1] = inside
            else:
                highs[t - 1] = inside
    return np.maximum.accumulate(lows), np.minimum.accumulate(highs)
