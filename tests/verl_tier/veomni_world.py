"""Real VeOmni Qwen3-MoE blocks run the way verl 0.9.1's VeOmni engine runs R3, on CPU.

The model is a stack of VeOmni's own ``Qwen3MoeSparseMoeBlock`` (from the generated modeling
VeOmni picks on any non-NPU device: router, replay tap and experts are VeOmni's), with a
residual between blocks and no attention, in float64: a token's routes depend on that token
alone, so any layout must route exactly like one rank. verl's own ``VeOmniRouterReplay`` is
installed on it, as the engine does (``install`` -> ``set_active_replay``).

Micro-batches go through verl's own functions in the order ``VeOmniEngine.forward_backward_batch``
and ``FSDPEngineWithLMHead.prepare_model_inputs`` call them: the controller's ``begin_replay``,
the packed inputs padded (``pad_packed_inputs`` for a static bucket, ``ulysses_pad_and_slice_inputs``
for sequence parallelism), ``VeOmniEngineWithLMHead._prepare_router_replay_inputs`` (where the hook
sits), the forward, verl's check that every router fired, the backward (each block under non-
reentrant activation checkpointing in an update, as VeOmni trains, so routers fire twice), and
``clear``. Layouts: one rank, one rank padding to a static bucket, two FSDP2 ranks (data parallel,
parameters sharded), and Ulysses SP = 2 (one micro-batch's tokens split over two ranks).

``run(...)`` saves, per step, call and pass, the experts every router used and the native top-k
it computed for every (row, layer), and the step's metrics, gathered on rank 0.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

HIDDEN, NUM_EXPERTS, TOPK, NUM_LAYERS = 16, 8, 2, 4


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int = 1
    sp: int = 1
    #: pad every packed micro-batch to a multiple of this many tokens (verl's ``pad_to_length``), 0: no.
    bucket: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.sp


LAYOUTS = {layout.name: layout for layout in (
    Layout("single"), Layout("bucket16", bucket=16), Layout("fsdp2", dp=2), Layout("sp2", sp=2),
)}


@dataclass
class Sequence:
    tokens: int
    #: positions whose routes the rollout never recorded (a multi-turn gap): zeros.
    gap: tuple[int, int] = (0, 0)


#: Two micro-batches of ragged sequences; 31 and 29 tokens, so Ulysses SP = 2 pads each.
MICRO_BATCHES = [
    [Sequence(11, gap=(3, 6)), Sequence(7), Sequence(13)],
    [Sequence(9), Sequence(14, gap=(8, 9)), Sequence(6)],
]


def model_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=8, num_experts=NUM_EXPERTS,
                          num_experts_per_tok=TOPK, norm_topk_prob=True, num_hidden_layers=NUM_LAYERS,
                          num_attention_heads=2, num_key_value_heads=1, vocab_size=128)


class MoeStack(torch.nn.Module):
    """VeOmni's Qwen3-MoE blocks with a residual between them; ``config`` names the family (qwen3_moe)."""

    def __init__(self, config) -> None:
        from veomni.models.transformers.qwen3_moe.generated.patched_modeling_qwen3_moe_gpu import (
            Qwen3MoeSparseMoeBlock,
        )

        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(Qwen3MoeSparseMoeBlock(config) for _ in range(config.num_hidden_layers))
        self.double()
        for index, block in enumerate(self.layers):
            for name, param in block.named_parameters():
                seed = int.from_bytes(hashlib.blake2b(f"{index}/{name}".encode(), digest_size=8).digest(), "little")
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed % 2**63),
                                            dtype=param.dtype) * 0.5)

    def forward(self, hidden: torch.Tensor, *, checkpointed: bool = False) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.layers:
            hidden = hidden + (checkpoint(block, hidden, use_reentrant=False) if checkpointed else block(hidden))
        return hidden


