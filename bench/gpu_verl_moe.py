"""A Megatron MoE forward and backward with verl's R3 patch, plain and through ablate's hook.

For one micro-batch of 8,192 tokens (32 sequences of 256 and 3 of 2,731), on a Megatron
``TransformerBlock`` of MoE layers built from Megatron's GPT specs (attention and norms left out:
the routers, experts and token dispatcher are Megatron's own), it times one training micro-step:

- ``R3``: verl's ``set_router_replay_data`` with R3's per-token mask, forward, backward;
- ``ablate <policy>``: the same as an update call through the hook (its ``forward_backward_batch``
  frame, the mask selection, verl's packing of the augmented routes, the native routes and
  Fisher gradients the routers report, the counts at the end of the call), after one closed
  step (so ``fisher`` has an estimate) and an old-log-prob pass (``mismatch``'s native routes).

It prints each arm's median time, the hook's overhead over ``R3`` and against the forward of the
same MoE layers (goal: under 2%), and, on CUDA, the host syncs CUDA's own sync debug mode
(``torch.cuda.set_sync_debug_mode``) counts in one hooked micro-batch beyond verl's R3 alone. verl's router-replay
modules are loaded without ``verl/__init__`` (which imports Ray and verl's trainer stack), so
only Megatron-Core, verl, tensordict, transformers and their pure-Python needs must be installed
next to torch (``bench/gpu/prepare.sh``).

    python bench/gpu_verl_moe.py [--device cuda] [--layers 4] [--hidden 2048] [--experts 128] [--topk 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from bench_verl_hook import LAYOUTS, cuda_syncs, median_time

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "verl_tier"))  # megatron_world builds the Megatron MoE block


def load_verl_router_replay() -> None:
    """verl's packages as plain namespaces: importing a submodule skips their ``__init__`` files."""
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    for name in ("verl", "verl.utils", "verl.models", "verl.models.mcore", "verl.utils.megatron"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package


def micro_batch(lengths: list[int], layers: int, experts: int, topk: int, device: torch.device):
    """verl's jagged micro-batch: input ids, a response in each sequence, rollout routes but the last."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.nested.as_nested_tensor(
        [torch.randint(0, 1000, (n,), generator=generator) for n in lengths], layout=torch.jagged)
    response = torch.nested.as_nested_tensor([torch.ones(n // 2, dtype=torch.long) for n in lengths], layout=torch.jagged)
    routes = [torch.rand(n - 1, layers, experts, generator=generator).topk(topk, dim=-1).indices.to(torch.int16)
              for n in lengths]
    return input_ids.to(device), response.to(device), torch.nested.as_nested_tensor(routes, layout=torch.jagged).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default="random,uniform,fisher,mismatch")
    args = parser.parse_args()
    device = torch.device(args.device)
    load_verl_router_replay()
    import megatron_world as world
    from megatron.core import parallel_state as mpu

    from ablate.backends.verl.engines.megatron import layer_columns
    from ablate.backends.verl.hook_settings import HookSettings
    from ablate.replay import ReplaySpec
    from ablate.replay.seams import CallInfo
    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        align_r3_router_replay_data,
        build_r3_replay_mask,
        set_model_router_replay_action,
    )

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        world.cpu_shims()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # Megatron-Core 0.16.1 without Transformer Engine
        moe_utils.te_general_gemm = None
    mpu.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    router_replay_utils.device_name = device.type
    layout = world.LAYOUTS["single"]
    shape = world.ModelShape(hidden=args.hidden, experts=args.experts, topk=args.topk, ffn=args.ffn,
                             moe_layer_freq=(1,) * args.layers, same_weights=False, router_dtype="fp32",
                             dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                             dispatcher="alltoall" if device.type == "cuda" else "allgather")
    config = world.transformer_config(layout, shape)
    (block,) = world.build_chunks(layout, config, shape)
    block.to(device)
    print(f"Megatron MoE block: {args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts, top-{args.topk}, "
          f"expert ffn {args.ffn}, {shape.dtype}, on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})")

    def step(lengths, input_ids, response, routes, hook, *, forward_only=False, last_update=False) -> None:
        """One micro-batch call as verl's forward_backward_batch and forward_step run it."""
        tokens = sum(lengths)
        if hook is not None:
            columns = layer_columns(config, args.layers)
            hook.begin_call(CallInfo(forward_only=forward_only, last_update=last_update, num_tokens=tokens,
                                     route_layers=args.layers, topk=args.topk, num_experts=args.experts,
                                     layer_columns=columns))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        aligned = align_r3_router_replay_data(routes, input_ids)
        mask = build_r3_replay_mask(input_ids, response)
        if hook is None:
            router_replay_utils.set_router_replay_data(aligned, None, config, 0, replay_mask=mask, model=block)
        else:
            hook.seam.set_router_replay_data(router_replay_utils.set_router_replay_data, aligned, None, config, 0,
                                             replay_mask=mask, model=block)
        hidden = torch.randn(tokens, 1, args.hidden, device=device, dtype=shape.dtype, requires_grad=not forward_only)
        with torch.set_grad_enabled(not forward_only):
            output = block(hidden, attention_mask=None)
        set_model_router_replay_action(block, RouterReplayAction.REPLAY_BACKWARD)
        if not forward_only:
            output.float().square().mean().backward()
        if hook is not None:
            hook.end_call()
            hook.seam.end_pass()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    print(f"\n{'layout':<10} {'arm':<18} {'ms / micro-batch':>17} {'hook overhead':>14} {'of the forward':>15} "
          f"{'syncs (CUDA)':>13}")
    for layout_name, lengths in LAYOUTS.items():
        batch = micro_batch(lengths, args.layers, args.experts, args.topk, device)
        plain = median_time(args.repeats, lambda: step(lengths, *batch, None))
        forward = median_time(args.repeats, lambda: step(lengths, *batch, None, forward_only=True))
        plain_syncs = cuda_syncs(device, lambda: step(lengths, *batch, None))
        print(f"{layout_name:<10} {'R3 (verl)':<18} {plain * 1e3:>17.1f} {'':>14} {'':>15} {plain_syncs:>13}")
        for policy in args.policies.split(","):
            hook = HookSettings(ReplaySpec.of(policy, 0.25, seed=0)).make_hook()
            hook.seam.install_routers()
            step(lengths, *batch, hook, last_update=True)  # one closed step: fisher has an estimate
            step(lengths, *batch, hook, forward_only=True)  # the old-log-prob pass: mismatch's native routes
            hooked = median_time(args.repeats, lambda: step(lengths, *batch, hook))  # updates in that step
            syncs = cuda_syncs(device, lambda: step(lengths, *batch, hook))
            hook.seam.uninstall()
            # The hook's time against the forward of the same MoE layers (goal: under 2%), and the
            # syncs CUDA's own sync debug mode saw that verl's R3 alone does not make (goal: at most 4).
            added = syncs - plain_syncs if isinstance(syncs, int) else syncs
            print(f"{layout_name:<10} {'ablate ' + policy:<18} {hooked * 1e3:>17.1f} {(hooked - plain) / plain:>13.1%} "
                  f"{(hooked - plain) / forward:>14.1%} {added:>13}")
    if device.type == "cuda":
        print(f"\npeak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
