"""Megatron-core's own router replay under ``partial_replay``, on CPU: real routers and a real GPT-MoE model.

Nothing of verl is imported in a world's ranks: every router is Megatron-core 0.16.1's
``TopKRouter`` built with ``moe_enable_routing_replay=True``, replaying through Megatron-core's
``RouterReplay``, as NeMo RL, SkyRL and AReaL drive it. Two kinds of model, in gloo worlds:

- *routers*: three ``TopKRouter`` s driven with logits directly, so that each rank knows every
  native route. Two micro-batches of sequences (one with a multi-turn gap the rollout never
  recorded), two training steps; each micro-batch is replayed forward under ``no_grad`` and then
  recomputed under ``REPLAY_BACKWARD`` with gradients, as Megatron's activation checkpointing does;
- *gpt*: a tiny ``GPTModel`` from Megatron's own GPT layer specs (attention, two MoE layers,
  ``allgather`` dispatcher) with full activation recompute, replayed as the issue's snippet does.

Layouts: one rank; TP=2 with sequence parallelism (each rank routes a slice of every micro-batch);
EP=2 (each rank routes its own micro-batch, the experts split over the two ranks).

``run(...)`` saves, on rank 0: per policy, step and pass, the experts every router used for every
(global row, layer) on every rank, each router's native top-k of the same pass, the routes handed
over, and the step's keys; and, per policy, the Fisher estimate after the first step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

NUM_LAYERS, NUM_EXPERTS, TOPK = 3, 8, 2
#: Sequence lengths of the two micro-batches: their totals split evenly over two TP ranks.
MICRO_BATCHES = [[5, 7], [4, 4, 8]]
#: Rows of micro-batch 0 the rollout never recorded (a multi-turn gap): zeros, every layer.
GAP = (2, 4)
#: GPT sizes: two MoE layers, a sequence of 16 tokens per rank's micro-batch.
GPT_LAYERS, GPT_TOKENS, VOCAB = 2, 16, 32


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)


LAYOUTS = {layout.name: layout for layout in (Layout("single"), Layout("tp2_sp", tp=2), Layout("ep2", ep=2))}


def cpu_shims() -> None:
    """Where Megatron-core 0.16.1 assumes CUDA; everything else runs as is.

    ``Router.gating`` moves the router weight to ``torch.cuda.current_device()``, the sequence-
    parallel forward forks the CUDA RNG tracker, activation recompute saves and restores the CUDA
    RNG state (here the CPU's), and ``RouterGatingLinearFunction`` reads a Transformer Engine
    symbol that is undefined without Transformer Engine.
    """
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: torch.device("cpu")
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ------------------------------------------------------------------------------------ the batch
def offsets_of(index: int) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(MICRO_BATCHES[index]).cumsum(0).tolist()])


def first_row(index: int) -> int:
    """Global row id of the micro-batch's first token (row ids count from 1)."""
    return 1 + sum(sum(lengths) for lengths in MICRO_BATCHES[:index])


def rollout_routes(index: int, tokens: int, layers: int) -> torch.Tensor:
    """``[tokens, layers, topk]`` routes a rollout engine recorded: distinct ids, zeros on the gap."""
    generator = torch.Generator().manual_seed(100 + index)
    routes = torch.stack([torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOPK] for _ in range(layers)])
                          for _ in range(tokens)])
    if index == 0:
        routes[GAP[0]:GAP[1]] = 0
    return routes


def router_logits(index: int, step: int) -> torch.Tensor:
    """``[layers, tokens, experts]`` float64 logits of a micro-batch at a step: the same on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(NUM_LAYERS, sum(MICRO_BATCHES[index]), NUM_EXPERTS, generator=generator, dtype=torch.float64)


def loss_weights(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(77 + index)
    return torch.randn(NUM_LAYERS, sum(MICRO_BATCHES[index]), NUM_EXPERTS, generator=generator, dtype=torch.float64)


def my_rows(layout: Layout, tokens: int) -> slice:
    """The rows of a micro-batch this rank's routers see: a slice under sequence parallelism."""
    if layout.tp == 1:
        return slice(0, tokens)
    from megatron.core import parallel_state as mpu

    share, rank = tokens // layout.tp, mpu.get_tensor_model_parallel_rank()
    return slice(rank * share, (rank + 1) * share)


def my_micro_batches(layout: Layout) -> list[int]:
    """Expert-parallel ranks route their own micro-batches; the others route every one."""
    return [dist.get_rank()] if layout.ep > 1 else list(range(len(MICRO_BATCHES)))


# --------------------------------------------------------------------------------- Megatron
def initialize(rank: int, layout: Layout, port: int) -> None:
    from megatron.core import parallel_state as mpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=layout.world)
    torch.set_num_threads(1)
    cpu_shims()
    mpu.initialize_model_parallel(layout.tp, 1, expert_model_parallel_size=layout.ep)


