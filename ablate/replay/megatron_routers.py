"""Megatron-core's ``RouterReplay`` driven with ablate's per-(token, layer) mask: what every Megatron path shares.

Two replay paths reach Megatron-core's ``TopKRouter``: verl's Megatron engine
(:mod:`ablate.backends.verl.engines.megatron`), and any Megatron-core training loop through
:func:`ablate.replay.megatron_core.partial_replay`. A router replays through a ``RouterReplay``
object: Megatron-core's own (``megatron.core.transformer.moe.router_replay``, the one NeMo RL,
SkyRL and AReaL drive) or verl 0.9.1's patched copy of it (``verl.utils.megatron.router_replay_patch``).
Both keep a router's targets the same way: ``set_target_indices(topk)`` makes them the forward's
``target_topk_idx`` and appends them to ``replay_backward_list``, which a recompute under
``REPLAY_BACKWARD`` pops in order; both route through ``get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)``. So one piece of code applies ablate's mask at either:

- :class:`TargetTable` says which mask a targets tensor carries, keyed by the very tensor the
  ``RouterReplay`` holds, so the recompute pops the forward's targets and finds the forward's mask;
- :func:`replay_topk` is ``get_replay_topk`` with the mask: the ``RouterReplay``'s own replay where
  the mask holds, the router's own top-k elsewhere (``torch.where``: a route is one or the other,
  never a mix), and the native top-k for the caller to report;
- :func:`watch_logit_gradients` hands the router-logit gradients to the Fisher estimate;
- :func:`replace_router_calls` puts a path's own ``get_replay_topk`` and a look at each
  ``TopKRouter.routing`` call in Megatron-core's place.

Nothing here synchronises with the host: a router call stays a chain of device operations.

The Megatron-core names the paths replace are the rows below, in the one entry-point table
(``ablate/backends/verl/entry_points.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ablate.replay import entry_points as ep
from ablate.replay.entry_points import EntryPoint

#: The megatron-core release the Megatron-core rows are written against (``.ci/verl-env.sh`` installs it).
MEGATRON_CORE_VERSION = "0.16.1"
#: The replay path of :func:`ablate.replay.megatron_core.partial_replay`: the rows' ``engine``.
MEGATRON_CORE = "megatron_core"
ROUTER_REPLAY = "megatron.core.transformer.moe.router_replay"
ROUTER = "megatron.core.transformer.moe.router"
#: ``RouterReplayAction`` values, the same in Megatron-core's enum and verl's copy of it.
RECORD, REPLAY_FORWARD, REPLAY_BACKWARD = "record", "replay_forward", "replay_backward"


@dataclass(frozen=True)
class MegatronCorePoint(EntryPoint):
    """A Megatron-core name ablate replaces: a refusal names the megatron-core release."""

    against: ClassVar[str] = f"megatron-core {MEGATRON_CORE_VERSION}"


SET_REPLAY_DATA = MegatronCorePoint(
    MEGATRON_CORE, ROUTER_REPLAY, "RouterReplay.set_replay_data", ("all_layers_topk_indices",),
    "replay.megatron_core.PartialReplay.set_replay_data: one mask over every layer's routes", during="partial_replay")
SET_TARGETS = MegatronCorePoint(
    MEGATRON_CORE, ROUTER_REPLAY, "RouterReplay.set_target_indices", ("self", "topk_indices"),
    "replay.megatron_core.PartialReplay.set_target_indices: one layer's mask (partial_replay); "
    "engines.megatron.MegatronSeam.set_target_indices where verl drives this class", during="partial_replay")
REPLAY_TOPK = MegatronCorePoint(
    MEGATRON_CORE, ROUTER_REPLAY, "RouterReplay.get_replay_topk",
    ("self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"),
    "replay.megatron_routers.replay_topk: the rollout's route where the mask says, the router's own elsewhere",
    during="partial_replay")
ROUTING = MegatronCorePoint(
    MEGATRON_CORE, ROUTER, "TopKRouter.routing", ("self", "logits"),
    "replay.megatron_core.PartialReplay.routing: router calls counted, router-logit gradients to the Fisher "
    "estimate", during="partial_replay")
#: The Megatron-core block of the entry-point table.
MEGATRON_CORE_POINTS = (SET_REPLAY_DATA, SET_TARGETS, REPLAY_TOPK, ROUTING)


def action(replay) -> str | None:
    """The ``RouterReplayAction`` value a ``RouterReplay`` is set to (None: it routes natively)."""
    current = replay.router_replay_action
    return None if current is None else current.value


def pending_targets(replay) -> Tensor | None:
    """The targets the router's next routing replays: the forward's, or the next recompute's."""
    current = action(replay)
    if current == REPLAY_FORWARD:
        return replay.target_topk_idx
    if current == REPLAY_BACKWARD and replay.replay_backward_list:
        return replay.replay_backward_list[0]
    return None


