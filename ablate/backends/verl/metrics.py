"""The hook's ``replay/`` and ``routing/`` keys of one training step, and their way through verl.

The keys come from the counter sums of the shared definitions in
:mod:`ablate.diagnostics.metrics`, pooled over the step's update passes and every rank. They are
emitted once per step, from the step's last update call: verl prefixes every actor metric with
``actor/`` and averages each over the values it received, so a key emitted once reaches the
trainer's logger unchanged, as ``actor/<key>``. :func:`ablate.backends.verl.backend.split_metrics`
takes the prefix off again.
"""

from __future__ import annotations

from collections.abc import Mapping

from ablate.diagnostics.metrics import metrics_from_counts

#: verl's prefix of every actor-update metric (``rename_dict(metrics, "actor/")`` in its trainers).
ACTOR_PREFIX = "actor/"
#: counts that each update epoch adds once more: reported per step, i.e. per epoch.
PER_EPOCH_COUNTS = ("valid_routes", "replayed_routes", "unrecorded_routes")


def step_metrics(
    counts: Mapping[str, float], budget: float, topk: int, *, fisher_fallback: bool, fisher_nonfinite: int,
    update_epochs: int,
) -> dict[str, float]:
    """Schema ``replay/`` and ``routing/`` keys of one step from its summed route counts.

    Every update epoch replays each route of the step once, so the route counts are divided by
    the number of epochs: ``replay/valid_routes`` is the number of valid routes in the step's
    batch. Ratios pool every update pass.
    """
    per_step = dict(counts)
    for key in PER_EPOCH_COUNTS:
        per_step[key] = counts[key] / update_epochs
    return metrics_from_counts(per_step, budget, topk, fisher_fallback=fisher_fallback, fisher_nonfinite=fisher_nonfinite)