def config(layout: Layout, **sizes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16,
                  moe_ffn_hidden_size=16, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                  moe_router_load_balancing_type="none", moe_enable_routing_replay=True,
                  moe_token_dispatcher_type="allgather", use_cpu_initialization=True, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=layout.tp,
                  sequence_parallel=layout.tp > 1, expert_model_parallel_size=layout.ep)
    return TransformerConfig(**{**values, **sizes})


def routers(layout: Layout) -> list:
    """Three real TopKRouters, layers 1-3, each with Megatron-core's own RouterReplay."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    built = []
    for layer in range(NUM_LAYERS):
        router = TopKRouter(config(layout), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        router.set_layer_number(layer + 1)
        built.append(router)
    return built


def used_experts(routing_map: torch.Tensor) -> list[int]:
    """Each row's experts as one bitmask."""
    return (routing_map.long() * (1 << torch.arange(routing_map.shape[-1]))).sum(-1).tolist()


# ------------------------------------------------------------------------------- the routers
def route_micro_batch(layout: Layout, built: list, index: int, step: int, replay, per_router: bool) -> dict:
    """One micro-batch as a loop with activation recompute runs it: hand the routes over, a native pass
    where the policy needs one, a forward without gradients, the recompute with them, the backward.

    Returns each pass's experts used and native top-k per (global row, layer) of this rank, and
    the router-logit gradients of the recompute (for the Fisher estimate).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    tokens = sum(MICRO_BATCHES[index])
    rows = my_rows(layout, tokens)
    row_ids = list(range(first_row(index) + rows.start, first_row(index) + rows.stop))
    routes = rollout_routes(index, tokens, NUM_LAYERS)[rows]
    logits = router_logits(index, step)[:, rows]
    replay.sequences(offsets_of(index))
    per_layer = [routes[:, layer].clone() for layer in range(NUM_LAYERS)]
    if per_router:
        for router, targets in zip(built, per_layer):
            router.router_replay.set_target_indices(targets)
    else:
        RouterReplay.set_replay_data(per_layer)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    if replay.session.needs_native:
        with replay.native_pass(), torch.no_grad():
            for router, layer_logits in zip(built, logits):
                router.routing(layer_logits[:, None, :])
    passes = {}
    leaves = []
    for name, action in (("forward", RouterReplayAction.REPLAY_FORWARD), ("recompute", RouterReplayAction.REPLAY_BACKWARD)):
        RouterReplay.set_global_router_replay_action(action)
        used, native, loss = {}, {}, 0
        with torch.set_grad_enabled(name == "recompute"):
            for layer, (router, layer_logits) in enumerate(zip(built, logits)):
                leaf = layer_logits.clone().requires_grad_(name == "recompute")
                probs, routing_map = router.routing(leaf[:, None, :])
                natives = layer_logits.topk(TOPK, dim=-1).indices
                for row, experts, own in zip(row_ids, used_experts(routing_map), used_experts(as_map(natives))):
                    used[(row, layer + 1)], native[(row, layer + 1)] = experts, own
                if name == "recompute":
                    leaves.append(leaf)
                    loss = loss + (probs * loss_weights(index)[layer, rows]).sum()
        if name == "recompute":
            loss.backward()
        passes[name] = {"used": used, "native": native}
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    return {"passes": passes, "logit_grads": [leaf.grad for leaf in leaves], "rows": rows, "index": index}


def as_map(indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(indices.shape[0], NUM_EXPERTS, dtype=torch.bool).scatter(-1, indices, True)


def run_routers(layout: Layout, policy: str, budget, settings: dict, per_router: bool) -> dict:
    """Two training steps of one policy over this rank's micro-batches, in one partial_replay context."""
    from ablate.replay.megatron_core import partial_replay
    from worlds import gather_ranks

    built = routers(layout)
    steps = []
    with partial_replay(policy, budget, seed=5, **settings) as replay:
        for step in range(2):
            batches = [route_micro_batch(layout, built, index, step, replay, per_router)
                       for index in my_micro_batches(layout)]
            metrics = replay.metrics()
            passes = {name: {what: gather_ranks({key: value for batch in batches
                                                 for key, value in batch["passes"][name][what].items()})
                             for what in ("used", "native")} for name in ("forward", "recompute")}
            steps.append({"passes": passes, "metrics": metrics, "fisher": replay.session.tracker.scores().clone(),
                          "grad_squares": _grad_squares(batches)})
    return {"steps": steps}


