"""Cost of counterfactual probes on the synthetic backend: one probe pass against one training step.

One cell runs with probes on every step; the CPU time of each step and of its probe passes
(``score_probes``, timed where the step calls it) come from the same run, so the ratio does not
depend on how busy the machine is. From the ratio ``c`` (one probe's pass over one training step
without probes) the overhead of ``P`` probes every ``k`` steps is ``P c / k`` of the cell's time;
the script prints it for the default ``probe_every`` and the smallest ``probe_every`` that keeps
it at or below 10%.

    python bench/bench_probes.py [--steps 20] [overrides ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from hydra import compose, initialize_config_module

import ablate.backends.synthetic as synthetic
from ablate.compose import cell_from_config
from ablate.config import AppConfig

SIX = "[none,full,random@0.25,uniform@0.25,fisher@0.25,mismatch@0.25]"
TARGET = 0.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. backend=synthetic_offpolicy policy=mismatch budget=0.25")
    args = parser.parse_args()
    with initialize_config_module("ablate.conf", version_base="1.3"):
        cfg = compose("config", overrides=["policy=none", f"backend.steps={args.steps}", f"probes={SIX}", "probe_every=1",
                                           *args.overrides])
    cell = cell_from_config(cfg)
    probe_seconds: list[float] = []
    score = synthetic.score_probes

    def timed_probes(*a, **k):
        start = time.process_time()
        try:
            return score(*a, **k)
        finally:
            probe_seconds.append(time.process_time() - start)

    step_seconds: list[float] = []
    last = [time.process_time()]

    def log_step(step: int, record: dict[str, float]) -> None:
        now = time.process_time()
        step_seconds.append(now - last[0])
        last[0] = now

    synthetic.score_probes = timed_probes
    try:
        synthetic.run_cell_steps(cell, log_step)
    finally:
        synthetic.score_probes = score
    # The first step pays for warm-up; medians of the rest.
    probes = len(cell.probes)
    training = [s - p for s, p in zip(step_seconds[1:], probe_seconds[1:])]
    per_probe = [p / probes for p in probe_seconds[1:]]
    step, probe = statistics.median(training), statistics.median(per_probe)
    ratio = probe / step
    default_every = AppConfig.probe_every
    print(f"{cell.backend.regime} regime, {args.steps} steps, {probes} probes on every step (CPU seconds, medians "
          f"of steps 1..{args.steps - 1})")
    print(f"  training step without probes: {step:.3f} s; one probe pass: {probe:.3f} s; ratio {ratio:.3f}")
    for count in (6, 18):
        smallest = math.ceil(count * ratio / TARGET)
        print(f"  {count:2d} probes: overhead {count * ratio / default_every:.1%} at the default probe_every="
              f"{default_every}; probe_every >= {smallest} keeps it <= {TARGET:.0%}")


if __name__ == "__main__":
    main()
