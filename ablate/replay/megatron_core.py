"""Partial replay inside any Megatron-core training loop: :func:`partial_replay`.

NeMo RL, SkyRL and AReaL replay rollout routes through Megatron-core's own ``RouterReplay``
(``megatron.core.transformer.moe.router_replay``, one per ``TopKRouter`` of a model built with
``TransformerConfig.moe_enable_routing_replay=True``): the loop hands the routes to the routers,
``RouterReplay.set_replay_data(per_layer)`` for every layer at once or ``set_target_indices(topk)``
router by router, switches them to ``REPLAY_FORWARD`` (``REPLAY_BACKWARD`` for a recompute) and
runs the model. Inside ``with partial_replay(policy, budget, seed) as replay:`` the same loop
replays only ablate's budget of those routes:

- where routes arrive, the cell's :class:`~ablate.replay.ReplaySession` chooses the mask: the
  budget is matched exactly over the valid routes handed over together (every layer through
  ``set_replay_data``, one layer through ``set_target_indices``), per sequence where the loop
  gave boundaries (:meth:`PartialReplay.sequences`), else over the batch as one sequence;
- at each router, :func:`ablate.replay.megatron_routers.replay_topk`: the rollout's route where
  the mask says, the router's own top-k elsewhere, with the forward's mask again in a recompute;
- :meth:`PartialReplay.metrics` closes a step: the schema's ``replay/`` and ``routing/`` keys
  (``mismatch/`` too, given log-probs), and one step of the Fisher estimate from the router-logit
  gradients of the step's backward passes;
- on leaving, every replaced name is put back as it was; a context in which routers ran and
  none was given ablate's targets raises :class:`NothingReplayed`.

``RECORD`` passes, routers without targets handed inside the context, and every router call
outside it are Megatron's own. ``mismatch`` selects on native routes: one forward of the replay
data inside :meth:`PartialReplay.native_pass` routes natively and records them.

Ranks: a loop hands each rank the routes of the tokens its routers see. With tensor parallelism
and sequence parallelism each tensor-parallel rank holds a slice of the micro-batch: its slices
are gathered so that the mask is chosen over the whole micro-batch, as on one rank, and each
rank replays its own rows. Without sequence parallelism the tensor-parallel ranks hold the same
rows and choose the same mask. Routes are counted on tensor-parallel rank 0 and summed over
the world, so every route counts once; expert parallelism dispatches tokens after routing, so
its ranks route (and count) their own. Pipeline parallelism is refused.

Megatron-core's ``RouterReplay`` keeps no reference to its router, and a loop hands ablate no
model: the routers (their layer, expert count and tensor-parallel group) are found among the
live objects when their first replay data arrive.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ablate.replay import entry_points as ep
from ablate.replay import megatron_routers as mr
from ablate.replay import ranks
from ablate.replay.batch import MicroBatchPlan, MicroBatchSelection, counted_routes, plan_micro_batch, select_micro_batch
from ablate.replay.seams import active_hook
from ablate.replay.session import ReplaySession
from ablate.replay.spec import ReplaySpec
from ablate.routes import native_margin


class NothingReplayed(RuntimeError):
    """A :func:`partial_replay` context whose routers ran and were never given ablate's targets."""


class NativeRoutesMissing(RuntimeError):
    """A replaying forward of a policy that selects on native routes, before a native pass of its routes."""


class ReplayDataError(ValueError):
    """Replay data or a setting :func:`partial_replay` cannot replay, named with what was expected."""


@contextlib.contextmanager
def partial_replay(policy: str, budget: float | None = None, seed: int = 0, **policy_settings: Any
                   ) -> Iterator[PartialReplay]:
    """Replay ablate's budget of the rollout's routes through Megatron-core's own ``RouterReplay``.

    ``policy`` is any built-in or plugin policy, ``budget`` the fraction of valid routes replayed
    (none for ``none`` and ``full``), ``seed`` the seed of every draw; ``policy_settings`` go to the
    policy (``tau=1.0``, ``per_layer=True``; ``plugins=("my_policies",)`` imports a module first).
    A bad value raises before anything is replaced. The context spans the steps of a run, so the
    Fisher estimate carries from one step to the next: close each step with
    :meth:`PartialReplay.metrics`.
    """
    plugins = tuple(policy_settings.pop("plugins", ()))
    replay = PartialReplay(ReplaySpec.of(policy, budget, seed, plugins=plugins, **policy_settings))
    replay.install()
    try:
        yield replay
    finally:
        replay.uninstall()
    replay.check_replayed()


