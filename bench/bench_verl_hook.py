"""The verl hook's own work per micro-batch, against one ``torch.sum`` over its routes (CPU).

For one micro-batch of 8,192 tokens (48 MoE layers, 128 experts, top-8, int16: verl's
``routed_experts``) laid out as 32 sequences of 256 tokens and as 3 sequences of 2,731, it
times what the hook adds to verl's R3 on the rank that counts the micro-batch:

- selection (:func:`ablate.backends.verl.selection.select_micro_batch`): recorded-route check,
  per-sequence keys and generators, one batched per-sequence policy selection;
- the augmented routes verl packs for the routers (:func:`ablate.backends.verl.patch.augment_routes`);
- the counters (:func:`ablate.backends.verl.counters.micro_batch_counts`): every route count
  behind the ``replay/`` and ``routing/`` keys, against native routes that differ from the
  rollout's on about 10% of routes.

Each is printed as a ratio to ``torch.sum`` over the same micro-batch's routes, timed right
before each row (median of ``--repeats``), so that a change of load between rows does not skew
the ratios. Targets: at most 10x, and the hook's time for the two layouts within 1.5x of each
other (compared directly: both are measured in the same run, and the sum of a cache-resident
6 MiB tensor jitters more than the hook does). On a machine shared with other jobs compare ratios only.

    python bench/bench_verl_hook.py [--layers 48] [--experts 128] [--topk 8] [--repeats 15] [--device cpu]

With ``--device cuda`` the routes live on the GPU, as in verl, and every timing waits for the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ablate.backends.verl.counters import micro_batch_counts
from ablate.backends.verl.patch import augment_routes
from ablate.backends.verl.selection import select_micro_batch
from ablate.policies import PolicySpec

LAYOUTS = {"32 x 256": [256] * 32, "3 x 2,731": [2731, 2731, 2730]}
POLICIES = [("random", {}), ("uniform", {}), ("fisher", {}), ("mismatch", {})]


def distinct_routes(tokens: int, layers: int, experts: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct top-k ids per route without a [T, L, E] tensor: k steps around a ring of experts."""
    start = torch.randint(0, experts, (tokens, layers, 1), generator=generator, dtype=torch.int32)
    step = torch.randint(1, experts // topk + 1, (tokens, layers, 1), generator=generator, dtype=torch.int32)
    return ((start + step * torch.arange(topk, dtype=torch.int32)) % experts).to(torch.int16)


def median_time(repeats: int, fn, device: torch.device) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up (allocator, CUDA kernels)
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LAYOUTS["32 x 256"])
    routes = distinct_routes(tokens, args.layers, args.experts, args.topk, generator)
    other = distinct_routes(tokens, args.layers, args.experts, args.topk, generator)
    native = torch.where(torch.rand(tokens, args.layers, 1, generator=generator) < 0.1, other, routes).to(device)
    routes = routes.to(device)
    native_plus_one = native + 1  # the hook's assembled buffer: native id + 1
    print(f"one micro-batch: {tokens} tokens, {args.layers} layers, {args.experts} experts, top-{args.topk} "
          f"({routes.numel() * 2 / 2**20:.0f} MiB int16) on {device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"\n{'policy':<10} {'layout':<10} {'torch.sum':>10} {'selection':>10} {'+ augment':>10} {'+ counters':>11} "
          f"{'hook / torch.sum':>17}")
    results: dict[str, dict[str, float]] = {}  # policy -> layout -> the hook's time
    for name, settings in POLICIES:
        policy, tracker = PolicySpec(name, settings).build(args.layers, args.experts)
        scores = torch.rand(args.layers, args.experts, generator=generator)
        tracker.accumulate(scores[None].double(), torch.ones(1, args.layers, args.experts))
        tracker.step()  # an estimate exists: fisher ranks by it, every policy reports its Fisher mass
        fisher = tracker.scores().to(device)
        for layout, lengths in LAYOUTS.items():
            offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
            r3_mask = torch.ones(tokens, dtype=torch.bool, device=device)
            r3_mask[offsets[1:] - 1] = False  # R3 leaves each sequence's final token native
            known = torch.ones(tokens, dtype=torch.bool, device=device)
            mismatch = {"native": native, "has_native": known} if name == "mismatch" else {}

            def select():
                return select_micro_batch(policy, 0.25, 0, routes, r3_mask, offsets, args.experts, **mismatch)

            baseline = median_time(args.repeats, lambda: torch.sum(routes), device)
            selection = select()
            full_mask = selection.mask
            select_time = median_time(args.repeats, select, device)
            augment_time = median_time(args.repeats, lambda: augment_routes(routes, full_mask, selection.valid, 0), device)
            count_time = median_time(
                args.repeats, lambda: micro_batch_counts(selection, native_plus_one, args.experts, fisher), device)
            total = select_time + augment_time + count_time
            results.setdefault(name, {})[layout] = total
            print(f"{name:<10} {layout:<10} {baseline * 1e3:>8.2f}ms {select_time * 1e3:>8.1f}ms "
                  f"{augment_time * 1e3:>8.1f}ms {count_time * 1e3:>9.1f}ms {total / baseline:>16.1f}x")
    print("\nlayouts: the hook's time, slower layout over faster (target at most 1.5x)")
    for name, ratios in results.items():
        values = list(ratios.values())
        print(f"  {name:<10} {max(values) / min(values):.2f}x")


if __name__ == "__main__":
    main()
