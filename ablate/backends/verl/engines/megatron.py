"""The Megatron engine's seam: verl 0.9.1's R3 in ``MegatronEngine``, without editing verl or Megatron.

verl replays rollout routes in ``MegatronEngine.forward_step``: it builds a per-token R3 mask
and hands routes and mask to ``set_router_replay_data``, which packs them (THD, context-parallel
zigzag, sequence-parallel scatter) and maps each router to its layer's column by global layer
number. Each router replays through a ``RouterReplay``: verl 0.9.1's patched copy of
Megatron-core's class, or Megatron-core's own where a verl drives that one
(:func:`..entry_points.router_replay_module` reads which from verl's sources). The seam
replaces (:mod:`..entry_points`):

- ``set_router_replay_data``, in ``transformer_impl``'s namespace only: the hook selects a
  ``[tokens, layers]`` mask and the routes travel with one more column (mask, valid token and
  row id, packed). verl packs that augmented tensor exactly like the routes, so every router receives
  its own layer's mask and row ids already aligned with its rows; ``set_target_indices``,
  replaced for the length of that call, splits the columns back off and hands the routes on,
  keeping the layer's mask beside them (:class:`ablate.replay.megatron_routers.TargetTable`).
  No packing logic is duplicated.
- ``RouterReplay.get_replay_topk``: ``torch.where(mask, replayed, native)`` with that mask
  (:func:`ablate.replay.megatron_routers.replay_topk`, shared with
  :func:`ablate.replay.megatron_core.partial_replay`), the native top-k to the hook.
- ``TopKRouter.routing``: registers a gradient hook on the router logits, whose per-token
  squares feed the Fisher estimate.
- ``MegatronEngine.forward_backward_batch``: one hook call per verl call (:func:`.base.hooked_call`).

Rank layout: verl gives every rank of a tensor-, context- and pipeline-parallel group (TP x CP x
PP) the same micro-batches, and every virtual-pipeline chunk of a rank sees them again. TP with
sequence parallelism and CP split the tokens, PP and VPP split the layers. Selection counts are
taken on the rank with TP and CP rank 0 whose chunk holds the first MoE layer, once per
micro-batch; native routes are summed over TP x CP, then over PP (docs/design.md section 4).

verl imports ``actor_rollout_ref.model.external_lib`` in every process that builds its model
config: the trainer, the agent-loop workers and the rollout servers too. The hook is installed
only when a Megatron actor engine with R3 is built (:func:`arm`), and nothing here imports
verl's Megatron engine before verl itself does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ablate.backends.verl import entry_points as ep
from ablate.backends.verl.engines.base import arm as arm_engine
from ablate.backends.verl.engines.base import REPLAY_MODES, hooked_call, r3_call
from ablate.replay import megatron_routers, ranks
from ablate.replay.megatron_routers import (
    REPLAY_FORWARD,
    TargetTable,
    replace_router_calls,
    replay_topk,
    watch_logit_gradients,
)
from ablate.replay.seams import CallInfo, EngineSeam, split_augmented

ENGINE_MODULE = ep.MEGATRON_ENGINE_MODULE
_VERL_REPLAY = "verl.utils.megatron.router_replay_patch"
INIT = ep.entry(ENGINE_MODULE, "MegatronEngine.__init__")
FORWARD_BACKWARD = ep.entry(ENGINE_MODULE, "MegatronEngine.forward_backward_batch")
SET_REPLAY_DATA = ep.entry(ENGINE_MODULE, "set_router_replay_data")
ROUTING = ep.entry("megatron.core.transformer.moe.router", "TopKRouter.routing")


def replay_class_points() -> tuple[ep.EntryPoint, ep.EntryPoint]:
    """``RouterReplay.set_target_indices`` and ``get_replay_topk`` of the class verl drives."""
    if ep.router_replay_module() == megatron_routers.ROUTER_REPLAY:
        return megatron_routers.SET_TARGETS, megatron_routers.REPLAY_TOPK
    return (ep.entry(_VERL_REPLAY, "RouterReplay.set_target_indices"),
            ep.entry(_VERL_REPLAY, "RouterReplay.get_replay_topk"))


def layer_columns(tf_config, route_layers: int) -> tuple[int | None, ...]:
    """For each transformer layer (0-based), its column in verl's route tensor; None if dense.

    verl indexes the route tensor by global layer when it has one column per transformer layer,
    and by MoE-layer ordinal otherwise (``set_router_replay_data``); the same rule applies here.
    """
    from verl.utils.megatron.router_replay_utils import is_moe_layer

    by_layer = route_layers == tf_config.num_layers
    columns: list[int | None] = []
    ordinal = 0
    for layer in range(tf_config.num_layers):
        if is_moe_layer(tf_config, layer):
            columns.append(layer if by_layer else ordinal)
            ordinal += 1
        else:
            columns.append(None)
    return tuple(columns)


def first_moe_layer(info: CallInfo) -> int:
    """Global layer number (1-based, as Megatron's) of the first MoE layer: its chunk counts."""
    return next(layer for layer, column in enumerate(info.layer_columns, 1) if column is not None)


@dataclass(frozen=True)
class _Router:
    """A ``RouterReplay``'s place in the route tensor: its column and its MoE-layer index."""

    replay: Any
    column: int
    moe_layer: int


class MegatronSeam(EngineSeam):
    name = "megatron"

    def __init__(self, hook) -> None:
        super().__init__(hook)
        #: id(RouterReplay) -> its column, set at each micro-batch the router replays.
        self._routers: dict[int, _Router] = {}
        #: each targets tensor handed to a RouterReplay -> its rows' :class:`LayerTargets`, for one pass.
        self._targets = TargetTable()
        #: ``set_target_indices`` and ``get_replay_topk`` of the class verl drives, read when the routers
        #: are installed (the hook is built where verl is not installed too: benchmarks, the fast tests).
        self._set_targets: ep.EntryPoint | None = None
        self._replay_topk: ep.EntryPoint | None = None

    # ------------------------------------------------------------------------ the seam
    def call_info(self, engine, data, forward_only: bool) -> CallInfo | None:
        tf_config = engine.tf_config
        return r3_call(data, forward_only, num_experts=tf_config.num_moe_experts,
                       layer_columns=lambda layers: layer_columns(tf_config, layers))

    def counting_rank(self, info: CallInfo, layers: Sequence[int]) -> bool:
        """The rank with TP and CP rank 0 whose model chunk holds the first MoE layer."""
        if first_moe_layer(info) not in layers:
            return False
        if not ranks.distributed():
            return True
        from megatron.core import parallel_state as mpu

        return mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0

    def assemble(self, parts: Tensor) -> Tensor:
        """Sum of a tensor whose entries each rank of TP x CP x PP wrote disjointly (zeros elsewhere)."""
        if not ranks.distributed():
            return parts
        from megatron.core import parallel_state as mpu

        groups = (mpu.get_tensor_and_context_parallel_group(), mpu.get_pipeline_model_parallel_group())
        return ranks.sum_disjoint(parts, groups)

    def end_pass(self) -> None:
        self._targets.clear()

    # ------------------------------------------------------------------- install, restore
    def install(self) -> None:
        """The router half (:meth:`install_routers`) and verl's engine: micro-batches and calls."""
        hook = self.hook
        self.install_routers()
        original_set = ep.original(SET_REPLAY_DATA)
        original_fbb = ep.original(FORWARD_BACKWARD)

        def set_router_replay_data(*args, **kwargs):
            return self.set_router_replay_data(original_set, *args, **kwargs)

        def forward_backward_batch(engine, data, loss_function, forward_only=False):
            return hooked_call(hook, original_fbb, engine, data, loss_function, forward_only)

        ep.replace(SET_REPLAY_DATA, set_router_replay_data)
        ep.replace(FORWARD_BACKWARD, forward_backward_batch)

    def install_routers(self) -> None:
        """Masks, native routes and Fisher gradients of Megatron's routers reach the hook.

        It imports only the RouterReplay class verl drives and Megatron's router, not verl's engine,
        so a benchmark can drive the hook where verl's trainer dependencies are not installed.
        """
        from megatron.core.transformer.moe.router import TopKRouter

        self._set_targets, self._replay_topk = replay_class_points()
        if self._replay_topk.module == _VERL_REPLAY and not getattr(TopKRouter, "_router_replay_patched", False):
            from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

            # verl applies its patch when an R3 engine is built; applying it first lets us wrap the
            # patched routing. verl's later call returns early for an already patched TopKRouter. The
            # check keeps the router registry intact when the model already exists.
            apply_router_replay_patch()
        replace_router_calls(self._replay_topk, ROUTING, self.get_replay_topk, self.watch_logit_gradients)

    def uninstall(self) -> None:
        for point in (self._replay_topk, ROUTING, SET_REPLAY_DATA, FORWARD_BACKWARD, self._set_targets):
            if point is not None:
                ep.restore(point)
        self._routers.clear()
        self._targets.clear()

    # ----------------------------------------------------------------- verl-facing methods
    def set_router_replay_data(self, original, layers_topk_idx, attention_mask, tf_config, vp_rank=None,
                               replay_mask=None, local_cp_size=None, model=None):
        """verl's ``set_router_replay_data`` with ablate's mask in place of R3's per-token mask.

        Under R2 (``replay.source=train``) verl hands no mask: the routes are the trainer's own,
        recorded in its old-log-prob pass, for every token, and ablate's mask chooses among them.
        """
        hook = self.hook
        info = hook.current_call()
        r2 = replay_mask is None and hook.spec.source == "train"  # R2 replays every token's recorded routes
        if (info is None or (replay_mask is None and not r2) or model is None
                or not getattr(layers_topk_idx, "is_nested", False)):
            # Not a replayed micro-batch of an ablate cell (BSHD input, outside a hooked call).
            return original(layers_topk_idx, attention_mask, tf_config, vp_rank, replay_mask=replay_mask,
                            local_cp_size=local_cp_size, model=model)
        from verl.utils.megatron.router_replay_utils import iter_model_routers

        rollout, offsets = layers_topk_idx.values(), layers_topk_idx.offsets()
        tokens = (torch.ones(rollout.shape[0], dtype=torch.bool, device=rollout.device) if r2
                  else replay_mask.values())
        routers = list(iter_model_routers(model))
        for number, replay in routers:
            column = info.layer_columns[number - 1]
            self._routers[id(replay)] = _Router(replay, column, info.moe_layer(column))
        counted = self.counting_rank(info, [number for number, _ in routers])
        augmented = hook.augmented_routes(vp_rank or 0, rollout, tokens, offsets, counted=counted)
        packed = torch.nested.nested_tensor_from_jagged(augmented, offsets=offsets)
        with self._splitting_targets(info.topk, hook.last_rows):
            original(packed, attention_mask, tf_config, vp_rank, replay_mask=None, local_cp_size=local_cp_size,
                     model=model)

    @contextlib.contextmanager
    def _splitting_targets(self, topk: int, block: slice):
        """While verl distributes augmented routes, split each router's columns back apart.

        The routes go on to the ``RouterReplay`` without verl's own replay mask: the layer's mask
        stays with them in the seam, and :meth:`get_replay_topk` applies it, with either class. A
        router given as many rows as the micro-batch has got them all, in order: verl padded and
        split nothing (no sequence or context parallelism, no alignment padding), so its rows are
        ``block``, known without decoding them.
        """
        original = ep.original(self._set_targets)
        rows = block.stop - block.start

        def set_target_indices(replay, topk_indices: Tensor, replay_mask: Tensor | None = None):
            targets = split_augmented(topk_indices, topk, block if topk_indices.shape[0] == rows else None)
            self._targets.add(targets.routes, targets)
            original(replay, targets.routes)

        ep.replace(self._set_targets, set_target_indices)
        try:
            yield
        finally:
            ep.restore(self._set_targets)

    def get_replay_topk(self, original, replay, scores, topk, num_groups, group_topk, default_compute_topk):
        """The router's replay with ablate's mask; in the forward, its native top-k reported to the hook."""
        targets = self._targets.pending(replay)
        router = self._routers.get(id(replay))
        if targets is None or router is None or router.replay is not replay:
            return original(replay, scores, topk, num_groups, group_topk, default_compute_topk)
        probs, indices, native = replay_topk(original, replay, scores, topk, num_groups, group_topk,
                                             default_compute_topk, targets.mask)
        if megatron_routers.action(replay) == REPLAY_FORWARD:
            with torch.no_grad():
                self.hook.observe(router.column, targets.rows, native, scores)
        return probs, indices

    def watch_logit_gradients(self, router, logits: Tensor) -> None:
        """Per-token squared router-logit gradients of a replaying router go to the Fisher estimate."""
        replay = getattr(router, "router_replay", None)
        targets = self._targets.pending(replay) if replay is not None else None
        slot = self._routers.get(id(replay))
        if targets is not None and slot is not None and slot.replay is replay:
            hook, layer, valid = self.hook, slot.moe_layer, targets.valid
            watch_logit_gradients(logits, lambda grad: hook.add_fisher(layer, grad, valid))


# --------------------------------------------------------------------- install in the actor only
def is_replay_actor(engine) -> bool:
    """A Megatron engine that trains a policy with R3 (or R2): not a critic, not a forward-only reference."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    config = engine.engine_config
    policy = isinstance(engine, MegatronEngineWithLMHead) and not isinstance(engine, MegatronEngineWithValueHead)
    return policy and config.router_replay.mode in REPLAY_MODES and not config.forward_only


def arm(make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` when this process builds an R3 (or R2) Megatron actor engine (:func:`.base.arm`)."""
    arm_engine(INIT, is_replay_actor, make_hook)