def _grad_squares(batches: list[dict]) -> torch.Tensor:
    """``[2, layers, experts]`` per-token squared router-logit gradients of the recorded rows, and their counts,
    summed over the micro-batches of every rank."""
    sums = torch.zeros(2, NUM_LAYERS, NUM_EXPERTS, dtype=torch.float64)
    for batch in batches:
        tokens = sum(MICRO_BATCHES[batch["index"]])
        recorded = torch.ones(tokens, dtype=torch.bool)
        if batch["index"] == 0:
            recorded[GAP[0]:GAP[1]] = False
        valid = recorded[batch["rows"]]
        for layer, grad in enumerate(batch["logit_grads"]):
            sums[0, layer] += grad[valid].square().sum(0)
            sums[1, layer] += valid.sum()
    if dist.get_world_size() > 1:  # each rank holds its own rows: a slice (TP with SP) or a micro-batch (EP)
        dist.all_reduce(sums)
    return sums


# ---------------------------------------------------------------------------------- the GPT model
def gpt_model(layout: Layout):
    """Megatron's GPT model with its local (no Transformer Engine) layer specs, its norms identities: torch's
    LayerNorm, the local specs' norm without Apex, refuses sequence parallelism. The same in every layout."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(3)
    gpt_config = config(layout, num_layers=GPT_LAYERS, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
    spec = get_gpt_decoder_block_spec(gpt_config, use_transformer_engine=False)
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.input_layernorm = IdentityOp
        layer_spec.submodules.pre_mlp_layernorm = IdentityOp
    spec.layer_norm = IdentityOp
    model = GPTModel(gpt_config, spec, vocab_size=VOCAB, max_sequence_length=64)
    model.train()
    return model


def run_gpt(layout: Layout) -> dict:
    """The issue's snippet on a GPT-MoE model with full recompute: every route each router used in the
    forward and the recompute, its own native top-k of the same input, and the routes it was handed."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from ablate.replay.megatron_core import partial_replay
    from worlds import gather_ranks

    model = gpt_model(layout)
    generator = torch.Generator().manual_seed(40 + (dist.get_rank() if layout.ep > 1 else 0))
    input_ids = torch.randint(0, VOCAB, (1, GPT_TOKENS), generator=generator)
    rows = my_rows(layout, GPT_TOKENS)
    micro_batch = dist.get_rank() if layout.ep > 1 else 0
    row_ids = list(range(1 + GPT_TOKENS * micro_batch + rows.start, 1 + GPT_TOKENS * micro_batch + rows.stop))
    routes = rollout_routes(1 + micro_batch, GPT_TOKENS, GPT_LAYERS)
    rollout_routes_per_layer = [routes[rows, layer].clone() for layer in range(GPT_LAYERS)]
    seen: list[dict] = []

    def capture(router, inputs, output):
        with torch.no_grad():
            native = router.gating(inputs[0]).view(-1, NUM_EXPERTS).topk(TOPK, dim=-1).indices
        seen.append({(row, router.layer_number): (used, own) for row, used, own in
                     zip(row_ids, used_experts(output[1]), used_experts(as_map(native)))})

    handles = [module.register_forward_hook(capture) for module in model.modules()
               if type(module).__name__ == "TopKRouter"]
    position_ids = torch.arange(GPT_TOKENS)[None]
    causal = torch.triu(torch.ones(GPT_TOKENS, GPT_TOKENS), diagonal=1).bool()[None, None]
    with partial_replay(policy="random", budget=0.25, seed=0) as replay:
        RouterReplay.set_replay_data(rollout_routes_per_layer)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        loss = model(input_ids, position_ids, attention_mask=causal).float().square().mean()
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        loss.backward()
        metrics = replay.metrics()
    for handle in handles:
        handle.remove()
    # The forward calls each router once, and the recompute once more, in layer order.
    forward, recompute = _merged_calls(seen[:GPT_LAYERS]), _merged_calls(seen[GPT_LAYERS:])
    return {"forward": gather_ranks(forward), "recompute": gather_ranks(recompute), "metrics": metrics,
            "routes": gather_ranks({micro_batch: routes})}


def _merged_calls(calls: list[dict]) -> dict:
    merged = {}
    for call in calls:
        merged.update(call)
    return merged


# ------------------------------------------------------------------------------------- a run
def run(rank: int, layout: Layout, port: int, policies: list, out_path: str) -> None:
    """Entry point of one rank: every policy on the routers, then the GPT model; rank 0 saves the results."""
    from megatron.core import parallel_state as mpu

    initialize(rank, layout, port)
    results = {"routers": {}, "gpt": None}
    for policy, budget, settings, per_router in policies:
        results["routers"][(policy, per_router)] = run_routers(layout, policy, budget, settings, per_router)
    results["gpt"] = run_gpt(layout)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- edges, on one rank
