"""A real small Megatron MoE model run the way verl 0.9.1's Megatron engine runs R3, on CPU.

Each rank builds Megatron's own ``TransformerBlock`` chunks from Megatron's GPT layer specs: a
dense first layer and MoE layers (``TopKRouter``, ``SequentialMLP`` experts, the all-gather
token dispatcher), split by Megatron over tensor (with sequence parallelism), context, pipeline
and virtual-pipeline parallelism in a gloo world. Attention and norms are identity modules: the
routes depend on each token alone, so any layout must route exactly like one rank.

Micro-batches go through verl's own functions in the order ``MegatronEngine.forward_step``
calls them: ``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data``
through ``transformer_impl``'s namespace (where the hook sits), the forward, and the
``REPLAY_BACKWARD`` switch. Hidden states are packed for each rank with verl's
``preprocess_thd_engine`` and Megatron's sequence-parallel scatter, the layout verl's model
forward gives them. What Megatron itself cannot do on a CPU is shimmed in :func:`cpu_shims`
and nowhere else; pipeline stages hand activations over with plain broadcasts.

``run(...)`` saves, per step, call and pass, the experts every router used for every (token,
layer) and the model's output per token, and the step's metrics, gathered on rank 0.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

HIDDEN, NUM_EXPERTS, TOPK = 16, 8, 2
#: layer 1 is dense (DeepSeek-V3 / Moonlight style first-k-dense); layers 2..8 are MoE.
MOE_LAYER_FREQ = [0, 1, 1, 1, 1, 1, 1, 1]
NUM_LAYERS = len(MOE_LAYER_FREQ)


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("single"),
        Layout("tp2_sp", tp=2),
        Layout("cp2", cp=2),
        Layout("pp2", pp=2),
        Layout("pp2_vpp2", pp=2, vpp=2),
        Layout("dp2", dp=2),
    )
}


# ------------------------------------------------------------------------------------ the batch
@dataclass
class Sequence:
    tokens: int
    response: int
    #: positions whose routes the rollout never recorded (a multi-turn gap): zeros.
    gap: tuple[int, int] = (0, 0)


#: Two micro-batches; lengths are not multiples of TP * CP * 2, so verl pads every sequence.
MICRO_BATCHES = [
    [Sequence(11, 6, gap=(3, 6)), Sequence(7, 4), Sequence(13, 0)],
    [Sequence(9, 5), Sequence(14, 9, gap=(8, 9)), Sequence(6, 3)],
]


def recorded_routes(sequences: list[Sequence], start_row: int) -> list[torch.Tensor]:
    """What a rollout engine records: one route per token but the last, zeros on dense layers and gaps."""
    parts = []
    for index, sequence in enumerate(sequences):
        generator = torch.Generator().manual_seed(1000 + start_row + index)
        routes = torch.zeros(sequence.tokens - 1, NUM_LAYERS, TOPK, dtype=torch.int16)
        for layer, moe in enumerate(MOE_LAYER_FREQ):
            if moe:
                scores = torch.rand(sequence.tokens - 1, NUM_EXPERTS, generator=generator)
                routes[:, layer] = scores.topk(TOPK, dim=-1).indices.to(torch.int16)
        routes[sequence.gap[0] : sequence.gap[1]] = 0
        parts.append(routes)
        start_row += sequence.tokens
    return parts


def nested(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def micro_batch_tensors(index: int) -> dict[str, torch.Tensor]:
    """verl's no-padding micro-batch: nested input_ids, response_mask and routed_experts."""
    start = sum(sequence.tokens for batch in MICRO_BATCHES[:index] for sequence in batch)
    sequences = MICRO_BATCHES[index]
    input_ids, rows, response = [], [], []
    row = start
    for sequence in sequences:
        input_ids.append(torch.arange(row, row + sequence.tokens) % 997)
        rows.append(torch.arange(row + 1, row + sequence.tokens + 1))
        response.append(torch.ones(sequence.response, dtype=torch.long) if sequence.response else torch.zeros(0, dtype=torch.long))
        row += sequence.tokens
    return {
        "input_ids": nested(input_ids), "rows": nested(rows), "response_mask": nested(response),
        "routed_experts": nested(recorded_routes(sequences, start)), "start": start,
    }


