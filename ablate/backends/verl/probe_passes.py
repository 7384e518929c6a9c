"""Counterfactual probes inside verl's old-log-prob call (docs/probes.md, the verl hook).

On a probed step the hook runs one more forward-only ``forward_backward_batch`` per probe in
the step's old-log-prob call, with that probe's mask. Its output is scored here, in the actor,
against the rollout's log-probs, and then dropped: verl never sees it.

Why in the actor: verl 0.9.1's trainer hands ``compute_log_prob`` its whole batch, so the
actor's ``data`` holds ``rollout_log_probs`` (and ``response_mask``) beside the inputs, while the
trainer keeps only the pass's ``log_probs`` (and drops every metric of that call but its MFU).
Scoring here needs no new channel from the workers to the trainer. Where the trainer computes a
cell's own ``mismatch/`` keys (:mod:`.offpolicy`) it selects
``old_log_probs.double() - rollout_log_probs.double()`` over ``response_mask`` in batch order;
the probe's keys are computed from the same values in the same order: each data-parallel rank's
share of valid response tokens, taken on its one rank with outputs (verl's
``is_mp_src_rank_with_outputs``), gathered over the world in rank order, which is the data-
parallel order of verl's split of the batch. So a probe whose mask is the cell's own reproduces
the cell's ``mismatch/`` keys bit for bit, not only up to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ablate.diagnostics.metrics import mismatch_metrics
from ablate.replay import ranks


def response_log_probs(output, data) -> tuple[Tensor, Tensor]:
    """This rank's ``(train, rollout)`` log-probs of valid response tokens, in batch order (float32, CPU).

    ``output`` is a forward-only ``forward_backward_batch`` result on a rank with outputs, its
    ``log_probs`` jagged over whole sequences. They are cut to the responses with verl's own
    helpers, as its trainers cut the old-log-prob pass: ``response_from_nested`` where the batch
    is jagged (the V1 trainer's TransferQueue batch), ``no_padding_2_padding`` where it is padded
    (the legacy trainer's). Valid tokens are taken in the trainer's order either way: sequence by
    sequence, position by position.
    """
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    check_probe_batch(data)
    log_probs, mask, rollout = output["model_output"]["log_probs"], data["response_mask"], data["rollout_log_probs"]
    if mask.is_nested:
        valid = mask.values().bool().cpu()
        train, rollout = response_from_nested(log_probs, mask).values(), rollout.values()
    else:
        valid = mask.bool().cpu()
        train = no_padding_2_padding(log_probs, data)
    return train.float().cpu()[valid], rollout.cpu()[valid]


def check_probe_batch(data) -> None:
    """Raise on a batch a probe cannot be compared on. Every rank of a replica holds the same batch
    keys, so every rank raises alike, before the gather that a rank raising alone would leave hanging."""
    if "rollout_log_probs" not in data:
        raise RuntimeError("probes compare with the rollout's log-probs, but verl's batch has no rollout_log_probs: "
                           "set actor_rollout_ref.rollout.calculate_log_probs=true")
    mask, rollout = data["response_mask"], data["rollout_log_probs"]
    if mask.is_nested != rollout.is_nested:
        raise RuntimeError(f"verl's batch holds response_mask {'jagged' if mask.is_nested else 'padded'} but "
                           f"rollout_log_probs {'jagged' if rollout.is_nested else 'padded'}: expected one layout")


def probe_mismatch(output, data, has_outputs: bool) -> dict[str, float]:
    """The ``mismatch/`` keys of a probe pass over the whole batch, the same on every rank.

    Every rank takes part in the gather; ``has_outputs`` marks the one rank per data-parallel
    replica whose share counts. Empty when the batch has no valid response token.
    """
    check_probe_batch(data)
    empty = torch.zeros(0, dtype=torch.float32)
    train, rollout = response_log_probs(output, data) if has_outputs else (empty, empty)
    train, rollout = ranks.gather_over_world(train), ranks.gather_over_world(rollout)
    if train.numel() == 0:
        return {}
    return mismatch_metrics(train, rollout, torch.ones_like(train, dtype=torch.bool))
