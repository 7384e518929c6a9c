"""Mask selection plus diagnostics, per policy, on Qwen3-30B-A3B-shaped routes (48 layers, 128 experts, top-8).

Every time is printed next to one reduction pass over the same routes tensor, measured in this
run, and as their ratio. Three parts:

1. ``global``: ``policy.select`` plus every ``replay/``, ``routing/``, ``load/`` and
   ``mismatch/`` diagnostic on one batch of ``--tokens`` tokens, with the peak extra memory of
   the step next to the size of the routes tensor.
2. ``per-sequence``: the same batch cut into sequences of ``--sequence-length`` tokens,
   ``select(..., per_sequence=True)`` with one generator per sequence (created in the timed
   step, as a caller does), plus the same diagnostics.
3. ``micro-batch``: the layouts of one verl micro-batch (32 x 256 tokens, 3 x 2,731 tokens, and
   ragged sequences of 8,192 tokens in all): per-sequence ``select`` plus the additive counters
   of ``route_counts``, next to the Python loop that selects one sequence at a time.

The baseline is exactly ``torch.sum(routes)``. Summing an int16 tensor accumulates in int64 and
can take a slower path than a native-width reduction, so ``torch.sum(routes, dtype=torch.int64)``
is printed too. Timings are best-of-``--repeats``; on a shared machine compare the ratios, which
are measured in the same run. When the CPU is oversubscribed, every multi-threaded op waits for
descheduled worker threads and the figures swing by 2x between runs; ``OMP_NUM_THREADS=1`` gives
steady ones. ``--device cuda`` runs every part on a GPU (memory is then CUDA's peak allocation).

    python bench/bench_policies.py [--parts global,per-sequence,micro-batch] [--tokens 262144] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time
from collections.abc import Callable

import torch

from ablate import Routes, get_policy
from ablate.diagnostics import route_counts, route_diagnostics

#: label -> (policy name, settings, whether it reads the Fisher scores); budgets: none 0, full 1.
POLICIES = {
    "none": ("none", {}),
    "full": ("full", {}),
    "random": ("random", {}),
    "uniform": ("uniform", {}),
    "fisher": ("fisher", {"scores": True}),
    "fisher_tau1": ("fisher", {"scores": True, "tau": 1.0}),
    "mismatch": ("mismatch", {}),
    "random_per_layer": ("random", {"per_layer": True}),
}


def random_routes(tokens: int, layers: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    """Distinct top-k ids per route without a [T, L, E] tensor: k draws from a shuffled ring."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, experts, (tokens, layers, 1), generator=g, dtype=torch.int32)
    step = torch.randint(1, experts // topk + 1, (tokens, layers, 1), generator=g, dtype=torch.int32)
    ids = (start + step * torch.arange(topk, dtype=torch.int32)) % experts
    return ids.to(torch.int16)


def batch(tokens: int, layers: int, experts: int, topk: int, offsets: torch.Tensor | None, device: str) -> Routes:
    """Routes with 10% of routes mismatched by one expert, and the first 1/16 of tokens padding."""
    rollout = random_routes(tokens, layers, experts, topk, seed=0)
    native = rollout.clone()
    flip = torch.rand(tokens, layers, generator=torch.Generator().manual_seed(1)) < 0.1
    native[..., -1] = torch.where(flip, (native[..., -1] + 1 + topk) % experts, native[..., -1])
    native[..., -1] = torch.where(  # keep routes duplicate-free after the flip
        (native[..., :-1] == native[..., -1:]).any(-1), rollout[..., -1], native[..., -1]
    )
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[: tokens // 16] = False
    return Routes(
        rollout=rollout.to(device), valid=valid.to(device), num_experts=experts, native=native.to(device),
        offsets=None if offsets is None else offsets.to(device),
    )


class PeakRSS:
    """Samples the process's resident memory in a thread: the peak above a baseline."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process(os.getpid())
        self.interval = interval

    def __enter__(self) -> PeakRSS:
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


class PeakCUDA:
    """Peak CUDA allocation above the allocation at entry."""

    def __enter__(self) -> PeakCUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.extra = torch.cuda.max_memory_allocated() - self.base


def best_of(repeats: int, fn: Callable[[], object], device: str) -> float:
    times = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def policy_of(label: str, fisher: torch.Tensor):
    name, settings = POLICIES[label]
    settings = {**settings, **({"scores": fisher} if settings.get("scores") else {})}
    return get_policy(name, **settings), {"none": 0.0, "full": 1.0}.get(name)


def generators(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in range(count)]


def baselines(routes: Routes, args: argparse.Namespace) -> float:
    baseline = best_of(args.repeats, lambda: torch.sum(routes.rollout), args.device)
    wide = best_of(args.repeats, lambda: torch.sum(routes.rollout, dtype=torch.int64), args.device)
    print(f"baseline: torch.sum over the routes = {baseline * 1e3:.2f} ms; "
          f"torch.sum(routes, dtype=torch.int64) = {wide * 1e3:.2f} ms")
    return baseline


def full_step_part(title: str, routes: Routes, per_sequence: bool, args: argparse.Namespace) -> None:
    """``select`` plus every diagnostic, per policy: time, ratio, peak extra memory."""
    routes_bytes = routes.rollout.element_size() * routes.rollout.numel()
    print(f"\n== {title}: routes {list(routes.rollout.shape)} {routes.rollout.dtype}, {routes_bytes / 2**20:.0f} MiB, "
          f"{routes.num_sequences} sequences")
    baseline = baselines(routes, args)
    fisher = torch.rand(routes.num_layers, routes.num_experts)
    logp_rollout = -torch.rand(routes.num_tokens, device=args.device)
    logp_train = logp_rollout + 0.05 * torch.randn(routes.num_tokens, device=args.device)
    print(f"{'policy':<18}{'select+diag ms':>16}{'ratio':>8}{'peak extra MiB':>16}{'x routes':>10}")
    for label in POLICIES:
        policy, fixed = policy_of(label, fisher)
        budget = args.budget if fixed is None else fixed

        def step() -> None:
            forget_batch(routes)  # each step is a new batch: its overlap and Fisher scores are paid every time
            generator = generators(routes.num_sequences) if per_sequence else torch.Generator().manual_seed(0)
            mask = policy.select(routes, budget, generator=generator, per_sequence=per_sequence)
            route_diagnostics(routes, mask, budget, logp_train=logp_train, logp_rollout=logp_rollout,
                              fisher_scores=fisher if label.startswith("fisher") else None)

        step()  # warm-up
        with (PeakRSS() if args.device == "cpu" else PeakCUDA()) as memory:
            step()
        elapsed = best_of(args.repeats, step, args.device)
        print(f"{label:<18}{elapsed * 1e3:>16.1f}{elapsed / baseline:>8.1f}"
              f"{memory.extra / 2**20:>16.0f}{memory.extra / routes_bytes:>10.2f}")


def forget_batch(routes: Routes) -> None:
    """Drop what ``routes`` cached of its native routes and Fisher scores, as if it were a new batch."""
    for key in ("native_differences", "native_overlap", "_route_scores"):
        routes.__dict__.pop(key, None)


def micro_batch_part(args: argparse.Namespace) -> None:
    """Per-sequence ``select`` plus ``route_counts`` on one verl micro-batch, three layouts."""
    lengths = {
        "32 x 256": [256] * 32,
        "3 x 2731": [2731] * 3,
        "ragged 8192": ragged_lengths(8192, seed=3),
    }
    fisher = torch.rand(args.layers, args.experts)
    for layout, sizes in lengths.items():
        offsets = torch.tensor([0, *sizes]).cumsum(0)
        routes = batch(int(offsets[-1]), args.layers, args.experts, args.topk, offsets, args.device)
        print(f"\n== micro-batch {layout}: {len(sizes)} sequences, {routes.num_tokens} tokens "
              f"(lengths {min(sizes)} to {max(sizes)})")
        baseline = baselines(routes, args)
        print(f"{'policy':<18}{'select+counts ms':>18}{'ratio':>8}{'select ms':>11}{'ratio':>8}")
        for label in POLICIES:
            policy, fixed = policy_of(label, fisher)
            budget = args.budget if fixed is None else fixed

            def select():
                forget_batch(routes)
                return policy.select(routes, budget, generator=generators(len(sizes)), per_sequence=True)

            select()  # warm-up
            alone = best_of(args.repeats, select, args.device)
            with_counts = best_of(args.repeats, lambda: route_counts(routes, select()), args.device)
            print(f"{label:<18}{with_counts * 1e3:>18.2f}{with_counts / baseline:>8.1f}"
                  f"{alone * 1e3:>11.2f}{alone / baseline:>8.1f}")
        loop = best_of(args.repeats, lambda: one_sequence_at_a_time(routes, args.budget), args.device)
        print(f"{'random, a Python loop over sequences':<36}{loop * 1e3:>10.2f} ms, ratio {loop / baseline:.1f}")


def ragged_lengths(total: int, seed: int) -> list[int]:
    """Sequence lengths from 32 to 2,048 tokens (log-uniform), adding up to ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        length = min(left, int(2 ** (5 + 6 * float(torch.rand(1, generator=g)))))
        lengths.append(length)
        left -= length
    return lengths


def one_sequence_at_a_time(routes: Routes, budget: float) -> None:
    """The per-sequence loop that batched selection replaces: one Routes and one select per sequence."""
    policy = get_policy("random")
    bounds = routes.offsets.tolist()
    for sequence, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if bool(routes.valid[start:end].any()):
            one = Routes(rollout=routes.rollout[start:end], valid=routes.valid[start:end], num_experts=routes.num_experts)
            policy.select(one, budget, generator=torch.Generator().manual_seed(sequence))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="global,per-sequence,micro-batch")
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    parts = args.parts.split(",")
    print(f"threads={torch.get_num_threads()} device={args.device} budget={args.budget}")
    if "global" in parts or "per-sequence" in parts:
        offsets = torch.arange(0, args.tokens + 1, args.sequence_length)
        if offsets[-1] != args.tokens:
            offsets = torch.cat([offsets, torch.tensor([args.tokens])])
        routes = batch(args.tokens, args.layers, args.experts, args.topk, offsets, args.device)
        if "global" in parts:  # one budget for the batch; uniform still stratifies by sequence
            full_step_part("global", routes, per_sequence=False, args=args)
        if "per-sequence" in parts:
            full_step_part(f"per-sequence ({args.sequence_length} tokens a sequence)", routes, per_sequence=True, args=args)
        del routes
    if "micro-batch" in parts:
        micro_batch_part(args)
    if args.device == "cpu":
        print(f"\nmax RSS of the whole run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")


if __name__ == "__main__":
    main()
