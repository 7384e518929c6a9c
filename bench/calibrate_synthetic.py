"""Calibration of a synthetic-backend regime: mismatch, reward curve and collapse, per policy.

Runs the regime's cells (``none`` and ``full`` by default) for a few seeds, one process per cell,
and prints per policy the means over steps and seeds of the figures real systems report (route
and token mismatch, train-inference ``kl_k3``, extreme-token fraction, clip fraction), the reward
curve (mean reward in five equal windows of steps), the final expert drift, the final reward
over seeds (mean, min, max), the reward AUC, how many seeds
collapsed (``ablate.outcomes``: relative to chance-level reward) and the CPU seconds
per cell. Then the paired differences of final reward and reward AUC between the first two
policies, with exact sign-flip p-values. The calibration tables of the docs' results pages come from here.

    python bench/calibrate_synthetic.py --seeds 4 backend=synthetic_offpolicy
    python bench/calibrate_synthetic.py --seeds 3 --steps 100 backend.router_perturbation=0.3
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pandas as pd

KEYS = {
    "route mm": "routing/route_mismatch_rate", "token mm": "routing/token_mismatch_rate", "kl_k3": "mismatch/kl_k3",
    "extreme": "mismatch/extreme_token_frac", "clip": "train/clip_frac",
}
WINDOWS = 5


def run_cell(overrides: list[str]) -> tuple[pd.DataFrame, float]:
    """One cell's per-step records and the CPU seconds it took (composing the config excluded)."""
    from hydra import compose, initialize_config_module

    from ablate.backends.synthetic import run_cell_steps
    from ablate.compose import cell_from_config

    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cell = cell_from_config(compose("config", overrides=overrides))
    records: list[dict[str, float]] = []
    start = time.process_time()
    run_cell_steps(cell, lambda step, record: records.append({"step": step, **record}))
    return pd.DataFrame(records), time.process_time() - start


def summarize(runs: list[tuple[pd.DataFrame, float]]) -> dict[str, object]:
    from ablate.outcomes import cell_outcomes

    frames = [frame for frame, _ in runs]
    outcomes = [cell_outcomes(frame) for frame in frames]
    curves = np.array([[w.mean() for w in np.array_split(f["train/reward"].to_numpy(), WINDOWS)] for f in frames])
    row: dict[str, object] = {name: float(np.mean([f[key].mean() for f in frames])) for name, key in KEYS.items()}
    row["reward curve"] = " ".join(f"{x:.2f}" for x in curves.mean(0))
    final = np.array([o["final_reward"] for o in outcomes])
    row["final"] = f"{final.mean():.3f} [{final.min():.2f}, {final.max():.2f}]"
    row["drift"] = float(np.mean([o["expert_drift_final"] for o in outcomes]))
    auc = np.array([o["reward_auc"] for o in outcomes])
    row["auc"] = float(auc.mean())
    row["collapsed"] = f"{int(sum(o['collapsed'] for o in outcomes))}/{len(outcomes)}"
    row["cpu s/cell"] = float(np.mean([cpu for _, cpu in runs]))
    row["_final_reward"], row["_reward_auc"] = final, auc
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="backend.steps (default: the regime's)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--policies", default="none,full", help="comma-separated, e.g. none,full,mismatch")
    parser.add_argument("--budget", type=float, default=0.25, help="budget of the budgeted policies")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. backend=synthetic_async backend.rollout_lag=2")
    args = parser.parse_args()
    policies = args.policies.split(",")
    extra = [f"backend.steps={args.steps}"] if args.steps else []
    cells = [
        (policy, [*args.overrides, *extra, f"policy={policy}", f"seed={seed}",
                  *([] if policy in ("none", "full") else [f"budget={args.budget}"])])
        for policy in policies for seed in range(args.first_seed, args.first_seed + args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run_cell, [overrides for _, overrides in cells]))
    rows = {policy: summarize([r for (p, _), r in zip(cells, results) if p == policy]) for policy in policies}
    table = pd.DataFrame(rows).T
    print(" ".join(args.overrides) or "(defaults)", f"| {args.seeds} seeds")
    print(table.drop(columns=["_final_reward", "_reward_auc"]).to_string(float_format=lambda x: f"{x:.3g}"))
    if len(policies) >= 2:
        from ablate.analysis.stats import sign_flip_pvalue

        a, b = policies[1], policies[0]
        for outcome in ("final_reward", "reward_auc"):
            difference = rows[a][f"_{outcome}"] - rows[b][f"_{outcome}"]  # type: ignore[operator]
            print(f"{outcome} {a} - {b}: {difference.mean():+.3f} (per seed: "
                  f"{' '.join(f'{d:+.2f}' for d in difference)}), sign-flip p = {sign_flip_pvalue(difference):.3g}")


if __name__ == "__main__":
    main()
