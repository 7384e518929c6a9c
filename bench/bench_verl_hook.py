"""The verl hook's own work per micro-batch in each engine, against one ``torch.sum`` over its routes (CPU).

For one micro-batch of 8,192 tokens (48 MoE layers, 128 experts, top-8, int16: verl's
``routed_experts``) laid out as 32 sequences of 256 tokens and as 3 sequences of 2,731, it
times what the hook adds to verl's R3 on the rank that counts the micro-batch, through the real
:class:`ablate.replay.hook.ReplayMaskHook` and each engine's seam:

- select: the micro-batch's plan (the recorded-route check and its one read of the device), its
  selection and the augmented routes the engine packs (``ReplayMaskHook.augmented_routes``), in
  the first pass of a step that meets its sequences (the old-log-prob call: one batched
  per-sequence policy selection) and in a later one (an update call: the sequences' masks of
  that first pass, taken whole);
- routers: what the seam does at each of the 48 routers, given the targets verl hands it (verl's
  own packing is not timed): Megatron splits ablate's columns off each router's int64 targets
  and reports the native top-k to the hook; VeOmni splits the per-layer targets
  (``VeOmniSeam.arm_micro_batch``), applies the mask and reports the native top-k
  (``VeOmniSeam.on_router_forward``, verl's own replay stood in for by the targets);
- counters: the route counts behind the ``replay/`` and ``routing/`` keys at the end of the call
  (``ReplayMaskHook.end_call``), against native routes that differ from the rollout's on about
  10% of routes, and the Fisher mass of the mask.

Each is the median of ``--repeats``; the hook's total in each pass is printed as a ratio to
``torch.sum`` over the same micro-batch's routes, timed right before each row, so that a change of
load between rows does not skew the ratios: the old-log-prob pass (select, routers; it counts
nothing) and an update pass (select from the step's masks, routers, counters). Target: at most
10x on one thread, for every engine, policy, layout and pass. On a machine shared with other jobs
compare ratios only.

Each row also counts, in one more pass with a ``TorchDispatchMode``
(:class:`ablate.replay.host_reads.OpCounter`), the aten ops the hook runs and those a GPU would
wait for (``_local_scalar_dense``, ``equal``, ``nonzero``, boolean indexing, ...; and the hook's
deliberate reads of the device): per router (the routers' phase over the 48 routers) and per
micro-batch (all three phases). Targets: no sync and at most 8 ops per router; at most 4 syncs per
micro-batch.

    python bench/bench_verl_hook.py [--layers 48] [--experts 128] [--topk 8] [--repeats 15] [--threads 1] [--device cpu]

With ``--device cuda`` the routes live on the GPU, as in verl, every timing waits for the GPU, and
each row's syncs are counted again by CUDA's own sync debug mode (``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from ablate.backends.verl.hook_settings import HookSettings
from ablate.replay import ReplaySpec
from ablate.replay.host_reads import OpCounter
from ablate.replay.seams import CallInfo, split_augmented

LAYOUTS = {"32 x 256": [256] * 32, "3 x 2,731": [2731, 2731, 2730]}
POLICIES = ("random", "uniform", "fisher", "mismatch")
ENGINES = ("megatron", "veomni")


def distinct_routes(tokens: int, layers: int, experts: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct top-k ids per route without a [T, L, E] tensor: k steps around a ring of experts."""
    start = torch.randint(0, experts, (tokens, layers, 1), generator=generator, dtype=torch.int32)
    step = torch.randint(1, experts // topk + 1, (tokens, layers, 1), generator=generator, dtype=torch.int32)
    return ((start + step * torch.arange(topk, dtype=torch.int32)) % experts).to(torch.int16)


def median_time(repeats: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (after one warm-up), ``setup()`` untimed before each."""
    times = []
    for _ in range(repeats + 1):
        setup()
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def cuda_syncs(device: torch.device, run: Callable[[], object]) -> int | str:
    """How many times ``run()`` made the host wait for the GPU, by CUDA's sync debug mode ("-" on a CPU)."""
    if device.type != "cuda":
        return "-"
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in seen)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MicroBatch:
    """One micro-batch through one engine's seam: the hook's calls as the engine makes them."""

    def __init__(self, engine: str, policy: str, routes, native, offsets, experts: int) -> None:
        tokens, layers, topk = routes.shape
        self.engine, self.routes, self.offsets, self.topk = engine, routes, offsets, topk
        self.hook = HookSettings(ReplaySpec.of(policy, 0.25, seed=0), engine=engine).make_hook()
        device = routes.device
        self.r3_mask = torch.ones(tokens, dtype=torch.bool, device=device)
        if engine == "megatron":
            self.r3_mask[offsets[1:] - 1] = False  # Megatron's R3 leaves each sequence's final token native
        self.info = CallInfo(forward_only=False, last_update=False, num_tokens=tokens, route_layers=layers,
                             topk=topk, num_experts=experts, layer_columns=tuple(range(layers)))
        self.old_log_prob = dataclasses.replace(self.info, forward_only=True)
        self.scores = torch.rand(tokens, experts, device=device)
        self.native_of_layer = [layer.long() for layer in native.unbind(1)]  # a router's own top-k is int64
        self.routers = [torch.nn.Identity() for _ in range(layers)]  # VeOmni tells routers apart by identity
        self.augmented = self.targets = self.replayed = None
        self.hook.begin_call(self.info)  # builds the policy and its Fisher tracker
        self.hook.abort_call()
        tracker = self.hook.tracker
        tracker.accumulate(torch.rand(1, layers, experts, dtype=torch.float64), torch.ones(1, layers, experts))
        tracker.step()  # an estimate exists: fisher ranks by it, every policy reports its Fisher mass
        if self.hook.needs_native:  # the step's native pass: mismatch selects on its native routes
            self.hook.begin_call(self.info, native_pass=True)
            self.select()
            self.pack()
            self.route()
            self.hook.end_call()

    def select(self) -> None:
        self.augmented = self.hook.augmented_routes(0, self.routes, self.r3_mask, self.offsets, counted=True)

    def pack(self) -> None:
        """verl's own work on the augmented routes (untimed): each router's int64 targets."""
        if self.engine == "megatron":  # set_router_replay_data: one layer-major int64 copy per router
            self.targets = [layer.to(torch.int64) for layer in self.augmented.permute(1, 0, 2)]
        else:  # _prepare_router_replay_inputs: one int64 copy, unbound into per-layer views
            self.targets = list(self.augmented.to(torch.int64).unbind(1))
            # verl's own replay of each router (torch.where over its targets) returns a new tensor
            self.replayed = [target[:, :self.topk].contiguous() for target in self.targets]

    def route(self) -> None:
        hook, topk = self.hook, self.topk
        if self.engine == "megatron":
            block = hook.last_rows  # as the seam: a router given the micro-batch's rows knows which they are
            for layer, routes in enumerate(self.targets):
                targets = split_augmented(routes, topk, block if routes.shape[0] == block.stop - block.start else None)
                hook.observe(layer, targets.rows, self.native_of_layer[layer], self.scores)
        else:
            seam = hook.seam
            seam.arm_micro_batch(self.targets, topk)
            for layer, (router, replayed) in enumerate(zip(self.routers, self.replayed)):
                seam.on_router_forward(lambda *args, replayed=replayed: replayed, None, router, self.scores,
                                       self.native_of_layer[layer])
            seam.end_pass()

    def begin(self) -> None:
        """An update call of the step: its sequences' masks were chosen in the step's first pass."""
        self.hook.begin_call(self.info)

    def begin_step(self) -> None:
        """The old-log-prob call of a step whose sequences no pass has met yet."""
        self.hook._chosen.clear()
        self.hook.begin_call(self.old_log_prob)

    def selected_call(self) -> None:
        self.begin()
        self.select()
        self.pack()

    def routed_call(self) -> None:
        self.selected_call()
        self.route()

    def op_counts(self) -> tuple[OpCounter, OpCounter, OpCounter]:
        """The aten ops and syncs of the routers' phase, and of the micro-batch in the step's first pass
        (select, routers) and in an update pass (select, routers, counters)."""
        router, first, update = OpCounter(), OpCounter(), OpCounter()
        for begin, micro_batch in ((self.begin_step, first), (self.begin, update)):
            begin()
            with micro_batch.counting():
                self.select()
            self.pack()
            with micro_batch.counting(), router.counting():
                self.route()
            with micro_batch.counting():
                self.hook.end_call()
        return router, first, update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--verbose", action="store_true", help="name each row's syncs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LAYOUTS["32 x 256"])
    routes = distinct_routes(tokens, args.layers, args.experts, args.topk, generator)
    other = distinct_routes(tokens, args.layers, args.experts, args.topk, generator)
    native = torch.where(torch.rand(tokens, args.layers, 1, generator=generator) < 0.1, other, routes).to(device)
    routes = routes.to(device)
    print(f"one micro-batch: {tokens} tokens, {args.layers} layers, {args.experts} experts, top-{args.topk} "
          f"({routes.numel() * 2 / 2**20:.0f} MiB int16) on {device}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"\n{'':<30} {'':>10} {'select':>17} {'':>18} {'hook / torch.sum':>17}")
    print(f"{'engine':<9} {'policy':<9} {'layout':<10} {'torch.sum':>10} {'first':>8} {'later':>8} {'routers':>8} "
          f"{'counters':>9} {'first':>8} {'update':>8} {'ops/router':>10} {'syncs/router':>12} {'syncs/mb':>8}")
    worst = 0.0
    worst_router_ops = worst_router_syncs = worst_syncs = 0
    for engine in ENGINES:
        for name in POLICIES:
            for layout, lengths in LAYOUTS.items():
                offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
                batch = MicroBatch(engine, name, routes, native, offsets, args.experts)
                baseline = median_time(args.repeats, lambda: torch.sum(routes))
                first = median_time(args.repeats, batch.select, batch.begin_step)
                later = median_time(args.repeats, batch.select, batch.begin)
                routers = median_time(args.repeats, batch.route, batch.selected_call)
                counters = median_time(args.repeats, batch.hook.end_call, batch.routed_call)
                old_log_prob, update = (first + routers) / baseline, (later + routers + counters) / baseline
                worst = max(worst, old_log_prob, update)
                router, first_pass, update_pass = batch.op_counts()
                per_router_ops, per_router_syncs = router.total_ops / (2 * args.layers), router.total_syncs
                syncs = max(first_pass.total_syncs, update_pass.total_syncs)
                worst_router_ops = max(worst_router_ops, per_router_ops)
                worst_router_syncs = max(worst_router_syncs, per_router_syncs)
                worst_syncs = max(worst_syncs, syncs)
                print(f"{engine:<9} {name:<9} {layout:<10} {baseline * 1e3:>8.2f}ms {first * 1e3:>6.1f}ms "
                      f"{later * 1e3:>6.1f}ms {routers * 1e3:>6.1f}ms {counters * 1e3:>7.1f}ms {old_log_prob:>7.1f}x "
                      f"{update:>7.1f}x {per_router_ops:>10.1f} {per_router_syncs:>12} {syncs:>8}")
                if args.verbose:
                    print(f"    syncs: first pass {dict(first_pass.syncs)}, update {dict(update_pass.syncs)}")
                if device.type == "cuda":  # the same micro-batch, counted by CUDA itself
                    print(f"    CUDA sync debug mode: {cuda_syncs(device, batch.op_counts)} syncs")
    print(f"\nthe slowest row: {worst:.1f}x torch.sum (target: at most 10x)")
    print(f"the most per router: {worst_router_ops:.1f} aten ops (target: at most 8), {worst_router_syncs} syncs in all "
          f"routers (target: 0); the most syncs per micro-batch and pass: {worst_syncs} (target: at most 4)")


if __name__ == "__main__":
    main()