def hidden_states(rows: torch.Tensor) -> torch.Tensor:
    """The same input vector for a token (by its row) in every layout: float64, seeded by row."""
    generator = torch.Generator().manual_seed(7)
    table = torch.randn(int(rows.max()) + 1, HIDDEN, generator=generator, dtype=torch.float64)
    table[0] = 0  # padding rows
    return table[rows]


def loss_weights(rows: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    table = torch.randn(int(rows.max()) + 1, HIDDEN, generator=generator, dtype=torch.float64)
    table[0] = 0
    return table[rows]


# --------------------------------------------------------------------------------- Megatron
def cpu_shims() -> None:
    """Where Megatron-Core 0.16.1 and verl assume CUDA; everything else runs as is.

    ``Router.gating`` moves the router weight to ``torch.cuda.current_device()``, the sequence-
    parallel block forward forks the CUDA RNG tracker, ``RouterGatingLinearFunction`` reads a
    Transformer Engine symbol that is undefined without Transformer Engine, and verl's
    ``router_replay_utils`` moves routes to the device its platform registry names, which is
    "cuda" even on a machine without one.
    """
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = "cpu"

    torch.cuda.current_device = lambda: torch.device("cpu")
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the MoE model: the tests' tiny float64 one by default (routes equal in every layout)."""

    hidden: int = HIDDEN
    experts: int = NUM_EXPERTS
    topk: int = TOPK
    ffn: int = 8
    moe_layer_freq: tuple[int, ...] = tuple(MOE_LAYER_FREQ)
    dtype: torch.dtype = torch.float64
    router_dtype: str = "fp64"
    dispatcher: str = "allgather"
    #: build on the CPU and set the same weights in every layout (tests); else Megatron's own init
    #: on the current device (benchmarks).
    same_weights: bool = True


def transformer_config(layout: Layout, shape: ModelShape = ModelShape()):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()  # verl's patch lets TransformerConfig take enable_routing_replay
    return TransformerConfig(
        num_layers=len(shape.moe_layer_freq), hidden_size=shape.hidden, num_attention_heads=2, ffn_hidden_size=shape.ffn,
        moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts, moe_router_topk=shape.topk,
        moe_layer_freq=list(shape.moe_layer_freq), moe_router_load_balancing_type="none",
        moe_token_dispatcher_type=shape.dispatcher, moe_router_dtype=shape.router_dtype, enable_routing_replay=True,
        use_cpu_initialization=shape.same_weights, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=shape.dtype, pipeline_dtype=shape.dtype, bf16=shape.dtype == torch.bfloat16,
        tensor_model_parallel_size=layout.tp, sequence_parallel=layout.tp > 1, context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
    )


def build_chunks(layout: Layout, config, shape: ModelShape = ModelShape()) -> list:
    """This rank's model chunks: Megatron's GPT decoder layers with identity attention and norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlock

    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage if layout.vpp else None)
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.input_layernorm = IdentityOp
            layer_spec.submodules.self_attention = IdentityOp
            layer_spec.submodules.self_attn_bda = IdentityFuncOp
            layer_spec.submodules.pre_mlp_layernorm = IdentityOp
        chunk = TransformerBlock(config, spec, pre_process=True, post_process=False,
                                 vp_stage=vp_stage if layout.vpp else None)
        chunk.vp_stage = vp_stage
        if shape.same_weights:
            set_layout_independent_weights(chunk)
        chunks.append(chunk)
    return chunks


def set_layout_independent_weights(chunk) -> None:
    """Weights from (layer number, name), sharded like Megatron shards them: equal in every layout."""
    from megatron.core import parallel_state as mpu

    for layer in chunk.layers:
        for name, param in layer.named_parameters():
            full_shape = list(param.shape)
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded:
                expert = not getattr(param, "allreduce", True)
                size = mpu.get_expert_tensor_parallel_world_size() if expert else mpu.get_tensor_model_parallel_world_size()
                rank = mpu.get_expert_tensor_parallel_rank() if expert else mpu.get_tensor_model_parallel_rank()
                full_shape[param.partition_dim] *= size
            seed = int.from_bytes(hashlib.blake2b(f"{layer.layer_number}/{name}".encode(), digest_size=8).digest(), "little")
            full = torch.randn(full_shape, generator=torch.Generator().manual_seed(seed % 2**63), dtype=param.dtype) * 0.5
            with torch.no_grad():
                param.copy_(full.chunk(size, dim=param.partition_dim)[rank] if sharded else full)


def local_rows(values: torch.Tensor) -> torch.Tensor:
    """A nested per-token tensor packed for this rank as verl packs routes and inputs."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    from verl.models.mcore.util import preprocess_thd_engine

    packed, _, _ = preprocess_thd_engine(values, pre_process=True, cp_layout="zigzag")
    return scatter_to_sequence_parallel_region(packed.squeeze(0))


# ---------------------------------------------------------------------------------- a run
class Capture:
    """Experts each router used, per (global row id, layer number), as a bitmask of expert ids."""

    def __init__(self) -> None:
        self.used: dict[tuple[int, int], int] = {}
        self.rows: torch.Tensor | None = None

    def __call__(self, router, inputs, output) -> None:
        _, routing_map = output
        bits = (routing_map.long() * (1 << torch.arange(routing_map.shape[-1]))).sum(-1)
        for row, value in zip(self.rows.tolist(), bits.tolist()):
            if row > 0:
                self.used[(row, router.layer_number)] = value


def stage_order(layout: Layout) -> list[tuple[int, int]]:
    """(pipeline rank, virtual stage) of each model chunk, in model order."""
    return [(pp, vp) for vp in range(layout.vpp or 1) for pp in range(layout.pp)]


def handover(layout: Layout, tensor: torch.Tensor, owner_pp: int) -> torch.Tensor:
    """The owner stage's tensor, on every rank of the pipeline group (a plain broadcast)."""
    if layout.pp == 1:
        return tensor
    from megatron.core import parallel_state as mpu

    group = mpu.get_pipeline_model_parallel_group()
    shared = tensor.detach().clone()
    dist.broadcast(shared, src=dist.get_global_rank(group, owner_pp), group=group)
    return shared


def run_call(layout: Layout, config, chunks, batches: list[dict], *, forward_only: bool,
             last_update: bool) -> tuple[list[dict], int, dict[str, float] | None]:
    """One ``forward_backward_batch`` call of verl's Megatron engine with R3, through the hook's wrapper.

    The call is described by verl's own batch TensorDict and goes through ``engines.hooked_call``,
    as verl's engine method does once the hook is installed; the micro-batch loop stands in for
    Megatron's schedule. Returns every pass the call ran (``mismatch``'s old-log-prob call runs a
    native pass first), each with the experts every router used and the model's output per token
    (a scalar of the last hidden state: what log-probs are computed from), gathered over ranks;
    the index of the pass whose output verl got back; and the step's metrics (None but at the
    step's last update call).
    """
    from types import SimpleNamespace

    from megatron.core import parallel_state as mpu
    from tensordict import TensorDict

    from ablate.backends.verl import engines
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        RouterReplayHelper,
        align_r3_router_replay_data,
        build_r3_replay_mask,
        set_model_router_replay_action,
    )
    from verl.workers.engine.megatron import transformer_impl

    sequences = sum(len(batch["input_ids"].unbind()) for batch in batches)
    data = TensorDict({
        "input_ids": nested([t for batch in batches for t in batch["input_ids"].unbind()]),
        "routed_experts": nested([t for batch in batches for t in batch["routed_experts"].unbind()]),
    }, batch_size=[sequences])
    tu.assign_non_tensor(data, enable_routing_replay=True)
    if not forward_only:
        tu.assign_non_tensor(data, update_lr_scheduler=last_update)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    stages = stage_order(layout)
    passes = []

    def forward_backward_batch(engine, data, loss_function, forward_only=False):
        from worlds import gather_ranks

        capture = Capture()
        handles = [module.register_forward_hook(capture) for chunk in chunks for module in chunk.modules()
                   if type(module).__name__ == "TopKRouter"]
        outputs = {}
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        for batch in batches:
            rows = local_rows(batch["rows"])
            capture.rows = rows
            hidden = hidden_states(rows).unsqueeze(1)
            kept = []
            for pp, vp in stages:
                if pp == pp_rank:
                    chunk = chunks[vp]
                    if RouterReplayHelper.is_replay_backward_action(config, vp, model=chunk):
                        set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_FORWARD)
                    if RouterReplayHelper.is_replay_forward_action(config, vp, model=chunk):
                        routes = align_r3_router_replay_data(batch["routed_experts"], batch["input_ids"])
                        mask = build_r3_replay_mask(batch["input_ids"], batch["response_mask"])
                        transformer_impl.set_router_replay_data(routes, None, config, vp, replay_mask=mask, model=chunk)
                    inputs = hidden.detach().requires_grad_(not forward_only)
                    with torch.set_grad_enabled(not forward_only):
                        hidden = chunk(inputs, attention_mask=None)
                    kept.append((inputs, hidden))
                    set_model_router_replay_action(chunk, RouterReplayAction.REPLAY_BACKWARD)
                hidden = handover(layout, hidden, pp)
            # loss = sum(output * weights): its gradient with respect to the last output is the weights.
            grad = loss_weights(rows).unsqueeze(1)
            per_token = (hidden.detach() * grad).sum((1, 2))
            outputs.update((row, value) for row, value in zip(rows.tolist(), per_token.tolist()) if row > 0)
            if forward_only:
                continue
            for pp, _ in reversed(stages):
                if pp == pp_rank:
                    inputs, output = kept.pop()
                    torch.autograd.backward(output, grad)
                    grad = inputs.grad
                grad = handover(layout, grad, pp)
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()
        for handle in handles:
            handle.remove()
        passes.append({"used": gather_ranks(capture.used), "outputs": gather_ranks(outputs)})
        return {"metrics": {}, "pass": len(passes) - 1}

    output = engines.hooked_call(engines.active_hook(), forward_backward_batch, SimpleNamespace(tf_config=config), data,
                               None, forward_only)
    metrics = {key: values[0] for key, values in output["metrics"].items()} or None
    return passes, output["pass"], metrics


def run(rank: int, layout: Layout, port: int, policies: list[tuple[str, float, dict]], out_path: str) -> None:
    """Entry point of one rank: every policy for two steps; rank 0 saves what was routed and logged."""
    from megatron.core import parallel_state as mpu

    from ablate.backends.verl import engines
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.replay import ReplaySpec
    from ablate.policies import PolicySpec
    from worlds import training_steps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=layout.world)
    torch.set_num_threads(1)
    cpu_shims()
    mpu.initialize_model_parallel(layout.tp, layout.pp, virtual_pipeline_model_parallel_size=layout.vpp,
                                  context_parallel_size=layout.cp)
    config = transformer_config(layout)
    batches = [micro_batch_tensors(index) for index in range(len(MICRO_BATCHES))]
    mine = batches[mpu.get_data_parallel_rank()::layout.dp]
    results = {}
    for policy, budget, settings in policies:
        chunks = build_chunks(layout, config)
        engines.install(HookSettings(ReplaySpec(PolicySpec(policy, settings), budget, seed=5)).make_hook())
        results[policy] = training_steps(functools.partial(run_call, layout, config, chunks), mine)
        engines.uninstall()
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
