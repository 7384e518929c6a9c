"""The seam between ablate's replay hook and a training engine of verl.

The hook (:mod:`ablate.backends.verl.hook`) chooses per-(token, layer) masks and counts routes;
it knows no engine. An engine's seam (:class:`EngineSeam`) gives it what only the engine knows,
and nothing else:

- where a training call starts and ends, and what it holds (:meth:`EngineSeam.call_info`:
  forward-only or update, the step's last update, route layers, top-k, experts, each decoder
  layer's column in the route tensor): :func:`hooked_call` frames every verl call with it;
- each micro-batch's rollout routes, handed to :meth:`ReplayMaskHook.augmented_routes`, whose
  mask the seam sends through the engine's own packing as one extra route column
  (:func:`augment_routes`, :func:`split_augmented`, :func:`split_layers`), so that every router
  receives its layer's mask and row ids aligned with its rows without ablate repeating verl's
  packing;
- each router's native top-k and the mask applied to it (``torch.where(mask, replayed, native)``),
  reported with :meth:`ReplayMaskHook.observe` and, where gradients flow, router-logit
  gradients with :meth:`ReplayMaskHook.add_fisher`;
- the rank layout: which rank counts a micro-batch, and :meth:`EngineSeam.assemble`, the sum
  over the ranks that split one micro-batch's routes (each route counted once).

State that travels between these points lives in the seam object (dicts keyed by the ``id`` of
verl's own objects, holding a reference so the id stays theirs), never as attributes added to
tensors or to verl's objects. Every name a seam replaces is in :mod:`..entry_points`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

#: the column appended to each route: ``4 * (row id + 1) + 2 * replayed + valid`` (0 marks padding).
EXTRA_COLUMNS = 1
#: Outside the schema: R3 micro-batches the hook selected a mask for in the step, reported at
#: every step's last update call once the hook is installed (0 when verl gave it none), so that
#: a replay that silently does nothing is seen (:mod:`ablate.backends.verl.liveness`).
MICRO_BATCHES_KEY = "hook/micro_batches"

_ACTIVE: list[Any] = []


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
    #: each decoder layer's column in the route tensor, None for dense layers.
    layer_columns: tuple[int | None, ...]

    @property
    def moe_columns(self) -> list[int]:
        """Columns of the route tensor that hold MoE routes, in MoE-layer order."""
        return [column for column in self.layer_columns if column is not None]

    def moe_layer(self, column: int) -> int:
        """The MoE-layer index (0-based, the Fisher estimate's row) of a route column."""
        return self.moe_columns.index(column)


def r3_call(data, forward_only: bool, *, num_experts: int, layer_columns) -> CallInfo | None:
    """The R3 call described by verl's batch ``data``, or None when it does not replay routes.

    ``layer_columns`` maps each decoder layer to its route column, given the number of route
    layers (a callable: the seam's own rule).
    """
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
        route_layers=int(layers), topk=int(topk), num_experts=int(num_experts),
        layer_columns=tuple(layer_columns(int(layers))),
    )


class EngineSeam(abc.ABC):
    """What the replay hook needs from one training engine of verl, and nothing else."""

    #: ``backend.engine``'s value for this engine.
    name: ClassVar[str]

    def __init__(self, hook) -> None:
        #: the hook this seam hands micro-batches and routers to (:class:`..hook.ReplayMaskHook`).
        self.hook = hook

    @abc.abstractmethod
    def call_info(self, engine, data, forward_only: bool) -> CallInfo | None:
        """The R3 call ``engine.forward_backward_batch(data, ...)`` is about to run, or None."""

    @abc.abstractmethod
    def assemble(self, parts: Tensor) -> Tensor:
        """Sum over the ranks that split one micro-batch's routes, each entry written by one of them."""

    @abc.abstractmethod
    def install(self) -> None:
        """Replace the engine's entry points (:mod:`..entry_points`) so that they reach the hook."""

    @abc.abstractmethod
    def uninstall(self) -> None:
        """Put back every name :meth:`install` replaced."""

    def end_pass(self) -> None:
        """Forget what one run of ``forward_backward_batch`` left in the seam."""


