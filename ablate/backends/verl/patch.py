"""Where the hook enters verl 0.9.1 and Megatron, without editing either.

verl replays rollout routes in ``MegatronEngine.forward_step``: it builds a per-token R3 mask
and hands routes and mask to ``set_router_replay_data``, which packs them (THD, context-parallel
zigzag, sequence-parallel scatter) and maps each router to its layer's column by global layer
number. The routers apply ``torch.where(mask, replayed, native)`` in
``RouterReplay.get_replay_topk``. Four names are wrapped:

- ``set_router_replay_data``, in ``transformer_impl``'s namespace only: the hook selects a
  ``[tokens, layers]`` mask and appends three columns to the routes (mask, valid token, row id
  + 1). verl packs that augmented tensor exactly like the routes, so every router receives its
  own layer's mask and row ids already aligned with its rows; ``set_target_indices``, patched
  for the length of that call, splits the columns back off. No packing logic is duplicated.
- ``RouterReplay.get_replay_topk``: hands the native top-k verl computes anyway for a masked
  replay to the hook.
- ``TopKRouter.routing``: registers a gradient hook on the router logits, whose per-token
  squares feed the Fisher estimate.
- ``MegatronEngine.forward_backward_batch``: one hook call per verl call (for ``mismatch``, the
  old-log-prob call first runs one more forward that records native routes; on a probed step it
  then runs one forward per probe, :mod:`.probes`), and the step's metrics added to the last
  update call's output.

verl imports ``actor_rollout_ref.model.external_lib`` in every process that builds its model
config: the trainer, the agent-loop workers and the rollout servers too. The hook is installed
only when a Megatron actor engine with R3 is built, and nothing here imports verl's Megatron
engine before verl itself does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ablate.backends.verl.import_hooks import when_imported
from ablate.backends.verl.probes import probe_mismatch

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
#: extra columns appended to each route: replay mask, valid token, row id + 1 (0 marks padding).
EXTRA_COLUMNS = 3
#: Outside the schema: R3 micro-batches the hook selected a mask for in the step, reported at
#: every step's last update call once the hook is installed (0 when verl gave it none), so that
#: a replay that silently does nothing is seen (:mod:`ablate.backends.verl.liveness`).
MICRO_BATCHES_KEY = "hook/micro_batches"

_ACTIVE: Any = None
_ORIGINALS: dict[str, Any] = {}


@dataclass(frozen=True)
class CallInfo:
    """What the hook needs to know about one ``forward_backward_batch`` call with R3.

    Every rank of the call knows all of it, including ranks whose model chunks hold no MoE
    layer: they take part in the hook's collectives too.
    """

    forward_only: bool
    #: the last update call of the training step (verl's ``update_lr_scheduler`` flag).
    last_update: bool
    num_tokens: int
    route_layers: int
    topk: int
    num_experts: int
    #: each transformer layer's column in the route tensor, None for dense layers
    #: (:func:`.selection.layer_columns`).
    layer_columns: tuple[int | None, ...]

    @property
    def moe_columns(self) -> list[int]:
        """Columns of the route tensor that hold MoE routes, in MoE-layer order."""
        return [column for column in self.layer_columns if column is not None]

    @property
    def first_moe_layer(self) -> int:
        """Global layer number (1-based, as Megatron's) of the first MoE layer: its chunk counts."""
        return next(layer for layer, column in enumerate(self.layer_columns, 1) if column is not None)


def call_info(tf_config, data, forward_only: bool) -> CallInfo | None:
    """The R3 call described by verl's batch ``data``, or None when it does not replay routes."""
    from ablate.backends.verl.selection import layer_columns
    from verl.utils import tensordict_utils as tu

    routes = data.get("routed_experts", None)
    if not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False) or routes is None:
        return None
    last = tu.get_non_tensor_data(data, key="update_lr_scheduler", default=None)
    if not forward_only and last is None:
        raise RuntimeError(
            "an R3 update call without verl's update_lr_scheduler flag: ablate's hook needs it to find the last "
            "update of a training step (set by verl 0.9.1's TrainingWorker.train_mini_batch)"
        )
    layers, topk = routes.values().shape[-2:] if routes.is_nested else routes.shape[-2:]
    return CallInfo(
        forward_only=forward_only, last_update=bool(last), num_tokens=int(data["input_ids"].offsets()[-1]),
        route_layers=int(layers), topk=int(topk), num_experts=int(tf_config.num_moe_experts),
        layer_columns=layer_columns(tf_config, int(layers)),
    )


def augment_routes(rollout: Tensor, mask: Tensor, valid: Tensor, first_row: int) -> Tensor:
    """``[rows, layers, topk + 3]`` int32: routes, then replay mask, valid flag and row id + 1.

    Row ids count from ``first_row``, the micro-batch's first row in the call's token order.
    """
    rows, layers, _ = rollout.shape
    row_ids = torch.arange(first_row + 1, first_row + rows + 1, dtype=torch.int32, device=rollout.device)
    extra = torch.stack(
        [mask.to(torch.int32), valid.to(torch.int32)[:, None].expand(rows, layers), row_ids[:, None].expand(rows, layers)],
        dim=-1,
    )
    return torch.cat([rollout.to(torch.int32), extra], dim=-1)


