"""Simulated error rates of the analysis' statistics at 6, 10 and 20 seeds (docs/statistics.md).

    python bench/bench_statistics.py            # about an hour on one core
    python bench/bench_statistics.py --quick    # a tenth of the samples, for a smoke check

Prints, on null and planted frames of seed-paired differences:

1. coverage of each interval kind (paired: percentile bootstrap, Student's t, the inverted
   sign-flip test; one arm: percentile bootstrap, t) on normal and skewed (lognormal) values,
   and how often an interval excludes 0 where the exact test does not reject;
2. the family-wise error of the primary procedure (serial gatekeeping) on effect tables of
   simulated sweeps, against Holm over the whole default family;
3. the power of the exact test at raw alpha, alpha/8 and alpha/17 (the issue's table);
4. the equivalence test's (TOST) error: claiming equivalence when the effect sits on the
   margin, and its power when the effect is 0;
5. the error of the sequential e-process under repeated looks, against fixed-n p-values read
   at every look.

Every number comes from the functions the tables use; each block has its own seeded generator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ablate.analysis.power import power  # noqa: E402
from ablate.analysis.sequential import e_values  # noqa: E402
from ablate.analysis.signflip import SignFlip, t_interval  # noqa: E402
from ablate.analysis.stats import bootstrap_ci  # noqa: E402
from ablate.analysis.tables import effects  # noqa: E402

SEEDS = (6, 10, 20)
ALPHA = 0.05


def coverage(samples: int) -> None:
    print("\n## 1. interval coverage (nominal 0.95) and agreement with the exact test\n")
    print("| values | effect | n | paired percentile | paired t | paired sign-flip | one-arm percentile | one-arm t "
          "| percentile excludes 0, test does not |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in ("normal", "lognormal"):
        for effect in (0.0, 1.0):
            for n in SEEDS:
                rng = np.random.default_rng([1, n, int(effect), shape == "normal"])
                hits = {k: 0 for k in ("pct", "t", "flip", "arm_pct", "arm_t")}
                disagree = 0
                for _ in range(samples):
                    if shape == "normal":
                        noise = rng.standard_normal(n)
                    else:  # symmetric for the paired difference (exchangeable arms), skewed for one arm
                        noise = rng.lognormal(0.0, 1.0, n) - rng.lognormal(0.0, 1.0, n)
                    d = effect + noise
                    arm = rng.lognormal(0.0, 1.0, n) if shape == "lognormal" else rng.standard_normal(n)
                    arm_mean = float(np.exp(0.5)) if shape == "lognormal" else 0.0
                    low, high = bootstrap_ci(d, reps=1000, rng=rng)
                    hits["pct"] += low <= effect <= high
                    excludes = low > 0 or high < 0
                    low, high = t_interval(d)
                    hits["t"] += low <= effect <= high
                    test = SignFlip(d, rng=rng)
                    low, high = test.interval(ALPHA)
                    hits["flip"] += low <= effect <= high
                    disagree += excludes and not test.pvalue() < ALPHA
                    low, high = bootstrap_ci(arm, reps=1000, rng=rng)
                    hits["arm_pct"] += low <= arm_mean <= high
                    low, high = t_interval(arm)
                    hits["arm_t"] += low <= arm_mean <= high
                cells = " | ".join(f"{hits[k] / samples:.3f}" for k in ("pct", "t", "flip", "arm_pct", "arm_t"))
                print(f"| {shape} | {effect:g} | {n} | {cells} | {disagree / samples:.3f} |", flush=True)


def sweep_frame(rng: np.random.Generator, n: int, replay: float, selection: float) -> pd.DataFrame:
    """A simulated sweep: none, full, random and fisher at 3 budgets; seed offsets shared by all arms."""
    offsets = rng.normal(size=n)
    cells = [("none", 0.0, 0.0), ("full", 1.0, replay)]
    for b in (0.1, 0.25, 0.5):
        cells += [("random", b, 0.0), ("uniform", b, 0.0), ("fisher", b, selection)]
    rows = [{"policy": p, "budget": b, "seed": s, "final_reward": offsets[s] + mu + rng.normal()}
            for p, b, mu in cells for s in range(n)]
    return pd.DataFrame(rows)


def family_wise_error(samples: int) -> None:
    print("\n## 2. family-wise error of the primary procedure (alpha 0.05)\n")
    primary = ("replay", "selection:fisher:random@pooled", "selection:fisher:random")
    print(f"primary gates: {', '.join(primary)}; each cell value = seed offset + planted mean + N(0, 1) noise. "
          "Error: any true null claimed among the primary rows (the primary procedure) or among the "
          "per-budget family (the default, Holm over that family)\n")
    print("| planted | n | primary: any false claim | primary: replay claimed | default per-budget family: "
          "any false claim | default: replay claimed |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, replay in (("nothing", 0.0), ("replay +1.5", 1.5)):
        for n in SEEDS:
            rng = np.random.default_rng([2, n, int(replay * 10)])
            counts = {"primary": [0, 0], "default": [0, 0]}
            for i in range(samples):
                df = sweep_frame(rng, n, replay, 0.0)
                for name, table in (("primary", effects(df, primary=primary, seed=i, min_seeds=n + 1)),
                                    ("default", effects(df, seed=i, min_seeds=n + 1))):
                    family = (table["family"].str.startswith("primary") if name == "primary"
                              else table["family"] == "exploratory per-budget")
                    nulls = family & (table["effect"] != "replay") if replay else family
                    counts[name][0] += bool((table.loc[nulls, "p_adj"] < ALPHA).any())
                    counts[name][1] += bool((table.loc[table["effect"] == "replay", "p_adj"] < ALPHA).any())
            cells = " | ".join(f"{counts[k][j] / samples:.3f}" for k in ("primary", "default") for j in (0, 1))
            print(f"| {label} | {n} | {cells} |", flush=True)


def power_table(samples: int) -> None:
    print("\n## 3. power of the exact sign-flip test (two-sided)\n")
    print("| n | d | alpha 0.05 | 0.05/8 | 0.05/17 |")
    print("|---:|---:|---:|---:|---:|")
    for n, effect in ((6, 1.0), (6, 2.0), (10, 1.0), (10, 2.0), (20, 0.5), (20, 1.0)):
        cells = " | ".join(f"{power(effect, n, a, samples=samples):.2f}" for a in (ALPHA, ALPHA / 8, ALPHA / 17))
        print(f"| {n} | {effect:g} | {cells} |", flush=True)


def equivalence(samples: int) -> None:
    print("\n## 4. equivalence (TOST, margin 0.5 sd, alpha 0.05)\n")
    print("| n | claims equivalence at effect = margin (error) | at effect = 1.5 margin | at effect 0 (power) |")
    print("|---:|---:|---:|---:|")
    margin = 0.5
    for n in SEEDS:
        rng = np.random.default_rng([4, n])
        rates = []
        for effect in (margin, 1.5 * margin, 0.0):
            claims = sum(SignFlip(effect + rng.standard_normal(n), rng=rng).tost(margin) < ALPHA
                         for _ in range(samples))
            rates.append(claims / samples)
        print(f"| {n} | {rates[0]:.3f} | {rates[1]:.3f} | {rates[2]:.3f} |", flush=True)


def sequential(samples: int) -> None:
    print("\n## 5. repeated looks: a look after every 2 seeds from 6 to 20 (8 looks)\n")
    print("| effect | fixed-n p < 0.05 at any look | fixed-n at 20 seeds only | e-process >= 20 at any look |")
    print("|---:|---:|---:|---:|")
    looks = range(6, 21, 2)
    for effect in (0.0, 1.0):
        rng = np.random.default_rng([5, int(effect)])
        any_fixed = last_fixed = any_e = 0
        for _ in range(samples):
            d = effect + rng.standard_normal(20)
            p = [SignFlip(d[:t], rng=rng).pvalue() for t in looks]
            any_fixed += min(p) < ALPHA
            last_fixed += p[-1] < ALPHA
            any_e += bool((e_values(d)[5:] >= 1 / ALPHA).any())
        print(f"| {effect:g} | {any_fixed / samples:.3f} | {last_fixed / samples:.3f} | {any_e / samples:.3f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the samples")
    parser.add_argument("--only", type=int, action="append", choices=range(1, 6), metavar="BLOCK",
                        help="run only these blocks (1-5), repeatable; each block's numbers do not depend on the others")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    blocks = {1: (coverage, 2000), 2: (family_wise_error, 1000), 3: (power_table, 4000), 4: (equivalence, 4000),
              5: (sequential, 2000)}
    start = time.perf_counter()
    for block in args.only or sorted(blocks):
        run, samples = blocks[block]
        run(samples // scale)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