#: aten ops that make a GPU wait for the host (a value read back, or a size known only from data).
HOST_SYNCS = ("_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique", "repeat_interleave")


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that wait for the host, boolean indexing included."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        indexed_by_bool = name.startswith("index") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for arg in args if isinstance(arg, (list, tuple)) for index in arg)
        if indexed_by_bool or any(name.startswith(sync) for sync in HOST_SYNCS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def replaced_names() -> dict[str, object]:
    """What Megatron-core holds under each name partial_replay replaces, as stored."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return {name: inspect.getattr_static(owner, name) for owner, name in (
        (RouterReplay, "set_replay_data"), (RouterReplay, "set_target_indices"), (RouterReplay, "get_replay_topk"),
        (TopKRouter, "routing"))}


def edges(rank: int, port: int, out_path: str) -> None:
    """What partial_replay leaves alone, what it refuses, and what a router call costs, on one rank."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from ablate.replay.megatron_core import NativeRoutesMissing, NothingReplayed, partial_replay

    layout = LAYOUTS["single"]
    initialize(rank, layout, port)
    built = routers(layout)
    logits = router_logits(1, 0)
    routes = rollout_routes(1, logits.shape[1], NUM_LAYERS)
    per_layer = [routes[:, layer].clone() for layer in range(NUM_LAYERS)]
    megatron = replaced_names()
    found: dict = {}

    def restored() -> dict[str, bool]:
        """Whether each replaced name holds Megatron-core's own object again."""
        return {name: held is megatron[name] for name, held in replaced_names().items()}

    def route_all(action):
        RouterReplay.set_global_router_replay_action(action)
        maps = [router.routing(layer_logits[:, None, :])[1] for router, layer_logits in zip(built, logits)]
        RouterReplay.clear_global_router_replay_action()
        return maps

    def outcome(body, *args, **settings) -> str:
        try:
            with partial_replay(*args, **settings) as replay:
                body(replay)
        except (NothingReplayed, NativeRoutesMissing, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    def record(replay):
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        for router, layer_logits in zip(built, logits):
            router.routing(layer_logits[:, None, :])
        found["recorded"] = [replay_.get_recorded_indices().clone() for replay_ in RouterReplay.global_router_replay_instances]
        found["inside"] = restored()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    found["record"] = outcome(record, "random", 0.4)
    found["after_record"] = restored()
    found["native_routing"] = outcome(lambda replay: route_all(None), "random", 0.4)
    RouterReplay.set_replay_data(per_layer)  # handed before the context: Megatron-core's own, full replay
    found["handed_outside"] = outcome(lambda replay: route_all(RouterReplayAction.REPLAY_FORWARD), "random", 0.4)
    found["full_outside"] = route_all(RouterReplayAction.REPLAY_FORWARD)
    RouterReplay.clear_global_indices()
    found["none_policy"] = outcome(lambda replay: route_all(None), "none")

    def without_native_pass(replay):
        RouterReplay.set_replay_data(per_layer)
        route_all(RouterReplayAction.REPLAY_FORWARD)

    found["mismatch_without_native_pass"] = outcome(without_native_pass, "mismatch", 0.5)
    RouterReplay.clear_global_indices()
    found["bad_budget"] = outcome(lambda replay: None, "random", 1.5)
    found["float_routes"] = outcome(lambda replay: RouterReplay.set_replay_data([t.float() for t in per_layer]),
                                    "random", 0.4)
    found["bad_boundaries"] = outcome(lambda replay: replay.sequences([0, 9, 4]), "random", 0.4)

    def boundaries_elsewhere(replay):
        replay.sequences([0, 5, 9])
        RouterReplay.set_replay_data(per_layer)

    found["boundaries_elsewhere"] = outcome(boundaries_elsewhere, "random", 0.4)
    RouterReplay.clear_global_indices()
    found["after_refusal"] = restored()

    def crash(replay):
        raise KeyError("the loop's own error")

    try:
        with partial_replay("random", 0.4):
            crash(None)
    except KeyError as error:
        found["crash"] = str(error)
    found["after_crash"] = restored()

    # Host syncs of one router call: Megatron-core's own full replay, then ablate's partial replay.
    found["syncs"] = {}
    for name in ("megatron", "ablate"):
        context = partial_replay("random", 0.4) if name == "ablate" else contextlib.nullcontext()
        with context:
            RouterReplay.set_replay_data([targets.clone() for targets in per_layer])
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            with HostSyncs() as syncs:
                for router, layer_logits in zip(built, logits):
                    router.routing(layer_logits[:, None, :])
            found["syncs"][name] = syncs.seen
            RouterReplay.clear_global_indices()
            RouterReplay.clear_global_router_replay_action()
    with HostSyncs() as syncs:  # the counter sees what it is for: a value read back, a boolean index
        values = torch.arange(4.0)
        values[values > 1].sum().item()
    found["syncs"]["known"] = syncs.seen
    found["natives"] = [layer_logits.topk(TOPK, dim=-1).indices for layer_logits in logits]
    found["routes"] = per_layer
    torch.save(found, out_path)
    dist.destroy_process_group()
