"""Calibration of the synthetic backend: route mismatch and train-inference KL, none vs full.

Runs short cells of the synthetic backend for a few seeds and prints the mean over steps and
seeds of the figures real systems report (route and token mismatch rates) and of the
mismatch metrics that full replay should lower. The README's calibration table comes from here.

    python bench/calibrate_synthetic.py [--steps 60] [--seeds 3] [overrides ...]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from hydra import compose, initialize_config_module

from ablate.backends.synthetic import run_cell_steps
from ablate.cell import cell_from_config

KEYS = ("routing/route_mismatch_rate", "routing/token_mismatch_rate", "mismatch/kl_k3",
        "mismatch/extreme_token_frac", "mismatch/abs_logratio_max", "train/reward")


def measure(overrides: list[str], steps: int, seeds: int) -> tuple[dict[str, float], float]:
    values: dict[str, list[float]] = {key: [] for key in KEYS}
    start = time.perf_counter()
    for seed in range(seeds):
        with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, f"seed={seed}", f"backend.steps={steps}"])
        run_cell_steps(cell_from_config(cfg), lambda step, record: [values[k].append(record[k]) for k in KEYS])
    return {key: float(np.nanmean(v)) for key, v in values.items()}, (time.perf_counter() - start) / (steps * seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. backend.router_noise=0.05")
    args = parser.parse_args()
    print(f"{'policy':<8}" + "".join(f"{k.split('/')[1]:>22}" for k in KEYS) + f"{'s/step':>9}")
    for policy in ("none", "full"):
        means, per_step = measure([f"policy={policy}", *args.overrides], args.steps, args.seeds)
        print(f"{policy:<8}" + "".join(f"{means[k]:>22.4g}" for k in KEYS) + f"{per_step:>9.3f}")


if __name__ == "__main__":
    main()