@contextlib.contextmanager
def split_augmented_targets(topk: int):
    """While verl distributes augmented routes, split each router's columns back apart."""
    from verl.utils.megatron.router_replay_patch import RouterReplay

    original = RouterReplay.set_target_indices

    def set_target_indices(self, topk_indices: Tensor, replay_mask: Tensor | None = None):
        if topk_indices.shape[-1] != topk + EXTRA_COLUMNS:
            raise RuntimeError(
                f"router replay targets have {topk_indices.shape[-1]} columns: expected topk + {EXTRA_COLUMNS} = "
                f"{topk + EXTRA_COLUMNS} from ablate's augmented routes"
            )
        layer_mask = topk_indices[:, topk].bool()
        layer_mask._ablate = (topk_indices[:, topk + 1].bool(), topk_indices[:, topk + 2].long() - 1)
        original(self, topk_indices[:, :topk].contiguous(), replay_mask=layer_mask)

    RouterReplay.set_target_indices = set_target_indices
    try:
        yield
    finally:
        RouterReplay.set_target_indices = original


def active_hook():
    return _ACTIVE


def install(hook):
    """Route verl's R3 through ``hook``: its routers and its Megatron engine. :func:`uninstall` restores verl."""
    from verl.utils.megatron import router_replay_utils
    from verl.workers.engine.megatron import transformer_impl

    wrap_routers(hook)
    _ORIGINALS.update(
        set_router_replay_data=transformer_impl.set_router_replay_data,
        forward_backward_batch=transformer_impl.MegatronEngine.forward_backward_batch,
    )
    original_set = router_replay_utils.set_router_replay_data
    original_fbb = transformer_impl.MegatronEngine.forward_backward_batch

    def set_router_replay_data(*args, **kwargs):
        return hook.set_router_replay_data(original_set, *args, **kwargs)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        return hooked_call(hook, original_fbb, self, data, loss_function, forward_only)

    transformer_impl.set_router_replay_data = set_router_replay_data
    transformer_impl.MegatronEngine.forward_backward_batch = forward_backward_batch
    return hook


def wrap_routers(hook):
    """The router half of :func:`install`: native routes and Fisher gradients reach ``hook``.

    It imports only verl's router-replay patch and Megatron's router, not verl's engine, so a
    benchmark can drive the hook where verl's trainer dependencies are not installed.
    """
    global _ACTIVE
    from megatron.core.transformer.moe.router import TopKRouter

    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction, apply_router_replay_patch

    uninstall()
    # verl applies its patch when an R3 engine is built; applying it first lets us wrap the
    # patched routing. verl's later call returns early for an already patched TopKRouter. The
    # check keeps the router registry intact when the model already exists.
    if not getattr(TopKRouter, "_router_replay_patched", False):
        apply_router_replay_patch()
    _ORIGINALS.update(get_replay_topk=RouterReplay.get_replay_topk, routing=TopKRouter.routing)
    original_topk = RouterReplay.get_replay_topk
    original_routing = TopKRouter.routing

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or not hasattr(self.target_replay_mask, "_ablate"):
            return original_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
        captured = []

        def compute_native(s, k, num_groups=None, group_topk=None):
            probs, indices = default_compute_topk(s, k, num_groups=num_groups, group_topk=group_topk)
            captured.append((s, indices))
            return probs, indices

        out = original_topk(self, scores, topk, num_groups, group_topk, compute_native)
        if captured:
            with torch.no_grad():
                hook.observe(self, captured[0][1], captured[0][0])
        return out

    def routing(self, logits, *args, **kwargs):
        replay = getattr(self, "router_replay", None)
        if replay is not None and torch.is_grad_enabled() and logits.requires_grad:
            pending = _pending_mask(replay, RouterReplayAction)
            extra = getattr(pending, "_ablate", None)
            layer = getattr(replay, "_ablate_moe_layer", None)
            if extra is not None and layer is not None:
                valid = extra[0]
                logits.register_hook(lambda grad: hook.add_fisher(layer, grad, valid))
        return original_routing(self, logits, *args, **kwargs)

    RouterReplay.get_replay_topk = get_replay_topk
    TopKRouter.routing = routing
    _ACTIVE = hook
    return hook