# ------------------------------------------------------------------------------------ the batch
def recorded_routes(sequences: list[Sequence], start_row: int) -> list[torch.Tensor]:
    """What a rollout records in the VeOmni layout: one route per token, zeros on the final token and gaps."""
    parts = []
    for index, sequence in enumerate(sequences):
        generator = torch.Generator().manual_seed(2000 + start_row + index)
        scores = torch.rand(sequence.tokens, NUM_LAYERS, NUM_EXPERTS, generator=generator)
        routes = scores.topk(TOPK, dim=-1).indices.to(torch.int16)
        routes[-1] = 0
        routes[sequence.gap[0]:sequence.gap[1]] = 0
        parts.append(routes)
        start_row += sequence.tokens
    return parts


def nested(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def micro_batch(index: int) -> dict:
    """verl's no-padding micro-batch: nested input_ids (here: each token's global row id + 1) and routes."""
    start = sum(sequence.tokens for batch in MICRO_BATCHES[:index] for sequence in batch)
    rows, row = [], start
    for sequence in MICRO_BATCHES[index]:
        rows.append(torch.arange(row + 1, row + sequence.tokens + 1))
        row += sequence.tokens
    return {"input_ids": nested(rows), "routed_experts": nested(recorded_routes(MICRO_BATCHES[index], start))}


def hidden_states(rows: torch.Tensor) -> torch.Tensor:
    """The same input vector for a token (by its row) in every layout; zeros on padding (row 0)."""
    table = torch.randn(int(rows.max()) + 1, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    table[0] = 0
    return table[rows]


def loss_weights(rows: torch.Tensor) -> torch.Tensor:
    table = torch.randn(int(rows.max()) + 1, HIDDEN, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    table[0] = 0
    return table[rows]


# --------------------------------------------------------------------------------- the engine
class Capture:
    """Experts each router used and its native top-k, per (row, layer index), as sorted id tuples."""

    def __init__(self, model) -> None:
        self.used: dict[tuple[int, int], tuple[int, ...]] = {}
        self.native: dict[tuple[int, int], tuple[int, ...]] = {}
        #: the same (row, layer) routed twice with other experts (a recompute must repeat the forward).
        self.conflicts = 0
        self.rows: torch.Tensor | None = None
        self.handles = []
        for layer, block in enumerate(model.layers):
            self.handles.append(block.experts.register_forward_pre_hook(self._used(layer)))
            self.handles.append(block.gate.register_forward_hook(self._native(layer)))

    def _store(self, table, layer, indices) -> None:
        for row, ids in zip(self.rows.tolist(), indices.tolist()):
            if row > 0:
                value = tuple(sorted(ids))
                self.conflicts += table.setdefault((row, layer), value) != value

    def _used(self, layer):
        return lambda module, args: self._store(self.used, layer, args[1])

    def _native(self, layer):
        return lambda module, args, output: self._store(self.native, layer, output[2])

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def packed_rows(layout: Layout, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's packed rows (0 on padding) and the pad size, as verl pads and slices ``input_ids``."""
    from verl.utils.ulysses import ulysses_pad_and_slice_inputs
    from verl.workers.engine.utils import pad_packed_inputs

    packed, static = rows.unsqueeze(0), 0
    if layout.bucket:
        static = -packed.shape[-1] % layout.bucket
        packed, _ = pad_packed_inputs(packed, None, static)
    sp_pad = 0
    if layout.sp > 1:
        packed, _, sp_pad = ulysses_pad_and_slice_inputs(packed, None, sp_size=layout.sp)
    return packed.squeeze(0), static + sp_pad


def run_call(layout: Layout, engine, model, batches: list[dict], *, forward_only: bool,
             last_update: bool) -> tuple[list[dict], int, dict[str, float] | None]:
    """One ``forward_backward_batch`` call of verl's VeOmni engine with R3, through the hook's wrapper.

    Returns every pass the call ran, each with the experts every router used and its native
    top-k per (row, layer), gathered over ranks; the pass verl got back; and the step's metrics
    (None but at the step's last update call).
    """
    from tensordict import TensorDict

    from ablate.backends.verl import engines
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.veomni.transformer_impl import VeOmniEngineWithLMHead

    def batch_dict(parts: list[dict]) -> TensorDict:
        data = TensorDict({key: nested([t for part in parts for t in part[key].unbind()])
                           for key in ("input_ids", "routed_experts")},
                          batch_size=[sum(len(part["input_ids"].unbind()) for part in parts)])
        return data

    data = batch_dict(batches)
    tu.assign_non_tensor(data, enable_routing_replay=True)
    if not forward_only:
        tu.assign_non_tensor(data, update_lr_scheduler=last_update)
    passes = []
    controller = engine._router_replay

    def forward_backward_batch(engine, data, loss_function, forward_only=False):
        from worlds import gather_ranks

        capture = Capture(model)
        controller.begin_replay()
        try:
            for batch in batches:
                rows, pad_size = packed_rows(layout, batch["input_ids"].values())
                capture.rows = rows
                VeOmniEngineWithLMHead._prepare_router_replay_inputs(engine, batch_dict([batch]),
                                                                     {"pad_size": pad_size})
                hidden = hidden_states(rows).unsqueeze(0).requires_grad_(not forward_only)
                with torch.set_grad_enabled(not forward_only):
                    output = model(hidden, checkpointed=not forward_only)
                assert controller.num_fired == controller.num_targets, "verl's check after each forward"
                if not forward_only:
                    (output * loss_weights(rows).unsqueeze(0)).sum().backward()
        finally:
            controller.clear()
            capture.close()
        passes.append({"used": gather_ranks(capture.used), "native": gather_ranks(capture.native),
                       "conflicts": capture.conflicts})
        return {"metrics": {}, "pass": len(passes) - 1}

    output = engines.hooked_call(engines.active_hook(), forward_backward_batch, engine, data, None, forward_only)
    metrics = {key: values[0] for key, values in output["metrics"].items()} or None
    return passes, output["pass"], metrics


def build_engine(layout: Layout):
    """The model (FSDP2-sharded over every rank when there are several), verl's controller on it,
    and a stand-in for the engine's attributes ``_prepare_router_replay_inputs`` reads."""
    from types import SimpleNamespace

    from verl.utils.veomni.router_replay import VeOmniRouterReplay

    config = model_config()
    model = MoeStack(config)
    if layout.world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (layout.world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    controller = VeOmniRouterReplay()
    controller.install(model)
    engine = SimpleNamespace(_router_replay=controller, use_ulysses_sp=layout.sp > 1,
                             model_config=SimpleNamespace(hf_config=config), is_mp_src_rank_with_outputs=lambda: True)
    return model, engine


def init(layout: Layout) -> None:
    """VeOmni's parallel state (the seam reads its SP group) and verl's Ulysses group, on a gloo world."""
    from veomni.distributed import parallel_state

    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    torch.set_num_threads(1)
    parallel_state.init_parallel_state(dp_size=layout.dp, dp_shard_size=layout.dp, ulysses_size=layout.sp,
                                       dp_mode="fsdp2", device_type="cpu")
    if layout.sp > 1:
        set_ulysses_sequence_parallel_group(parallel_state.get_parallel_state().sp_group)


def run_policy(layout: Layout, policy: str, budget: float | None, settings: dict, mine: list[dict],
               steps: int = 2) -> list[dict]:
    """Two training steps of one policy (:func:`worlds.training_steps`)."""
    from ablate.backends.verl import engines
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.replay import ReplaySpec
    from ablate.policies import PolicySpec

    from worlds import training_steps

    model, engine = build_engine(layout)
    engines.install(HookSettings(ReplaySpec(PolicySpec(policy, settings), budget, seed=5), engine="veomni").make_hook())
    try:
        return training_steps(functools.partial(run_call, layout, engine, model), mine, steps)
    finally:
        engines.uninstall()
        engine._router_replay.uninstall()


def run(rank: int, layout: Layout, port: int, policies: list[tuple[str, float | None, dict]], out_path: str) -> None:
    """Entry point of one rank: every policy for two steps; rank 0 saves what was routed and logged."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=layout.world)
    init(layout)
    batches = [micro_batch(index) for index in range(len(MICRO_BATCHES))]
    dp_rank = rank // layout.sp  # VeOmni's mesh puts the Ulysses ranks of one replica next to each other
    mine = batches[dp_rank::layout.dp]
    results = {policy: run_policy(layout, policy, budget, settings, mine) for policy, budget, settings in policies}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
