"""The VeOmni engine's seam: verl 0.9.1's R3 in ``VeOmniEngine`` (FSDP2), without editing verl or VeOmni.

verl replays rollout routes in VeOmni through one controller, ``VeOmniRouterReplay``, tapped
into VeOmni's MoE blocks by ``veomni.utils.moe_router_replay.maybe_replay_indices``. For each
micro-batch, ``VeOmniEngineWithLMHead._prepare_router_replay_inputs`` takes the rollout routes
in the packed (remove-padding) order of ``input_ids``, appends the engine's pad rows, slices them
for Ulysses sequence parallelism and hands one ``[rows, topk]`` target per decoder layer to
``begin_microbatch``; each router's forward then calls ``on_router_forward``, which maps the
router to the next target by the order routers first fire and returns the target where it is a
recorded route (distinct ids), the native top-k elsewhere. The seam replaces
(:mod:`..entry_points`):

- ``_prepare_router_replay_inputs``: the hook selects a ``[tokens, layers]`` mask, and the routes
  travel with one more column (mask, valid token and row id, packed) through verl's own padding and
  slicing; ``begin_microbatch``, replaced for the length of that call, splits them back off.
- ``on_router_forward``: verl's replay, then ``torch.where(mask, replayed, native)`` with the
  router's own layer of ablate's mask; the native top-k goes to the hook, and a gradient hook on
  the routing scores gives the router-logit gradients of the Fisher estimate.
- ``VeOmniEngine.forward_backward_batch``: one hook call per verl call (:func:`.base.hooked_call`).

verl's R3 here replays every recorded route of the micro-batch, prompt tokens included (there is
no per-token R3 mask as in the Megatron engine): a token is valid for the budget when all its
routes were recorded. Under R2 the update passes replay the routes verl's controller recorded in
the old-log-prob pass the same way, through the same two methods, so the seam needs nothing more.
Slot ``i`` of the route tensor belongs to the ``i``-th router to fire, so every decoder layer
must be a MoE layer (verl's engine checks it after each forward;
:mod:`..launch` refuses such a model before launch).

Rank layout: FSDP2 shards parameters, not tokens: each data-parallel rank routes its own micro-
batches whole. Ulysses sequence parallelism splits a micro-batch's tokens over the ranks of its
SP group, which all hold the same micro-batches: selection counts are taken on SP rank 0, native
routes are summed over the SP group. Expert parallelism dispatches tokens after routing: each
rank routes its own tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ablate.backends.verl import entry_points as ep
from ablate.backends.verl.engines.base import arm as arm_engine
from ablate.backends.verl.engines.base import REPLAY_MODES, hooked_call, r3_call
from ablate.replay import ranks
from ablate.replay.seams import CallInfo, EngineSeam, LayerTargets, split_layers

ENGINE_MODULE = ep.VEOMNI_ENGINE_MODULE
_REPLAY = "verl.utils.veomni.router_replay"
INIT = ep.entry(ENGINE_MODULE, "VeOmniEngine.__init__")
FORWARD_BACKWARD = ep.entry(ENGINE_MODULE, "VeOmniEngine.forward_backward_batch")
PREPARE = ep.entry(ENGINE_MODULE, "VeOmniEngineWithLMHead._prepare_router_replay_inputs")
BEGIN_MICRO_BATCH = ep.entry(_REPLAY, "VeOmniRouterReplay.begin_microbatch")
ON_ROUTER_FORWARD = ep.entry(_REPLAY, "VeOmniRouterReplay.on_router_forward")


def text_config(config):
    """The language model's config (a multimodal model such as Qwen3.5-MoE nests it)."""
    return getattr(config, "text_config", None) or config


def logit_gradients(scores: Tensor, score_grads: Tensor) -> Tensor:
    """Gradients with respect to router logits ``z`` from those of ``p = softmax(z)``: ``p * (g - <p, g>)``.

    VeOmni's patched MoE blocks (Qwen3-MoE, Qwen3.5-MoE) take the replayed gate weights from the
    softmax of the router logits, so every gradient the logits receive from the loss flows
    through ``p``; a load-balancing loss on the raw logits, when one is configured, is not part
    of the estimate.
    """
    scores = scores.detach().float()
    score_grads = score_grads.float()
    return scores * (score_grads - (scores * score_grads).sum(-1, keepdim=True))