def hooked_call(hook, forward_backward_batch, engine, data, loss_function, forward_only: bool):
    """``MegatronEngine.forward_backward_batch`` as one hook call, the step's keys in its output.

    For ``mismatch``, the step's old-log-prob call runs verl's forward twice: first a native pass
    that replays nothing and records the native routes ``mismatch`` selects on (its output is
    dropped), then the pass whose output verl gets, which replays the mask like every update pass,
    so the PPO ratio starts at 1 as for every other policy. Running ``forward_backward_batch``
    twice is safe in verl 0.9.1: it only adds idempotent keys to ``data``, builds its micro-
    batches, iterators and pipeline schedule anew in each call, and clears verl's router-replay
    state at the end of each. Every rank runs both passes (:meth:`needs_native_pass` agrees on
    all), so their collectives match.

    On a probed step's old-log-prob call, after the pass verl gets, one more forward-only pass
    runs per probe with the probe's mask (:meth:`probe_runs`, the same on every rank). Each is
    scored against the rollout's log-probs in ``data`` (:func:`.probes.probe_mismatch`) and
    dropped; forward-only, it computes no gradient and feeds no Fisher sum, and verl clears the
    router-replay state after it as after every call.

    The keys go into the output's ``metrics`` as one value each: verl gathers them over data-
    parallel ranks (equal values) and averages each key over the values it received, so the
    trainer logs them unchanged. Only the last pipeline stage returns metrics; the others only
    take part in the hook's collectives.
    """
    info = call_info(engine.tf_config, data, forward_only)
    if info is None:
        output = forward_backward_batch(engine, data, loss_function, forward_only=forward_only)
        if not forward_only and _is_last_update(data):  # installed, but the step gave the hook nothing to replay
            _add_metrics(output, {MICRO_BATCHES_KEY: 0.0})
        return output
    if hook.needs_native_pass(info):
        _framed(hook, info, forward_backward_batch, engine, data, loss_function, native_pass=True)
    output, metrics = _framed(hook, info, forward_backward_batch, engine, data, loss_function, native_pass=False)
    for run in hook.probe_runs(info):
        probed, counts = _framed(hook, info, forward_backward_batch, engine, data, loss_function, probe=run)
        hook.add_probe(run, counts, probe_mismatch(probed, data, engine.is_mp_src_rank_with_outputs()))
    if metrics:
        _add_metrics(output, metrics)
    return output


def _add_metrics(output, metrics: dict[str, float]) -> None:
    if isinstance(output, dict) and "metrics" in output:
        output["metrics"].update({key: [value] for key, value in metrics.items()})


def _is_last_update(data) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data, key="update_lr_scheduler", default=False))


def _framed(hook, info: CallInfo, forward_backward_batch, engine, data, loss_function, *, native_pass: bool = False,
            probe=None):
    """One run of verl's ``forward_backward_batch`` between the hook's begin and end of a call."""
    hook.begin_call(info, native_pass=native_pass, probe=probe)
    try:
        output = forward_backward_batch(engine, data, loss_function, forward_only=info.forward_only)
    except BaseException:
        hook.abort_call()
        raise
    return output, hook.end_call()


def uninstall() -> None:
    """Restore every name :func:`install` or :func:`wrap_routers` replaced."""
    global _ACTIVE
    if not _ORIGINALS:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    from verl.utils.megatron.router_replay_patch import RouterReplay

    RouterReplay.get_replay_topk = _ORIGINALS.pop("get_replay_topk")
    TopKRouter.routing = _ORIGINALS.pop("routing")
    if _ORIGINALS:
        from verl.workers.engine.megatron import transformer_impl

        transformer_impl.set_router_replay_data = _ORIGINALS.pop("set_router_replay_data")
        transformer_impl.MegatronEngine.forward_backward_batch = _ORIGINALS.pop("forward_backward_batch")
    _ACTIVE = None


def _pending_mask(replay, actions) -> Tensor | None:
    """The mask the router is about to use: current target, or the next backward-recompute one."""
    if replay.router_replay_action == actions.REPLAY_FORWARD:
        return replay.target_replay_mask
    if replay.router_replay_action == actions.REPLAY_BACKWARD and replay.replay_backward_mask_list:
        return replay.replay_backward_mask_list[0]
    return None


# --------------------------------------------------------------------- install in the actor only
def is_r3_actor(engine) -> bool:
    """A Megatron engine that trains a policy with R3: not a critic, not a forward-only reference."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    config = engine.engine_config
    policy = isinstance(engine, MegatronEngineWithLMHead) and not isinstance(engine, MegatronEngineWithValueHead)
    return policy and config.router_replay.mode == "R3" and not config.forward_only


def install_in_actor(make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` when this process builds an R3 Megatron actor engine.

    verl's Megatron engine module is wrapped when verl imports it, not before: a process that
    never builds a Megatron engine (the vLLM/SGLang servers, the agent-loop workers) never
    imports Megatron because of ablate.
    """

    def wrap(module) -> None:
        engine_init = module.MegatronEngine.__init__

        def __init__(self, *args, **kwargs):
            engine_init(self, *args, **kwargs)
            if _ACTIVE is None and is_r3_actor(self):
                install(make_hook())

        module.MegatronEngine.__init__ = __init__

    when_imported(ENGINE_MODULE, wrap)
