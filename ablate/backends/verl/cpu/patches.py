"""Runtime patches of verl, mbridge and megatron-core that a CPU run needs, each named and counted.

Every patch stands in for code that only runs with CUDA or Transformer Engine, so each is also a
part of the GPU path the CPU run does not exercise; docs/verl-cpu.md lists them by name. Each
names the training engines whose CPU run needs it: :func:`apply_all` applies those of one
engine, once per process, and returns their names. Every verl, mbridge or Megatron-core name a
patch replaces is a row of :mod:`ablate.backends.verl.entry_points` and is replaced through it, its
signature checked.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ablate.backends.verl import entry_points as ep
from ablate.backends.verl.entry_points import CUDA_LITERAL_MODULES, MEGATRON_ENGINE_MODULE, VEOMNI_ENGINE_MODULE
from ablate.backends.verl.import_hooks import when_imported


MEGATRON = ("megatron",)
EVERY_ENGINE = ("megatron", "veomni")


@dataclass(frozen=True)
class Patch:
    name: str
    #: what is replaced and why (the docs page says the same).
    reason: str
    apply: Callable[[], None]
    #: the engines (``backend.engine``) whose CPU run needs it.
    engines: tuple[str, ...] = MEGATRON


def _gloo_process_group() -> None:
    point = ep.cpu_point("verl.utils.distributed", "initialize_global_process_group_ray")
    original = ep.original(point)

    def initialize(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    def by_name(engine_workers) -> None:  # it imports the function by name
        ep.replace(ep.cpu_point("verl.workers.engine_workers", "initialize_global_process_group_ray"), initialize)

    ep.replace(point, initialize)
    # Once imported, not before: verl's worker module imports every engine (seconds in each process).
    when_imported("verl.workers.engine_workers", by_name)


def _local_layer_spec() -> None:
    from mbridge.core import llm_bridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def layer_spec(self, vp_stage=None):
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _packed_attention_class()
        return spec

    ep.replace(ep.cpu_point(llm_bridge.__name__, "LLMBridge._get_transformer_layer_spec"), layer_spec)


def _local_weight_names() -> None:
    point = ep.cpu_point("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_to_hf")
    original = ep.original(point)

    def te_name(name: str) -> str:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        return re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", r".mlp.experts.\2.weight\1", name)

    ep.replace(point, lambda self, mcore_weights_name: original(self, te_name(mcore_weights_name)))


def _cuda_calls() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kwargs: self


def _cuda_rng_tracker() -> None:
    ep.replace(ep.cpu_point("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork"),
               lambda self, name=None: contextlib.nullcontext())


def _cuda_literals() -> None:
    class TorchOnCpu(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    def on_cpu(factory):
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    proxy = TorchOnCpu("torch")
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like"):
        setattr(proxy, name, on_cpu(getattr(torch, name)))
    for module in CUDA_LITERAL_MODULES:
        ep.replace(ep.cpu_point(module, "torch"), proxy)


def _te_gemm_name() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _no_load_to_gpu() -> None:
    def no_load(transformer_impl) -> None:
        ep.replace(ep.cpu_point(transformer_impl.__name__, "load_megatron_model_to_gpu"),
                   lambda models, load_grad=True, load_frozen_params=True: None)

    when_imported(MEGATRON_ENGINE_MODULE, no_load)


def _veomni_full_precision() -> None:
    import functools

    def compute_in_fp32(transformer_impl) -> None:
        point = ep.cpu_point(transformer_impl.__name__, "MixedPrecisionConfig")
        ep.replace(point, functools.partial(ep.original(point), param_dtype="float32"))
        transformer_impl.VeOmniEngine._autocast_dtype = torch.float32  # read by FSDPEngine.forward_step

    when_imported(VEOMNI_ENGINE_MODULE, compute_in_fp32)


_ATTENTION: list[type] = []


def _packed_attention_class() -> type:
    """Megatron's local ``DotProductAttention`` extended to packed (THD) batches, one sequence at a time.

    verl packs R3 batches; on a GPU Transformer Engine's attention takes them, the local one
    refuses them. Causal SDPA per sequence of ``cu_seqlens`` gives the same result.
    """
    if _ATTENTION:
        return _ATTENTION[0]
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = packed_seq_params.cu_seqlens_q if bounds is None else bounds
            if query.dim() == 4:  # [tokens, 1, heads, head dim]
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            groups = query.shape[1] // key.shape[1]
            outputs = []
            for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                q = query[start:end].transpose(0, 1)
                k = key[start:end].transpose(0, 1).repeat_interleave(groups, 0)
                v = value[start:end].transpose(0, 1).repeat_interleave(groups, 0)
                outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
                               .transpose(0, 1))
            out = torch.cat(outputs, 0) if outputs else query.new_zeros(query.shape)
            if out.shape[0] < query.shape[0]:
                out = torch.cat([out, out.new_zeros(query.shape[0] - out.shape[0], *out.shape[1:])])
            return out.reshape(out.shape[0], -1)

    _ATTENTION.append(PackedDotProductAttention)
    return PackedDotProductAttention


PATCHES = (
    Patch("gloo_process_group",
          "verl.utils.distributed.initialize_global_process_group_ray: the CPU platform's backend string "
          "'cpu:gloo,cpu:gloo' is passed as plain 'gloo' (torch rejects the device-qualified form); NCCL is not used",
          _gloo_process_group, EVERY_ENGINE),
    Patch("local_layer_spec",
          "mbridge LLMBridge._get_transformer_layer_spec: Megatron's local layer spec instead of Transformer "
          "Engine's, with packed attention computed per sequence by SDPA; TE layers, fused kernels and TE's "
          "THD attention are not exercised",
          _local_layer_spec),
    Patch("local_weight_names",
          "mbridge Bridge._weight_name_mapping_mcore_to_hf: local-spec parameter names translated to the TE "
          "names mbridge maps (TP = EP = 1 only); mbridge's sharded weight export is not exercised",
          _local_weight_names),
    Patch("cuda_calls",
          "torch.cuda.current_device and Module.cuda / Tensor.cuda become no-ops (mbridge and Megatron move "
          "models with .cuda()); no host-device copies happen",
          _cuda_calls),
    Patch("cuda_rng_tracker",
          "megatron CudaRNGStatesTracker.fork is a null context: Megatron's per-rank CUDA random states "
          "(dropout under TP) are not exercised",
          _cuda_rng_tracker),
    Patch("cuda_literals",
          f"device='cuda' tensor factories in {len(CUDA_LITERAL_MODULES)} megatron-core modules (optimizer, "
          "clip_grads, grad_scaler, schedules, moe_utils, ...) create CPU tensors",
          _cuda_literals),
    Patch("te_gemm_name",
          "megatron moe_utils.te_general_gemm is undefined without Transformer Engine: defined as None",
          _te_gemm_name),
    Patch("no_load_to_gpu",
          "verl transformer_impl.load_megatron_model_to_gpu is a no-op: it assumes the distributed optimizer's "
          "buffers; parameter offload and reload are not exercised",
          _no_load_to_gpu),
    Patch("veomni_full_precision",
          "verl.workers.engine.veomni.transformer_impl: VeOmni's FSDP2 unshards parameters in float32 rather than "
          "bfloat16 (MixedPrecisionConfig's param_dtype, which verl 0.9.1 does not set) and FSDPEngine.forward_step "
          "runs without bf16 autocast (VeOmniEngine._autocast_dtype), so the CPU trainer computes in float32 like the "
          "CPU rollout and replay's effect on the log-probs is not lost in bf16 rounding; bf16 compute is not exercised",
          _veomni_full_precision, ("veomni",)),
)

_applied: list[str] = []


def apply_all(engine: str = "megatron") -> list[str]:
    """Apply every patch ``engine`` needs, once in this process; the names applied."""
    if not _applied:
        for patch in PATCHES:
            if engine in patch.engines:
                patch.apply()
                _applied.append(patch.name)
    return list(_applied)