class VeOmniSeam(EngineSeam):
    name = "veomni"

    def __init__(self, hook) -> None:
        super().__init__(hook)
        #: this micro-batch's targets of each layer position, in verl's fire order.
        self._layers: list[LayerTargets] = []
        #: id(router module) -> (the module, its layer position), at its first fire in the micro-batch.
        self._positions: dict[int, tuple[Any, int]] = {}

    # ------------------------------------------------------------------------ the seam
    def call_info(self, engine, data, forward_only: bool) -> CallInfo | None:
        config = text_config(engine.model_config.hf_config)
        return r3_call(data, forward_only, num_experts=config.num_experts,
                       layer_columns=lambda layers: tuple(range(layers)))

    def counting_rank(self, info: CallInfo, layers: Sequence[int]) -> bool:
        """SP rank 0 of a sequence-parallel group (every rank holds every layer)."""
        if not ranks.distributed():
            return True
        from veomni.distributed.parallel_state import get_parallel_state

        state = get_parallel_state()
        return not state.sp_enabled or state.sp_rank == 0

    def assemble(self, parts: Tensor) -> Tensor:
        """Sum over the sequence-parallel group of entries each of its ranks wrote disjointly."""
        if not ranks.distributed():
            return parts
        from veomni.distributed.parallel_state import get_parallel_state

        state = get_parallel_state()
        if not state.sp_enabled:
            return parts
        return ranks.sum_disjoint(parts, (state.sp_group,))

    def end_pass(self) -> None:
        self._layers = []
        self._positions.clear()

    # ------------------------------------------------------------------- install, restore
    def install(self) -> None:
        hook = self.hook
        original_prepare = ep.original(PREPARE)
        original_fbb = ep.original(FORWARD_BACKWARD)
        original_forward = ep.original(ON_ROUTER_FORWARD)

        def prepare_router_replay_inputs(engine, micro_batch, output_args):
            return self.prepare_router_replay_inputs(original_prepare, engine, micro_batch, output_args)

        def forward_backward_batch(engine, data, loss_function, forward_only=False):
            return hooked_call(hook, original_fbb, engine, data, loss_function, forward_only)

        def on_router_forward(controller, module, routing_scores, top_indices):
            return self.on_router_forward(original_forward, controller, module, routing_scores, top_indices)

        ep.replace(PREPARE, prepare_router_replay_inputs)
        ep.replace(FORWARD_BACKWARD, forward_backward_batch)
        ep.replace(ON_ROUTER_FORWARD, on_router_forward)

    def uninstall(self) -> None:
        for point in (PREPARE, FORWARD_BACKWARD, ON_ROUTER_FORWARD, BEGIN_MICRO_BATCH):
            ep.restore(point)
        self.end_pass()

    # ----------------------------------------------------------------- verl-facing methods
    def prepare_router_replay_inputs(self, original, engine, micro_batch, output_args):
        """verl's arming of the controller, with the micro-batch's mask riding on the routes."""
        from verl.utils.veomni.router_replay import RouterReplayAction

        hook, controller = self.hook, getattr(engine, "_router_replay", None)
        info = hook.current_call()
        routes = micro_batch.get("routed_experts", None)
        if (info is None or controller is None or controller.action is not RouterReplayAction.REPLAY
                or routes is None or not routes.is_nested):
            return original(engine, micro_batch, output_args)
        rollout, offsets = routes.values(), routes.offsets()
        every_token = torch.ones(rollout.shape[0], dtype=torch.bool, device=rollout.device)
        layers = range(1, len(info.layer_columns) + 1)
        # Routes the mask leaves native travel as zeros: verl's replay routes every row with a repeated
        # expert natively, so the mask is applied here, once, not at each router.
        augmented = hook.augmented_routes(0, rollout, every_token, offsets, counted=self.counting_rank(info, layers),
                                          zero_native=True)
        batch = micro_batch.copy()
        batch["routed_experts"] = torch.nested.nested_tensor_from_jagged(augmented, offsets=offsets)
        with self._splitting_targets(info.topk):
            return original(engine, batch, output_args)

    @contextlib.contextmanager
    def _splitting_targets(self, topk: int):
        """While verl arms the controller with augmented targets, split each layer's columns back apart."""
        original = ep.original(BEGIN_MICRO_BATCH)

        def begin_microbatch(controller, targets=None):
            original(controller, targets=self.arm_micro_batch(targets, topk))

        ep.replace(BEGIN_MICRO_BATCH, begin_microbatch)
        try:
            yield
        finally:
            ep.restore(BEGIN_MICRO_BATCH)

    def arm_micro_batch(self, targets: list[Tensor], topk: int) -> list[Tensor]:
        """Keep each layer's mask, validity and row ids of a micro-batch's augmented targets; the routes for verl.

        Targets of as many rows as the micro-batch are its rows in order (verl padded and sliced
        nothing): their ids are known without decoding them.
        """
        block = self.hook.last_rows
        whole = bool(targets) and targets[0].shape[0] == block.stop - block.start
        self._layers, self._positions = split_layers(targets, topk, block if whole else None), {}
        return [layer.routes for layer in self._layers]

    def on_router_forward(self, original, controller, module, routing_scores: Tensor, top_indices: Tensor) -> Tensor:
        """verl's replay of one router, masked per (token, layer); native routes and gradients to the hook."""
        chosen = original(controller, module, routing_scores, top_indices)
        if not self._layers:
            return chosen
        known = self._positions.get(id(module))
        first_fire = known is None or known[0] is not module
        if first_fire:
            known = self._positions[id(module)] = (module, len(self._positions))
        position = known[1]
        if position >= len(self._layers):
            return chosen  # verl raises for a router without a target; this micro-batch is not ablate's
        layer, hook = self._layers[position], self.hook
        if first_fire:  # a recompute under activation checkpointing routes the same rows again
            with torch.no_grad():
                hook.observe(position, layer.rows, top_indices, routing_scores)
        if torch.is_grad_enabled() and routing_scores.requires_grad:
            scores, valid = routing_scores, layer.valid
            routing_scores.register_hook(lambda grad: hook.add_fisher(position, logit_gradients(scores, grad), valid))
        return chosen


# --------------------------------------------------------------------- install in the actor only
def is_replay_actor(engine) -> bool:
    """A VeOmni engine that trains a policy with R3 (or R2): not a critic, not a forward-only reference."""
    from verl.workers.engine.veomni.transformer_impl import VeOmniEngineWithLMHead

    config = engine.engine_config
    return (isinstance(engine, VeOmniEngineWithLMHead) and config.router_replay.mode in REPLAY_MODES
            and not config.forward_only)


def arm(make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` when this process builds an R3 (or R2) VeOmni actor engine (:func:`.base.arm`)."""
    arm_engine(INIT, is_replay_actor, make_hook)
