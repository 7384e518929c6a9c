"""Per-cell overhead of an ablate sweep next to a bare Hydra multirun, measured in one run.

Both run a grid of cells whose job does no work, with Hydra's in-process launcher:
- bare: a Hydra app with an empty task function (bench/bare_app);
- ablate: ``python -m ablate -m backend=noop ...`` (config validation, grid planning, run store
  writes, W&B offline run per cell, progress polling).
Per-cell overhead is the slope ``(T(n_large) - T(n_small)) / (n_large - n_small)``, which removes
process start-up (interpreter, imports, Ray-free Hydra set-up) from both.

    python bench/bench_sweep_overhead.py [--small 4] [--large 24] [--tracking offline]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def bare_command(cells: int) -> list[str]:
    """A bare Hydra multirun of ``cells`` jobs that do nothing (its outputs go under ``$BENCH_OUT``)."""
    return [sys.executable, str(HERE / "bare_app" / "app.py"), "-m", f"seed=range({cells})"]


def ablate_command(cells: int, out: str, tracking: str) -> list[str]:
    """An ablate multirun of ``cells`` cells of the ``noop`` backend, in a sweep of its own under ``out``."""
    return [sys.executable, "-m", "ablate", "-m", "backend=noop", "policy=none", f"seed=range({cells})",
            f"sweep=bench-{time.monotonic_ns()}", f"store_dir={out}/runs", f"tracking.mode={tracking}",
            "hydra.sweeper.progress_interval=0.5"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--large", type=int, default=24)
    parser.add_argument("--tracking", default="offline", choices=["offline", "disabled"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "BENCH_OUT": out, "WANDB_SILENT": "true"}

        def ablate(n: int) -> list[str]:
            return ablate_command(n, out, args.tracking)

        slopes = {}
        for label, command in (("bare Hydra", bare_command), ("ablate", ablate)):
            small = min(timed(command(args.small), env) for _ in range(args.repeats))
            large = min(timed(command(args.large), env) for _ in range(args.repeats))
            slopes[label] = (large - small) / (args.large - args.small)
            print(f"{label:<12} {args.small} cells {small:6.2f} s   {args.large} cells {large:6.2f} s   "
                  f"per cell {slopes[label] * 1e3:7.1f} ms")
    extra = slopes["ablate"] - slopes["bare Hydra"]
    print(f"ablate's per-cell overhead above bare Hydra (tracking={args.tracking}): {extra * 1e3:.1f} ms "
          f"(target: at most 300 ms); ratio {slopes['ablate'] / slopes['bare Hydra']:.1f}x")


if __name__ == "__main__":
    main()
