"""Mask selection plus all diagnostics, per policy, on a Qwen3-30B-A3B-shaped batch (CPU).

Prints, for each policy, the time of ``policy.select`` plus ``route_diagnostics`` next to the time
of one reduction pass over the same routes tensor, measured in this run, and their ratio; and the
peak extra memory of the policy step next to the size of the routes tensor.

The baseline is exactly ``torch.sum(routes)``. Summing an int16 tensor accumulates in int64 and can
take a slower path than a native-width reduction, so ``torch.sum(routes, dtype=torch.int64)`` is
printed too, with the ratios against it, so that neither reference flatters the result. Timings are
best-of-``--repeats``; on a shared machine, compare the ratios, which are measured in the same run.
When the CPU is oversubscribed, every multi-threaded op waits for descheduled worker threads and
the figures swing by 2x between runs; ``OMP_NUM_THREADS=1`` gives steady ones.

    python bench/bench_policies.py [--tokens 262144] [--layers 48] [--experts 128] [--topk 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time

import torch

from ablate import Routes, get_policy
from ablate.diagnostics import route_diagnostics


def random_routes(tokens: int, layers: int, experts: int, topk: int, mismatch: float, seed: int) -> torch.Tensor:
    """Distinct top-k ids per route without a [T, L, E] tensor: k draws from a shuffled ring."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, experts, (tokens, layers, 1), generator=g, dtype=torch.int32)
    step = torch.randint(1, experts // topk + 1, (tokens, layers, 1), generator=g, dtype=torch.int32)
    ids = (start + step * torch.arange(topk, dtype=torch.int32)) % experts
    return ids.to(torch.int16)


class PeakRSS:
    """Samples the process's resident memory in a thread: the peak above a baseline."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process(os.getpid())
        self.interval = interval

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rollout = random_routes(args.tokens, args.layers, args.experts, args.topk, 0.0, seed=0)
    native = rollout.clone()
    flip = torch.rand(args.tokens, args.layers, generator=torch.Generator().manual_seed(1)) < 0.1
    native[..., -1] = torch.where(flip, (native[..., -1] + 1 + args.topk) % args.experts, native[..., -1])
    native[..., -1] = torch.where(  # keep routes duplicate-free after the flip
        (native[..., :-1] == native[..., -1:]).any(-1), rollout[..., -1], native[..., -1]
    )
    valid = torch.ones(args.tokens, dtype=torch.bool)
    valid[: args.tokens // 16] = False  # some left padding
    routes = Routes(rollout=rollout, valid=valid, num_experts=args.experts, native=native)
    logp_rollout = -torch.rand(args.tokens)
    logp_train = logp_rollout + 0.05 * torch.randn(args.tokens)
    fisher = torch.rand(args.layers, args.experts)
    routes_bytes = rollout.element_size() * rollout.numel()

    baseline = best_of(args.repeats, lambda: torch.sum(rollout))
    baseline_int64 = best_of(args.repeats, lambda: torch.sum(rollout, dtype=torch.int64))
    print(f"routes [{args.tokens}, {args.layers}, {args.topk}] {rollout.dtype}: {routes_bytes / 2**20:.0f} MiB; "
          f"threads={torch.get_num_threads()}")
    print(f"baseline: one torch.sum over the routes tensor = {baseline * 1e3:.1f} ms")
    print(f"reference: torch.sum(routes, dtype=torch.int64) = {baseline_int64 * 1e3:.1f} ms")
    print(f"{'policy':<16}{'select+diag ms':>16}{'ratio':>8}{'vs int64':>10}{'peak extra MiB':>16}{'x routes':>10}")
    settings = {"fisher": {"scores": fisher}, "fisher_tau1": {"scores": fisher, "tau": 1.0}}
    for label in ("none", "full", "random", "uniform", "fisher", "fisher_tau1", "mismatch", "random_per_layer"):
        name = label.split("_tau")[0].replace("_per_layer", "")
        kwargs = dict(settings.get(label, {}))
        if label.endswith("per_layer"):
            kwargs["per_layer"] = True
        policy = get_policy(name, **kwargs)
        budget = {"none": 0.0, "full": 1.0}.get(name, args.budget)

        def step() -> None:
            # Each step is a new batch: drop the per-batch cache so the overlap is paid every time.
            routes.__dict__.pop("native_overlap", None)
            mask = policy.select(routes, budget, generator=torch.Generator().manual_seed(0))
            route_diagnostics(routes, mask, budget, logp_train=logp_train, logp_rollout=logp_rollout,
                              fisher_scores=fisher if name == "fisher" else None)

        step()  # warm-up
        with PeakRSS() as memory:
            step()
        elapsed = best_of(args.repeats, step)
        print(f"{label:<16}{elapsed * 1e3:>16.1f}{elapsed / baseline:>8.1f}{elapsed / baseline_int64:>10.1f}"
              f"{memory.extra / 2**20:>16.0f}{memory.extra / routes_bytes:>10.2f}")
    print(f"max RSS of the whole run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")


if __name__ == "__main__":
    main()