class TargetTable:
    """What ablate attached to each targets tensor handed to a ``RouterReplay``.

    Keyed by the tensor's ``id``, holding a reference to it so that the id stays the tensor's: a
    ``RouterReplay`` keeps that very object as its forward's targets and in its recompute list.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Tensor, Any]] = {}

    def add(self, targets: Tensor, value: Any) -> None:
        self._entries[id(targets)] = (targets, value)

    def get(self, targets: Tensor | None) -> Any:
        found = self._entries.get(id(targets)) if targets is not None else None
        return found[1] if found is not None and found[0] is targets else None

    def pending(self, replay) -> Any:
        """What is attached to the targets the ``RouterReplay``'s next routing replays (None: nothing)."""
        return self.get(pending_targets(replay))

    def retain(self, ids: set[int]) -> None:
        """Forget every tensor but those whose id is in ``ids`` (the targets a ``RouterReplay`` still holds)."""
        self._entries = {key: entry for key, entry in self._entries.items() if key in ids}

    def clear(self) -> None:
        self._entries.clear()


def replay_topk(original: Callable, replay, scores: Tensor, topk: int, num_groups, group_topk,
                default_compute_topk: Callable, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``RouterReplay.get_replay_topk`` with ablate's ``[rows]`` mask: (probs, indices, native indices).

    Rows where ``mask`` holds take the route the ``RouterReplay`` replays by its own method
    ``original`` (the forward's targets, or the recompute's, which it pops), with the gate
    weights it gathers from the router's scores; every other row takes the router's own top-k.
    """
    replayed_probs, replayed = original(replay, scores, topk, num_groups, group_topk, default_compute_topk)
    native_probs, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    keep = mask.to(scores.device)[:, None]
    return torch.where(keep, replayed_probs, native_probs), torch.where(keep, replayed, native), native


def watch_logit_gradients(logits: Tensor, add_fisher: Callable[[Tensor], None]) -> None:
    """``add_fisher(gradient)`` with the gradient the loss gives the router logits, where one flows."""
    if torch.is_grad_enabled() and logits.requires_grad:
        logits.register_hook(add_fisher)


def replace_router_calls(replay_topk_point: EntryPoint, routing_point: EntryPoint, replay_topk: Callable,
                         watch: Callable[[Any, Tensor], None]) -> None:
    """Route every ``get_replay_topk`` call to ``replay_topk(original, replay, scores, topk, num_groups,
    group_topk, default_compute_topk)``, and show each ``TopKRouter.routing`` call to ``watch(router,
    logits)`` before the router routes. :func:`ablate.replay.entry_points.restore` puts both back."""
    original_topk, original_routing = ep.original(replay_topk_point), ep.original(routing_point)

    def get_replay_topk(replay, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return replay_topk(original_topk, replay, scores, topk, num_groups, group_topk, default_compute_topk)

    def routing(router, logits, *args, **kwargs):
        watch(router, logits)
        return original_routing(router, logits, *args, **kwargs)

    ep.replace(replay_topk_point, get_replay_topk)
    ep.replace(routing_point, routing)