@dataclass(frozen=True)
class _Layout:
    """How this rank's routers split a micro-batch: what the mask is chosen over, who counts, who adds Fisher."""

    tp_group: Any
    tp_size: int
    tp_rank: int
    #: tensor-parallel ranks hold slices of the micro-batch (sequence parallelism).
    sliced: bool

    @property
    def counts(self) -> bool:
        """This rank counts the micro-batches of its tensor-parallel group."""
        return self.tp_rank == 0

    @property
    def adds_fisher(self) -> bool:
        """This rank's router-logit gradients are its own tokens' (not a copy of rank 0's)."""
        return self.sliced or self.counts


@dataclass
class _Batch:
    """Replay data handed to this rank's routers together, with ablate's choice of routes.

    The routes, the selection and the native routes cover the whole micro-batch (every
    tensor-parallel slice of it under sequence parallelism); ``rows`` are this rank's.
    """

    #: the session's MoE layer of each column.
    layers: tuple[int, ...]
    #: ``[tokens, columns, topk]`` rollout routes.
    routes: Tensor
    #: its sequences, valid routes and content keys, read once (:func:`plan_micro_batch`).
    plan: MicroBatchPlan
    rows: slice
    #: ``[tokens, columns, topk]`` native expert id + 1 the routers computed (0: none yet).
    native: Tensor
    #: ``[tokens, columns]`` native margins, written by a native pass.
    margin: Tensor
    selection: MicroBatchSelection | None = None
    #: a native pass routed this batch: its native routes are there to select on.
    natives_seen: bool = False
    local_mask: Tensor = field(init=False)
    local_valid: Tensor = field(init=False)

    def chosen(self, selection: MicroBatchSelection) -> None:
        self.selection = selection
        self.local_mask = selection.mask[self.rows]
        self.local_valid = selection.valid[self.rows]

    def observe(self, column: int, native: Tensor, scores: Tensor | None = None) -> None:
        """A router's native top-k of this rank's rows (and, in a native pass, its margins). No host sync."""
        self.native[self.rows, column].copy_(native).add_(1)
        if scores is not None:
            self.margin[self.rows, column] = native_margin(scores.detach().float(), native).to(self.margin.dtype)