# --------------------------------------------------------------------- the active hook
def active_hook():
    return _ACTIVE[0] if _ACTIVE else None


def install(hook):
    """Route verl's R3 through ``hook`` in its engine (``hook.seam``). :func:`uninstall` restores verl."""
    uninstall()
    hook.seam.install()
    _ACTIVE.append(hook)
    return hook


def uninstall() -> None:
    """Restore every name the active hook's seam replaced."""
    while _ACTIVE:
        _ACTIVE.pop().seam.uninstall()


def arm(init_point, is_r3_actor: Callable[[Any], bool], make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` once this process builds an engine ``is_r3_actor`` accepts.

    ``init_point`` is the engine's ``__init__`` (:mod:`..entry_points`), wrapped when verl imports
    the engine's module, not before: a process that never builds that engine (the vLLM/SGLang
    servers, the agent-loop workers) never imports Megatron or VeOmni because of ablate.
    """
    from ablate.backends.verl import entry_points as ep
    from ablate.backends.verl.import_hooks import when_imported

    def wrap(module) -> None:
        engine_init = ep.original(init_point)

        def __init__(self, *args, **kwargs):
            engine_init(self, *args, **kwargs)
            if active_hook() is None and is_r3_actor(self):
                install(make_hook())

        ep.replace(init_point, __init__)

    when_imported(init_point.module, wrap)


# -------------------------------------------------------------------- routes with the mask
def augment_routes(rollout: Tensor, mask: Tensor, valid: Tensor, first_row: int) -> Tensor:
    """``[rows, layers, topk + 1]`` int32: routes, then one column packing the replay mask, the valid
    flag and the row id: ``4 * (row id + 1) + 2 * mask + valid``.

    Row ids count from ``first_row``, the micro-batch's first row in the call's token order.
    An engine pads and splits this tensor exactly as it does the routes, so every router gets
    its own rows' mask, validity and ids; padding the engine adds is zeros (row id -1). One
    column, not three: the engine packs and copies the routes once per router, and so the column.
    """
    rows, layers, topk = rollout.shape
    row_ids = torch.arange(4 * (first_row + 1), 4 * (first_row + rows + 1), 4, dtype=torch.int32, device=rollout.device)
    augmented = torch.empty(rows, layers, topk + 1, dtype=torch.int32, device=rollout.device)
    augmented[..., :topk] = rollout  # converted while copied: no int32 copy of the routes in between
    torch.add((row_ids + valid.to(torch.int32))[:, None], mask, alpha=2, out=augmented[..., topk])
    return augmented


class LayerTargets:
    """One router's share of augmented routes, split apart again: what it replays and for which rows.

    The mask, validity and row ids are decoded from the packed column when first read (a router's
    forward reads the mask and row ids, its backward the validity), or given already decoded.
    """

    def __init__(self, routes: Tensor, packed: Tensor, *, mask: Tensor | None = None, valid: Tensor | None = None,
                 rows: Tensor | slice | None = None) -> None:
        self.routes, self._packed = routes, packed
        self._mask, self._valid, self._rows = mask, valid, rows

    @property
    def mask(self) -> Tensor:
        """``[rows]`` True where ablate replays the rollout's route."""
        if self._mask is None:
            self._mask = (self._packed & 2) != 0
        return self._mask

    @property
    def valid(self) -> Tensor:
        """``[rows]`` True on the valid tokens (their router-logit gradients feed the Fisher estimate)."""
        if self._valid is None:
            self._valid = (self._packed & 1) != 0
        return self._valid

    @property
    def rows(self) -> Tensor | slice:
        """``[rows]`` row id in the call's token order, -1 on padding the engine added; or, when they
        are consecutive, the one slice of rows they are (:func:`row_block`)."""
        if self._rows is None:
            ids = (self._packed >> 2) - 1
            self._rows = row_block(ids) or ids
        return self._rows


def split_augmented(targets: Tensor, topk: int) -> LayerTargets:
    """A router's ``[rows, topk + 1]`` augmented targets as :class:`LayerTargets`."""
    _check_columns(targets, topk)
    return LayerTargets(targets[:, :topk].contiguous(), targets[:, topk])


def split_layers(targets: list[Tensor], topk: int) -> list[LayerTargets]:
    """Every router's ``[rows, topk + 1]`` augmented targets of one micro-batch.

    For an engine that hands all layers' targets at once (VeOmni): the routes stay views of the
    engine's own tensor, and the layers share their rows, whose ids are decoded and checked for
    one block once. Each layer's mask and validity are decoded from its own packed column only
    if read: the VeOmni seam takes them from the hook's selection when the rows are one block
    (:meth:`..hook.ReplayMaskHook.replay_bits`), so the packed columns, a cache line per row in
    verl's per-layer views, are read only for rows the engine padded.
    """
    for target in targets[:1]:
        _check_columns(target, topk)
    rows = None
    if targets:
        ids = (targets[0][:, topk] >> 2) - 1
        rows = row_block(ids) or ids
    return [LayerTargets(target[:, :topk], target[:, topk], rows=rows) for target in targets]


def _check_columns(targets: Tensor, topk: int) -> None:
    if targets.shape[-1] != topk + EXTRA_COLUMNS:
        raise RuntimeError(
            f"router replay targets have {targets.shape[-1]} columns: expected topk + {EXTRA_COLUMNS} = "
            f"{topk + EXTRA_COLUMNS} from ablate's augmented routes"
        )


def row_block(rows: Tensor) -> slice | None:
    """``rows`` as one slice when they are consecutive row ids (no padding): a router's usual share."""
    count = rows.shape[0]
    first = int(rows[0]) if count else -1
    if first < 0 or not torch.equal(rows, torch.arange(first, first + count, dtype=rows.dtype, device=rows.device)):
        return None
    return slice(first, first + count)


# -------------------------------------------------------------------------- one verl call
def hooked_call(hook, forward_backward_batch, engine, data, loss_function, forward_only: bool):
    """An engine's ``forward_backward_batch`` as one hook call, the step's keys in its output.

    For ``mismatch``, the step's old-log-prob call runs verl's forward twice: first a native pass
    that replays nothing and records the native routes ``mismatch`` selects on (its output is
    dropped), then the pass whose output verl gets, which replays the mask like every update pass,
    so the PPO ratio starts at 1 as for every other policy. Running ``forward_backward_batch``
    twice is safe in verl 0.9.1's Megatron and VeOmni engines: each only adds idempotent keys to
    ``data``, builds its micro-batches anew in each call, and clears verl's router-replay state at
    the end of each. Every rank runs both passes (:meth:`needs_native_pass` agrees on all), so
    their collectives match.

    On a probed step's old-log-prob call, after the pass verl gets, one more forward-only pass
    runs per probe with the probe's mask (:meth:`probe_runs`, the same on every rank). Each is
    scored against the rollout's log-probs in ``data`` (:func:`..probes.probe_mismatch`) and
    dropped; forward-only, it computes no gradient and feeds no Fisher sum, and verl clears the
    router-replay state after it as after every call.

    The keys go into the output's ``metrics`` as one value each: verl gathers them over data-
    parallel ranks (equal values) and averages each key over the values it received, so the
    trainer logs them unchanged. Only ranks with outputs return metrics; the others only take
    part in the hook's collectives.
    """
    from ablate.backends.verl.probe_passes import probe_mismatch

    info = hook.seam.call_info(engine, data, forward_only)
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
    """One run of the engine's ``forward_backward_batch`` between the hook's begin and end of a call."""
    hook.begin_call(info, native_pass=native_pass, probe=probe)
    try:
        output = forward_backward_batch(engine, data, loss_function, forward_only=info.forward_only)
    except BaseException:
        hook.abort_call()
        raise
    finally:
        hook.seam.end_pass()
    return output, hook.end_call()
