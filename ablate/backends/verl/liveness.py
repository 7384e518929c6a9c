"""A replay that silently does nothing must fail its cell, not complete it with wrong numbers.

verl runs lose replay without an error: routers built twice, a key set in the wrong place, a
rollout that records no routes. Each step verl logs is checked against what the cell asked for,
and the first step that shows one of these ends the cell with one line saying which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ablate.replay.seams import MICRO_BATCHES_KEY

#: verl's prefix of every actor-update metric (``rename_dict(metrics, "actor/")`` in its trainers). The hook
#: emits each key once per step, from the step's last update call: verl averages each actor metric over the
#: values it received, so a key emitted once reaches the trainer's logger unchanged, as ``actor/<key>``.
ACTOR_PREFIX = "actor/"
SEEN_KEY = ACTOR_PREFIX + MICRO_BATCHES_KEY


class SilentReplay(RuntimeError):
    """A step whose metrics show that replay did not do what the cell asked for."""


def check_step(step: int, record: Mapping[str, float], native: Mapping[str, float], budget: float) -> None:
    """Raise :class:`SilentReplay` when step ``step`` of a cell with ``budget`` shows replay doing nothing."""
    seen = native.get(SEEN_KEY)
    if seen is None:
        raise SilentReplay(
            f"step {step}: the replay hook never installed in verl's actor (no {SEEN_KEY} among the step's "
            "metrics): actor_rollout_ref.model.external_lib must stay ablate.backends.verl.worker, with an "
            "actor of backend.engine's engine in router_replay.mode=R3 (R2 with replay.source=train)"
        )
    if budget <= 0:
        return
    if seen == 0:
        raise SilentReplay(
            f"step {step}: the replay hook saw no R3 micro-batch at budget {budget:g}: verl passed no "
            "routed_experts to the actor (is the rollout recording routes, enable_rollout_routing_replay=True?)"
        )
    valid, replayed = record.get("replay/valid_routes", math.nan), record.get("replay/replayed_routes", math.nan)
    if valid > 0 and replayed == 0:
        raise SilentReplay(
            f"step {step}: replayed none of its {valid:.0f} recorded routes at budget {budget:g}"
        )
    residual = record.get("routing/residual_mismatch_rate", math.nan)
    if budget >= 1 and residual > 0:
        raise SilentReplay(
            f"step {step}: budget {budget:g} left {residual:.3g} of its valid routes mismatched after replay "
            "(every recorded route should have been replayed)"
        )
