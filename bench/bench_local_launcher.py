"""ablate's local launcher (``hydra/launcher=joblib``) next to Hydra's joblib launcher, measured in one run.

Both run the same grid of short noop cells on two worker processes through ablate's grid sweeper:
- ablate: ``hydra/launcher=joblib hydra.launcher.n_jobs=2``, which is ablate's own pool
  (``ablate/launchers/pool.py``);
- joblib: the same, with ``hydra.launcher._target_`` pointed at Hydra's joblib launcher (loky), as
  the sweeper called it before ablate had its own (needs hydra-joblib-launcher installed).
Each grid runs once as one launch, and once in launches of two cells (``hydra.sweeper.max_batch_size=2``,
as an Optuna study with ``n_jobs=2`` launches its trials), where a pool that keeps its workers
between launches pays their start once. The two commands run in turn, ``--repeats`` pairs, and
the figures are medians: of each command's wall time, and of the ratio pair by pair (which holds
when the machine's speed drifts).

    python bench/bench_local_launcher.py [--cells 12] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench_sweep_overhead import timed

JOBLIB = "hydra.launcher._target_=hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "WANDB_SILENT": "true"}

        def grid(*extra: str) -> list[str]:
            return [sys.executable, "-m", "ablate", "-m", "backend=noop", "policy=none", f"seed=range({args.cells})",
                    "backend.steps=2", "tracking.mode=disabled", f"sweep=bench-{time.monotonic_ns()}",
                    f"store_dir={out}/runs", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *extra]

        for batches, extra in (("one launch", []), ("launches of 2", ["hydra.sweeper.max_batch_size=2"])):
            pairs = [(timed(grid(*extra), env), timed(grid(*extra, JOBLIB), env)) for _ in range(args.repeats)]
            ablate = statistics.median(a for a, _ in pairs)
            joblib = statistics.median(j for _, j in pairs)
            ratio = statistics.median(a / j for a, j in pairs)
            print(f"{args.cells} cells, {batches:<14} ablate {ablate:6.2f} s   Hydra's joblib {joblib:6.2f} s   "
                  f"ratio (median of pairs) {ratio:.2f}")


if __name__ == "__main__":
    main()
