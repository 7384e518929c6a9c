"""Every point where ablate's replay hook enters verl, Megatron-core or VeOmni, in one table.

ablate changes no file of verl or of an engine: it replaces a few names at run time. Each one is
an :class:`EntryPoint` below, with the function that replaces it. Each is checked twice:

- at launch, before anything is written, from the installed sources without importing them
  (:func:`check_sources`): a verl whose function moved, was renamed or lost a parameter the
  hook passes on fails the cell in one line naming it;
- when the hook installs in verl's actor (:func:`replace`): the live object, its signature
  inspected, so nothing is ever wrapped silently in the wrong place.

The CPU stand-ins of ``backend=verl_cpu`` (:mod:`ablate.backends.verl.cpu`) replace CUDA-only code
and a few of verl's private names, not replay; every verl, mbridge or Megatron-core name they replace
is a row here too (``cpu=True``), checked the same two ways when a cell runs on the CPU.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ablate.backends.verl.config import ENGINES, VERL_VERSION

MEGATRON, VEOMNI, TRAINER = ENGINES["megatron"].name, ENGINES["veomni"].name, "trainer"


@dataclass(frozen=True)
class EntryPoint:
    """One name ablate replaces: ``module.name`` (``name`` may be ``Class.method``).

    ``params`` are the leading parameters ablate's replacement receives and passes on; the
    installed function must start with them. None: the name is no function (a module attribute,
    a registry, a class), and must only be there. ``engine`` is the seam that replaces it
    (``trainer``: for every engine). ``during`` says when it is replaced: for the whole process
    once the hook is installed, or only for the length of one call. ``cpu``: only a CPU run
    (``backend=verl_cpu``) replaces it.
    """

    engine: str
    module: str
    name: str
    params: tuple[str, ...] | None
    ablate: str
    during: str = "process"
    cpu: bool = False

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
_MEGATRON_REPLAY = "verl.utils.megatron.router_replay_patch"
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
)


class EntryPointMissing(RuntimeError):
    """An entry point that is not where the table says, or not with the parameters the hook passes on."""


def entry(module: str, name: str) -> EntryPoint:
    """The table's entry for ``module.name``."""
    for point in ENTRY_POINTS:
        if point.module == module and point.name == name:
            return point
    raise KeyError(f"{module}.{name} is not in ablate's entry-point table")


def of_engine(engine: str, *, cpu: bool = False) -> tuple[EntryPoint, ...]:
    """The entry points a cell on ``engine`` uses: the engine's own and the trainer's (with ``cpu``,
    those of the CPU stand-ins too)."""
    return tuple(point for point in ENTRY_POINTS if point.engine in (engine, TRAINER) and (cpu or not point.cpu))


def _missing(point: EntryPoint, problem: str) -> EntryPointMissing:
    return EntryPointMissing(
        f"{point.where} {problem}: ablate's hook replaces it with {point.ablate} and is written against verl "
        f"{VERL_VERSION} (REQUIRED_VERL.txt; every entry point: ablate/backends/verl/entry_points.py)")


def _check_params(point: EntryPoint, found: list[str] | None) -> None:
    if point.params is None:
        return
    if found is None:
        raise _missing(point, "is not a function")
    if found[:len(point.params)] != list(point.params):
        raise _missing(point, f"takes ({', '.join(found)}), not ({', '.join(point.params)}, ...)")


# ------------------------------------------------------------------ at launch: the sources only
def check_sources(engine: str, *, cpu: bool = False) -> None:
    """Check every entry point of ``engine`` (and the CPU stand-ins', with ``cpu``) in the installed
    sources, importing none of them.

    Raises :class:`EntryPointMissing` naming the first one that moved or changed.
    """
    for point in of_engine(engine, cpu=cpu):
        _check_params(point, _source_params(point))


def _source_file(module: str) -> Path | None:
    """The source file of ``module``, found from its top-level package without importing the module."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        base = Path(root).joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _source_params(point: EntryPoint, module: str | None = None, hops: int = 3) -> list[str] | None:
    """Parameter names of ``point.name`` as defined in ``module``'s source (following ``from x import``);
    None where it is defined as no function (a class, an assignment, an import of a name that is no row's function)."""
    module = module or point.module
    path = _source_file(module)
    if path is None:
        raise _missing(point, f"is not there: module {module} is not installed")
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    *owners, name = point.name.split(".")
    for owner in owners:
        found = next((node for node in scope if isinstance(node, ast.ClassDef) and node.name == owner), None)
        if found is None:
            raise _missing(point, f"is not there: {module} defines no class {owner}")
        scope = found.body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            arguments = node.args
            return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
        if point.params is None and _defines(node, name):
            return None
        if not owners and isinstance(node, ast.ImportFrom) and hops > 0:
            if any((alias.asname or alias.name) == name and alias.name == name for alias in node.names):
                source = _absolute(module, node, path)
                return _source_params(point, source, hops - 1)
    raise _missing(point, f"is not there: {module} defines no {point.name}")


def _defines(node: ast.stmt, name: str) -> bool:
    """``node`` binds ``name`` as something other than a function: a class, an assignment, an import."""
    if isinstance(node, ast.ClassDef):
        return node.name == name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(target, ast.Name) and target.id == name for target in targets)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name).split(".")[0] == name for alias in node.names)
    return False


def _absolute(module: str, node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


# ----------------------------------------------------------------- at install: the live objects
_ORIGINALS: dict[EntryPoint, Any] = {}


def original(point: EntryPoint) -> Any:
    """What ``point`` held before ablate replaced it (what it holds now if not replaced)."""
    return _ORIGINALS[point] if point in _ORIGINALS else _lookup(point)[2]


def _lookup(point: EntryPoint) -> tuple[Any, str, Any]:
    """(the object holding the name, the attribute, its current value), with its signature checked."""
    module = sys.modules.get(point.module) or importlib.import_module(point.module)
    *owners, attribute = point.name.split(".")
    owner: Any = module
    for name in owners:
        owner = getattr(owner, name, None)
        if owner is None:
            raise _missing(point, f"is not there: {point.module} has no {name}")
    current = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    if current is None:
        raise _missing(point, f"is not there: {'.'.join([point.module, *owners])} has no {attribute}")
    if point.params is not None:
        function = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
        target = inspect.unwrap(_ORIGINALS.get(point, function))
        _check_params(point, list(inspect.signature(target).parameters))
    return owner, attribute, current


def cpu_point(module: str, name: str) -> EntryPoint:
    """The CPU stand-ins' row for ``module.name``."""
    for point in ENTRY_POINTS:
        if point.cpu and point.module == module and point.name == name:
            return point
    raise KeyError(f"{module}.{name} is not in ablate's entry-point table of the CPU stand-ins")


def verify(*points: EntryPoint) -> None:
    """Each live object where its row says, with the parameters it says: for names a stand-in wraps in place."""
    for point in points:
        _lookup(point)


def replace(point: EntryPoint, replacement: Any) -> Any:
    """Put ``replacement`` in ``point``'s place (checked first); returns the original it stands in for."""
    owner, attribute, current = _lookup(point)
    previous = _ORIGINALS.setdefault(point, current)
    setattr(owner, attribute, replacement)
    return previous


def restore(point: EntryPoint) -> None:
    """Put the original back, if ``point`` was replaced."""
    if point in _ORIGINALS:
        owner, attribute, _ = _lookup(point)
        setattr(owner, attribute, _ORIGINALS.pop(point))


def replaced(point: EntryPoint) -> bool:
    return point in _ORIGINALS
