"""Every point where ablate's replay enters verl, Megatron-core or VeOmni, in one table.

ablate changes no file of verl or of an engine: it replaces a few names at run time. Each one is
an entry point below, with the function that replaces it (:mod:`ablate.replay.entry_points`
checks and replaces them). Each is checked twice:

- at launch, before anything is written, from the installed sources without importing them
  (:func:`check_sources`): a verl whose function moved, was renamed or lost a parameter the
  hook passes on fails the cell in one line naming it;
- when the hook installs in verl's actor (:func:`replace`): the live object, its signature
  inspected, so nothing is ever wrapped silently in the wrong place.

The Megatron-core block is what :func:`ablate.replay.megatron_core.partial_replay` replaces for the
length of its context in any Megatron-core loop, and what verl's Megatron seam replaces when verl
drives Megatron-core's own ``RouterReplay`` instead of its patched copy (:func:`router_replay_module`).

The CPU stand-ins of ``backend=verl_cpu`` (:mod:`ablate.backends.verl.cpu`) replace CUDA-only code
and a few of verl's private names, not replay; every verl, mbridge or Megatron-core name they replace
is a row here too (``cpu=True``), checked the same two ways when a cell runs on the CPU.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import ClassVar

from ablate.backends.verl.config import ENGINES, VERL_VERSION
from ablate.replay import entry_points, megatron_routers
from ablate.replay.entry_points import (  # the seams replace and restore through this module
    EntryPointMissing,
    check_params,
    imported_module,
    lookup,
    original,
    parsed_source,
    replace,
    replaced,
    restore,
    source_params,
    verify,
)

MEGATRON, VEOMNI, TRAINER = ENGINES["megatron"].name, ENGINES["veomni"].name, "trainer"


@dataclass(frozen=True)
class EntryPoint(entry_points.EntryPoint):
    """One name ablate's verl hook replaces (``engine``: the seam that replaces it; ``trainer``: verl's
    trainer process, for every engine): a refusal names the verl release it is written against."""

    against: ClassVar[str] = f"verl {VERL_VERSION} (REQUIRED_VERL.txt)"


MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
_MEGATRON_REPLAY = "verl.utils.megatron.router_replay_patch"
_MEGATRON_REPLAY_UTILS = "verl.utils.megatron.router_replay_utils"
VEOMNI_ENGINE_MODULE = "verl.workers.engine.veomni.transformer_impl"
_VEOMNI_REPLAY = "verl.utils.veomni.router_replay"
#: Megatron-core modules that create tensors with ``device="cuda"`` (or ``torch.cuda.current_device()``): a CPU
#: run gives each a ``torch`` of its own whose tensor factories make CPU tensors (:mod:`.cpu.patches`).
CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils", "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.utils", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data", "megatron.core.utils", "megatron.core.rerun_state_machine",
)
_ENGINE_INIT = ("self", "model_config", "engine_config", "optimizer_config", "checkpoint_config")
_FORWARD_BACKWARD = ("self", "data", "loss_function", "forward_only")

ENTRY_POINTS: tuple[EntryPoint, ...] = (
    # ---- Megatron (engines/megatron.py)
    EntryPoint(MEGATRON, MEGATRON_ENGINE_MODULE, "MegatronEngine.__init__", _ENGINE_INIT,
               "engines.megatron.arm: installs the hook once an R3 actor engine is built"),
    EntryPoint(MEGATRON, MEGATRON_ENGINE_MODULE, "MegatronEngine.forward_backward_batch", _FORWARD_BACKWARD,
               "engines.base.hooked_call: one hook call per verl call, the step's keys in its output"),
    EntryPoint(MEGATRON, MEGATRON_ENGINE_MODULE, "set_router_replay_data",
               ("layers_topk_idx", "attention_mask", "tf_config", "vp_rank"),
               "engines.megatron.MegatronSeam.set_router_replay_data: the micro-batch's mask, packed by verl"),
    EntryPoint(MEGATRON, _MEGATRON_REPLAY, "RouterReplay.set_target_indices", ("self", "topk_indices", "replay_mask"),
               "engines.megatron.MegatronSeam.set_target_indices: splits ablate's columns off the packed routes",
               during="one set_router_replay_data call"),
    EntryPoint(MEGATRON, _MEGATRON_REPLAY, "RouterReplay.get_replay_topk",
               ("self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"),
               "engines.megatron.MegatronSeam.get_replay_topk: the native top-k of each router to the hook"),
    EntryPoint(MEGATRON, "megatron.core.transformer.moe.router", "TopKRouter.routing", ("self", "logits"),
               "engines.megatron.MegatronSeam.routing: router-logit gradients to the Fisher estimate"),
    # ---- VeOmni (engines/veomni.py)
    EntryPoint(VEOMNI, VEOMNI_ENGINE_MODULE, "VeOmniEngine.__init__", _ENGINE_INIT,
               "engines.veomni.arm: installs the hook once an R3 actor engine is built"),
    EntryPoint(VEOMNI, VEOMNI_ENGINE_MODULE, "VeOmniEngine.forward_backward_batch", _FORWARD_BACKWARD,
               "engines.base.hooked_call: one hook call per verl call, the step's keys in its output"),
    EntryPoint(VEOMNI, VEOMNI_ENGINE_MODULE, "VeOmniEngineWithLMHead._prepare_router_replay_inputs",
               ("self", "micro_batch", "output_args"),
               "engines.veomni.VeOmniSeam.prepare_router_replay_inputs: the micro-batch's mask, padded and "
               "sliced by verl"),
    EntryPoint(VEOMNI, _VEOMNI_REPLAY, "VeOmniRouterReplay.begin_microbatch", ("self", "targets"),
               "engines.veomni.VeOmniSeam.begin_microbatch: splits ablate's columns off the per-layer targets",
               during="one _prepare_router_replay_inputs call"),
    EntryPoint(VEOMNI, _VEOMNI_REPLAY, "VeOmniRouterReplay.on_router_forward",
               ("self", "module", "routing_scores", "top_indices"),
               "engines.veomni.VeOmniSeam.on_router_forward: applies the mask, reports native routes and "
               "router-logit gradients"),
    # ---- verl's trainer, every engine (offpolicy.py)
    EntryPoint(TRAINER, "verl.trainer.ppo.v1.trainer_base", "calculate_debug_metrics", ("data",),
               "offpolicy.with_mismatch_metrics: the schema's mismatch/ keys"),
    EntryPoint(TRAINER, "verl.utils.debug.metrics", "calculate_debug_metrics", ("data",),
               "offpolicy.with_mismatch_metrics: the schema's mismatch/ keys"),
    # ---- the CPU stand-ins of backend=verl_cpu (cpu/): verl's, mbridge's and Megatron-core's names they replace
    *(EntryPoint(engine, module, name, params, f"cpu.{ablate}", cpu=True) for engine, module, name, params, ablate in (
        (TRAINER, "verl.utils.distributed", "initialize_global_process_group_ray", ("timeout_second", "backend"),
         "patches.gloo_process_group: gloo for the CPU platform's collectives"),
        (TRAINER, "verl.workers.engine_workers", "initialize_global_process_group_ray", ("timeout_second", "backend"),
         "patches.gloo_process_group: the worker module's own name for it"),
        (MEGATRON, "mbridge.core.llm_bridge", "LLMBridge._get_transformer_layer_spec", ("self", "vp_stage"),
         "patches.local_layer_spec: Megatron's local layer spec with packed attention"),
        (MEGATRON, "mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_to_hf", ("self", "mcore_weights_name"),
         "patches.local_weight_names: local-spec parameter names"),
        (MEGATRON, "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork", ("self", "name"),
         "patches.cuda_rng_tracker: no CUDA random states"),
        (MEGATRON, MEGATRON_ENGINE_MODULE, "load_megatron_model_to_gpu", ("models", "load_grad"),
         "patches.no_load_to_gpu: no offload and reload"),
        (VEOMNI, VEOMNI_ENGINE_MODULE, "MixedPrecisionConfig", None, "patches.veomni_full_precision: float32 parameters"),
        (TRAINER, "verl.trainer.ppo.v1.trainer_base", "uuid", None, "batch_order: counting prompt uids"),
        (TRAINER, "verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer._materialize_batch", ("self", "partition_id"),
         "batch_order: each step's batch sorted by prompt and sample"),
        (TRAINER, "verl.experimental.agent_loop.agent_loop", "AgentLoopWorker._run_agent_loop",
         ("self", "sampling_params", "trajectory"), "request_ids: each request named after its sample"),
        (TRAINER, "verl.workers.rollout.llm_server", "LLMServerClient._vllm_request_id", ("self", "request_id"),
         "request_ids: the request id the rollout is seeded by"),
        (TRAINER, "verl.workers.rollout.base", "_ROLLOUT_REGISTRY", None, "plugin: the CPU rollout, registered by name"),
        *((MEGATRON, module, "torch", None, "patches.cuda_literals: CPU tensor factories")
          for module in CUDA_LITERAL_MODULES),
    )),
    # ---- Megatron-core's own RouterReplay (ablate/replay/megatron_routers.py): partial_replay in any
    # Megatron-core loop, and verl's Megatron seam where verl drives this class instead of its patch
    *megatron_routers.MEGATRON_CORE_POINTS,
)


def cpu_point(module: str, name: str) -> EntryPoint:
    """The CPU stand-ins' row for ``module.name``."""
    for point in ENTRY_POINTS:
        if point.cpu and point.module == module and point.name == name:
            return point
    raise KeyError(f"{module}.{name} is not in ablate's entry-point table of the CPU stand-ins")