class PartialReplay:
    """One :func:`partial_replay` context: the cell's session, and what Megatron-core's routers were handed."""

    def __init__(self, spec: ReplaySpec) -> None:
        self.spec = spec
        #: built when the first replay data arrive, once the routers' layers and experts are known.
        self.session: ReplaySession | None = None
        self._layout: _Layout | None = None
        self._layers: list[int] = []
        self._num_experts = 0
        self._routers: dict[int, Any] = {}
        self._offsets: Tensor | None = None
        self._targets = mr.TargetTable()
        self._batches: dict[tuple, _Batch] = {}
        self._native = False
        self._router_calls = 0
        self._replaying_calls = 0

    # ----------------------------------------------------------------------------- the loop's API
    @property
    def step(self) -> int:
        """Steps closed by :meth:`metrics` so far."""
        return 0 if self.session is None else self.session.step

    @property
    def needs_native_pass(self) -> bool:
        """The policy selects on native routes (``mismatch``): run each replay data's forward in
        :meth:`native_pass` once before the forwards that replay it."""
        return self.spec.policy_class.needs_native_routes

    def sequences(self, offsets: Tensor | list[int] | None) -> None:
        """Sequence boundaries of the replay data handed from now on: ``[sequences + 1]`` row offsets
        (in the routers' row order, over the whole micro-batch), or None: the batch is one sequence.

        With boundaries every sequence gets its exact share of the budget and its own random
        stream, keyed by its routes, so it replays the same routes in any micro-batch (as on verl).
        """
        if offsets is None:
            self._offsets = None
            return
        values = torch.as_tensor(offsets)
        if values.dim() != 1 or values.numel() < 2 or values.is_floating_point() or int(values[0]) != 0 or bool(
                (values.diff() < 0).any()):
            raise ReplayDataError(f"replay.sequences({values.tolist()}): expected non-decreasing integer row offsets "
                                  "[0, ..., rows], one more than the sequences")
        self._offsets = values.to(torch.int64)

    @contextlib.contextmanager
    def native_pass(self) -> Iterator[None]:
        """Forwards in which the routers route natively and record their native routes.

        A policy that selects on native routes (``mismatch``) chooses its mask from them when the
        pass ends; its loop runs one forward of the replay data here, under ``REPLAY_FORWARD``,
        before the forwards that replay it. Routes of a native pass are not counted.
        """
        self._native = True
        try:
            yield
        finally:
            self._native = False
        for batch in self._batches.values():
            if batch.selection is None and batch.natives_seen:
                self._select_on_native(batch)

    def metrics(self, *, log_probs: Tensor | None = None, rollout_log_probs: Tensor | None = None,
                mask: Tensor | None = None) -> dict[str, float]:
        """Close the step: its ``replay/`` and ``routing/`` keys, summed over every rank.

        With the training forward's ``log_probs`` of the sampled tokens and the rollout's, also the
        ``mismatch/`` keys over the tokens ``mask`` marks (all by default), pooled over ranks. A
        collective: every rank calls it, each with its log-probs or none.
        """
        if self.session is None:
            raise ReplayDataError("replay.metrics(): no replay data reached a router in the context yet: expected "
                                  "RouterReplay.set_replay_data or set_target_indices before the step's forwards")
        for batch in self._batches.values():
            self._count(batch)
        keys = self.session.close_step(reduce=ranks.sum_over_world)
        if log_probs is not None:
            keys.update(_pooled_mismatch(log_probs, rollout_log_probs, mask))
        self._batches = {}
        self._targets.retain(_held_targets())
        return keys

    # ------------------------------------------------------------------------- install, restore
    def install(self) -> None:
        if active_hook() is not None or any(ep.replaced(point) for point in mr.MEGATRON_CORE_POINTS):
            raise ReplayDataError("partial_replay: another replay is active in this process (a partial_replay "
                                  "context or ablate's verl hook): expected one at a time")
        set_data, set_targets = ep.original(mr.SET_REPLAY_DATA), ep.original(mr.SET_TARGETS)

        def set_replay_data(all_layers_topk_indices):
            self.set_replay_data(set_data, all_layers_topk_indices)

        def set_target_indices(replay, topk_indices):
            self.set_target_indices(set_targets, replay, topk_indices)

        ep.replace(mr.SET_REPLAY_DATA, staticmethod(set_replay_data))
        ep.replace(mr.SET_TARGETS, set_target_indices)
        mr.replace_router_calls(mr.REPLAY_TOPK, mr.ROUTING, self.get_replay_topk, self.watch)

    def uninstall(self) -> None:
        for point in mr.MEGATRON_CORE_POINTS:
            ep.restore(point)
        self._targets.clear()

    def check_replayed(self) -> None:
        """Raise :class:`NothingReplayed` where routers ran, the policy replays, and none got ablate's targets."""
        if self._router_calls and not self._replaying_calls and self.spec.budget > 0:
            raise NothingReplayed(
                f"partial_replay(policy={self.spec.policy.name}, budget={self.spec.budget:g}) replayed no route: "
                f"{self._router_calls} router calls in the context and none was given ablate's targets (expected "
                "RouterReplay.set_replay_data or set_target_indices inside the context, then "
                "RouterReplayAction.REPLAY_FORWARD, in a model built with moe_enable_routing_replay=True)")

    # ---------------------------------------------------------------- Megatron-core-facing methods
    def set_replay_data(self, original, all_layers_topk_indices) -> None:
        """Every layer's routes at once: one mask over all of them, then Megatron-core hands them out."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances
        if isinstance(all_layers_topk_indices, (list, tuple)) and len(all_layers_topk_indices) == len(instances):
            handed = [(replay, targets) for replay, targets in zip(instances, all_layers_topk_indices)
                      if self._router_of(replay) is not None]
            if handed:
                self._add_batch(handed)
        original(all_layers_topk_indices)

    def set_target_indices(self, original, replay, topk_indices) -> None:
        """One router's routes: a mask over its layer alone (unless they came through :meth:`set_replay_data`)."""
        if self._targets.get(topk_indices) is None and self._router_of(replay) is not None:
            self._add_batch([(replay, topk_indices)])
        original(replay, topk_indices)

    def get_replay_topk(self, original, replay, scores, topk, num_groups, group_topk, default_compute_topk):
        entry = self._targets.pending(replay)
        if entry is None:
            return original(replay, scores, topk, num_groups, group_topk, default_compute_topk)
        batch, column = entry
        if self._native:
            nothing = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
            probs, indices, native = mr.replay_topk(original, replay, scores, topk, num_groups, group_topk,
                                                    default_compute_topk, nothing)
            batch.observe(column, native, scores)
            batch.natives_seen = True
            return probs, indices
        if batch.selection is None:
            raise NativeRoutesMissing(
                f"partial_replay(policy={self.spec.policy.name}) selects on native routes, and a forward replayed "
                "routes no native pass has routed: expected one forward of the same replay data, under "
                "REPLAY_FORWARD, inside replay.native_pass() first")
        self._replaying_calls += 1
        probs, indices, native = mr.replay_topk(original, replay, scores, topk, num_groups, group_topk,
                                                default_compute_topk, batch.local_mask[:, column])
        if mr.action(replay) == mr.REPLAY_FORWARD:
            batch.observe(column, native)
        return probs, indices

    def watch(self, router, logits: Tensor) -> None:
        """A router's call: counted for :meth:`check_replayed`; its logit gradients to the Fisher estimate."""
        if self._native:
            return
        replay = getattr(router, "router_replay", None)
        if replay is None or mr.action(replay) != mr.RECORD:
            self._router_calls += 1
        entry = self._targets.pending(replay) if replay is not None else None
        if entry is None or entry[0].selection is None or not self._layout.adds_fisher:
            return
        batch, column = entry
        session, layer, valid = self.session, batch.layers[column], batch.local_valid
        mr.watch_logit_gradients(logits, lambda grad: session.add_fisher(layer, grad, valid))

    # -------------------------------------------------------------------------------- internals
    def _router_of(self, replay):
        """The live ``TopKRouter`` of a ``RouterReplay`` (None: it belongs to no router, e.g. a discarded model's)."""
        if id(replay) not in self._routers:
            self._routers = _live_routers()
        router = self._routers.get(id(replay))
        return router if router is not None and router.router_replay is replay else None

    def _start(self, router, topk: int) -> None:
        """The session and the rank layout, from the routers, at the first replay data."""
        config = router.config
        if config.pipeline_model_parallel_size > 1:
            raise ReplayDataError(f"partial_replay: pipeline_model_parallel_size={config.pipeline_model_parallel_size}"
                                  ": expected 1 (pipeline parallelism is not supported)")
        numbers = sorted({found.layer_number for found in self._routers.values()})
        if None in numbers:
            raise ReplayDataError("partial_replay: a TopKRouter without a layer number: expected routers of a built "
                                  "model (MoELayer sets it; a bare router needs set_layer_number)")
        group = router.tp_group
        size = group.size() if ranks.distributed() else 1
        self._layout = _Layout(group, size, group.rank() if size > 1 else 0, bool(config.sequence_parallel) and size > 1)
        self._layers, self._num_experts = numbers, config.num_moe_experts
        self.session = ReplaySession(self.spec, len(numbers), self._num_experts, topk)

    def _add_batch(self, handed: list[tuple[Any, Tensor]]) -> None:
        """Replay data of one or every layer: chosen once per step and content (a second pass reuses it)."""
        routers = [self._router_of(replay) for replay, _ in handed]
        targets = [_checked_targets(tensor, handed[0][1]) for _, tensor in handed]
        if self.session is None:
            self._start(routers[0], targets[0].shape[1])
        layers = tuple(self._layers.index(router.layer_number) for router in routers)
        if len(layers) > 1 and layers != tuple(range(len(self._layers))):
            raise ReplayDataError(f"RouterReplay.set_replay_data handed routes of MoE layers {list(layers)}: expected "
                                  f"each of the {len(self._layers)} layers once, in order")
        routes, rows = self._whole_micro_batch(torch.stack(targets, dim=1))
        everything = torch.ones(routes.shape[0], dtype=torch.bool, device=routes.device)
        plan = plan_micro_batch(routes, everything, self._offsets_for(routes.shape[0]), self._num_experts)
        key = (layers, tuple(plan.keys))
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(
                layers, routes, plan, rows, native=torch.zeros(routes.shape, dtype=torch.int16,
                                                                       device=routes.device),
                margin=torch.zeros(routes.shape[:2], device=routes.device))
            if not self.session.needs_native:
                batch.chosen(self._select(batch))
        for column, tensor in enumerate(handed):
            self._targets.add(tensor[1], (batch, column))

    def _select(self, batch: _Batch, **native) -> MicroBatchSelection:
        plan = batch.plan
        return select_micro_batch(self.session, batch.routes, plan.valid, plan.offsets, self._num_experts, plan=plan,
                                  layer=self._one_layer(batch), **native)

    def _select_on_native(self, batch: _Batch) -> None:
        native = self._assembled(batch.native)
        known = native.reshape(native.shape[0], -1).amin(1) > 0
        batch.chosen(self._select(batch, native=native.to(torch.int64) - 1, has_native=known,
                                  native_margin=self._assembled(batch.margin)))

    def _count(self, batch: _Batch) -> None:
        """The batch's routes, once, into the step's counts (on the rank that counts its micro-batch)."""
        if batch.selection is None:  # never replayed: a native pass of a mismatch loop that stopped there
            return
        native = self._assembled(batch.native)
        if self._layout.counts:
            routes, unobserved = counted_routes(batch.selection, native.to(torch.int64) - 1, self._num_experts)
            self.session.count(routes, batch.selection.mask, unrecorded=batch.selection.unrecorded,
                               unobserved=unobserved, layer=self._one_layer(batch))

    def _one_layer(self, batch: _Batch) -> int | None:
        """The MoE layer of a batch of one router's routes, in a model of several (None: every layer)."""
        return batch.layers[0] if len(batch.layers) < len(self._layers) else None

    def _whole_micro_batch(self, local: Tensor) -> tuple[Tensor, slice]:
        """``[rows, columns, topk]`` routes of this rank as the whole micro-batch's, and this rank's rows in it."""
        rows = local.shape[0]
        layout = self._layout
        if not layout.sliced:
            return local, slice(0, rows)
        parts = [torch.empty_like(local) for _ in range(layout.tp_size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=layout.tp_group)
        return torch.cat(parts), slice(layout.tp_rank * rows, (layout.tp_rank + 1) * rows)

    def _assembled(self, parts: Tensor) -> Tensor:
        """A tensor whose rows each tensor-parallel rank wrote for its own slice, whole on every rank.

        The native buffer holds expert id + 1 (0: not written); :func:`ranks.sum_disjoint` takes ids
        with -1 where a rank wrote nothing, so the ids travel shifted down and come back shifted up.
        """
        if not self._layout.sliced:
            return parts
        if parts.is_floating_point():
            return ranks.sum_disjoint(parts, [self._layout.tp_group])
        return ranks.sum_disjoint(parts - 1, [self._layout.tp_group]).add_(1)

    def _offsets_for(self, rows: int) -> Tensor:
        if self._offsets is None:
            return torch.tensor([0, rows])
        if int(self._offsets[-1]) != rows:
            raise ReplayDataError(f"replay.sequences(...) ends at row {int(self._offsets[-1])}, and the replay data hold "
                                  f"{rows} rows: expected boundaries over the whole micro-batch")
        return self._offsets


def _checked_targets(targets: Any, first: Any) -> Tensor:
    """One router's ``[rows, topk]`` integer targets, of the same shape as the first router's."""
    expected = tuple(first.shape) if isinstance(first, Tensor) else None
    if (not isinstance(targets, Tensor) or targets.dim() != 2 or targets.is_floating_point()
            or tuple(targets.shape) != expected):
        got = f"{targets.dtype} {tuple(targets.shape)}" if isinstance(targets, Tensor) else type(targets).__name__
        same = f", {list(expected)} like the first layer's" if expected is not None and targets is not first else ""
        raise ReplayDataError(f"replay data of {got} for a router: expected integer expert ids [rows, topk]{same}")
    return targets


def _live_routers() -> dict[int, Any]:
    """Every live ``TopKRouter`` with a ``RouterReplay``, by the id of its ``RouterReplay``."""
    from megatron.core.transformer.moe.router import TopKRouter

    # type(), not isinstance: isinstance may ask an object's __class__, which some proxies compute.
    return {id(found.router_replay): found for found in gc.get_objects()
            if issubclass(type(found), TopKRouter) and getattr(found, "router_replay", None) is not None}


def _held_targets() -> set[int]:
    """The ids of the targets Megatron-core's ``RouterReplay`` objects still hold (a later forward may replay them)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return {id(targets) for replay in RouterReplay.global_router_replay_instances
            for targets in (replay.target_topk_idx, *replay.replay_backward_list) if targets is not None}


def _pooled_mismatch(log_probs: Tensor, rollout_log_probs: Tensor | None, mask: Tensor | None) -> dict[str, float]:
    """The ``mismatch/`` keys of every rank's sampled tokens together."""
    from ablate.diagnostics.metrics import mismatch_metrics

    if rollout_log_probs is None:
        raise ReplayDataError("replay.metrics(log_probs=...) without rollout_log_probs: expected both, of one shape")
    if rollout_log_probs.shape != log_probs.shape:
        raise ReplayDataError(f"replay.metrics(): log_probs {tuple(log_probs.shape)} and rollout_log_probs "
                              f"{tuple(rollout_log_probs.shape)}: expected one shape")
    keep = torch.ones_like(log_probs, dtype=torch.bool) if mask is None else mask.bool()
    train = ranks.gather_over_world(log_probs.detach()[keep].double().cpu())
    rollout = ranks.gather_over_world(rollout_log_probs.detach()[keep].double().cpu())
    return mismatch_metrics(train, rollout, torch.ones_like(train, dtype=torch.bool))
