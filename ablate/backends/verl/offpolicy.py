"""The schema's ``mismatch/`` keys of a verl step, computed in verl's trainer process.

verl's trainer compares the rollout's log-probs with the actor's old log-probs (which replay
the cell's mask) in ``calculate_debug_metrics``, on every step where the rollout returns log-
probs. Wrapped, the same call also returns :func:`ablate.diagnostics.metrics.mismatch_metrics`
of those tensors, under the schema's names: every ``mismatch/`` key, defined as the synthetic
backend defines it, rather than the two verl's ``rollout_corr`` helper computes when configured.
"""

from __future__ import annotations

#: Where verl 0.9.1's trainers call it: the V1 trainer imports it by name, the legacy one from its module.
CALLERS = ("verl.trainer.ppo.v1.trainer_base", "verl.utils.debug.metrics")


def with_mismatch_metrics(calculate_debug_metrics):
    def calculate(data):
        from ablate.diagnostics.metrics import mismatch_metrics

        metrics = calculate_debug_metrics(data)
        batch = data.batch
        responses = batch["responses"].shape[1]
        mask = batch["response_mask"] if "response_mask" in batch else batch["attention_mask"][:, -responses:]
        valid = mask.bool()
        if bool(valid.any()):
            metrics.update(mismatch_metrics(batch["old_log_probs"].double(), batch["rollout_log_probs"].double(), valid))
        return metrics

    return calculate


def install_in_trainer() -> None:
    """Wrap ``calculate_debug_metrics`` wherever verl's trainers call it, now or once imported."""
    from ablate.backends.verl import entry_points as ep
    from ablate.backends.verl.import_hooks import when_imported

    for name in CALLERS:
        point = ep.entry(name, "calculate_debug_metrics")

        def wrap(module, point=point) -> None:
            if not ep.replaced(point):
                ep.replace(point, with_mismatch_metrics(ep.original(point)))

        when_imported(name, wrap)