def entry(module: str, name: str) -> EntryPoint:
    """The table's entry for ``module.name``."""
    for point in ENTRY_POINTS:
        if point.module == module and point.name == name:
            return point
    raise KeyError(f"{module}.{name} is not in ablate's entry-point table")


def of_engine(engine: str, *, cpu: bool = False) -> tuple[EntryPoint, ...]:
    """The entry points a cell on ``engine`` uses: the engine's own and the trainer's (with ``cpu``,
    those of the CPU stand-ins too).

    On Megatron, the ``RouterReplay`` rows are those of the class verl drives (:func:`router_replay_module`).
    """
    points = tuple(point for point in ENTRY_POINTS
                   if point.engine in (engine, TRAINER) and (cpu or not point.cpu))
    if engine == MEGATRON and router_replay_module() == megatron_routers.ROUTER_REPLAY:
        points = (*(point for point in points if point.module != _MEGATRON_REPLAY),
                  megatron_routers.SET_TARGETS, megatron_routers.REPLAY_TOPK)
    return points


@functools.cache
def router_replay_module() -> str:
    """The module of the ``RouterReplay`` class verl's Megatron engine replays routes with, read from
    verl's sources without importing them.

    verl 0.9.1 drives its own patched copy (``verl.utils.megatron.router_replay_patch``); a verl
    that drives Megatron-core's own class (``megatron.core.transformer.moe.router_replay``) imports
    it from there instead. ``router_replay_utils``, which hands each router its targets, says which.
    """
    point = entry(MEGATRON_ENGINE_MODULE, "set_router_replay_data")
    path, statements = parsed_source(point, _MEGATRON_REPLAY_UTILS)
    for node in statements:
        if isinstance(node, ast.ImportFrom) and any(alias.name == "RouterReplay" for alias in node.names):
            return imported_module(_MEGATRON_REPLAY_UTILS, node, path)
    raise EntryPointMissing(f"{_MEGATRON_REPLAY_UTILS} imports no RouterReplay: ablate's Megatron seam replays "
                            f"through the RouterReplay class verl's Megatron engine drives, which it finds there "
                            f"(verl {VERL_VERSION}: {_MEGATRON_REPLAY}.RouterReplay)")


# ------------------------------------------------------------------ at launch: the sources only
def check_sources(engine: str, *, cpu: bool = False) -> None:
    """Check every entry point of ``engine`` (and the CPU stand-ins', with ``cpu``) in the installed
    sources, importing none of them.

    Raises :class:`EntryPointMissing` naming the first one that moved or changed.
    """
    for point in of_engine(engine, cpu=cpu):
        check_params(point, source_params(point))


__all__ = ["CUDA_LITERAL_MODULES", "ENTRY_POINTS", "MEGATRON_ENGINE_MODULE", "VEOMNI_ENGINE_MODULE", "EntryPoint",
           "EntryPointMissing", "check_params", "check_sources", "cpu_point", "entry", "lookup", "of_engine",
           "original", "replace", "replaced", "restore", "router_replay_module", "source_params", "verify"]
