"""Pure functions from tensors to the schema's ``replay/``, ``routing/``, ``mismatch/``, ``load/`` keys.

They run on the device of their inputs and never build a ``[tokens, layers, topk, topk]`` or
``[tokens, layers, topk, experts]`` tensor: a Qwen3-30B-A3B batch of 262,144 tokens has 100M
expert ids, and the diagnostics must cost a few passes over them, not a multiple of their size.
Undefined values (a recall with no mismatched route) are NaN, as the schema allows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ablate.policies.builtin import route_scores
from ablate.routes import Routes, token_chunks

NAN = float("nan")
#: The sums behind the ``replay/`` and ``routing/`` keys (:func:`replay_counts`, :func:`routing_counts`).
REPLAY_COUNTS = ("valid_routes", "replayed_routes", "unrecorded_routes", "compared_replayed", "overridden_routes",
                 "fisher_mass", "fisher_total")
ROUTING_COUNTS = ("compared_routes", "compared_tokens", "compared_slots", "overlap_slots", "mismatched_routes",
                  "mismatched_tokens", "recalled_routes", "residual_routes")


def _ratio(numerator: Tensor | float, denominator: Tensor | float) -> float:
    denominator = float(denominator)
    return float(numerator) / denominator if denominator else NAN


def replay_counts(routes: Routes, mask: Tensor, *, fisher_scores: Tensor | None = None) -> dict[str, float]:
    """The sums behind the ``replay/`` keys, for one replay mask ``[tokens, layers]``.

    Sums add up over micro-batches, passes and ranks; :func:`replay_metrics_from_counts` turns
    them into the keys. ``compared_replayed`` counts the replayed routes that have a native route
    to compare with (all of them when ``routes.native`` is given, none otherwise). ``Routes``
    hold recorded routes only, so ``unrecorded_routes`` is 0 here; a backend that receives
    unrecorded routes (verl) counts them itself and adds them to the sum.
    """
    mask = mask & routes.valid[:, None]
    replayed = float(mask.sum())
    counts = dict.fromkeys(REPLAY_COUNTS, 0.0)
    counts.update(valid_routes=float(routes.num_valid_routes), replayed_routes=replayed)
    if routes.native_overlap is not None:
        counts["compared_replayed"] = replayed
        counts["overridden_routes"] = float(((routes.native_overlap < routes.topk) & mask).sum())
    if fisher_scores is not None:
        score = route_scores(fisher_scores, routes)
        counts["fisher_mass"] = float((score * mask).sum(dtype=torch.float64))
        counts["fisher_total"] = float(score[routes.valid].sum(dtype=torch.float64))
    return counts


def replay_metrics_from_counts(counts: Mapping[str, float], budget: float, *, fisher_fallback: bool = False) -> dict[str, float]:
    """``replay/`` keys from :func:`replay_counts` sums (NaN where a denominator is 0)."""
    return {
        "replay/budget_requested": float(budget),
        "replay/budget_realized": _ratio(counts["replayed_routes"], counts["valid_routes"]),
        "replay/valid_routes": float(counts["valid_routes"]),
        "replay/replayed_routes": float(counts["replayed_routes"]),
        "replay/unrecorded_routes": float(counts["unrecorded_routes"]),
        "replay/override_rate": _ratio(counts["overridden_routes"], counts["compared_replayed"]),
        "replay/fisher_mass": _ratio(counts["fisher_mass"], counts["fisher_total"]),
        "replay/fisher_fallback": float(bool(fisher_fallback)),
    }


def replay_metrics(
    routes: Routes,
    mask: Tensor,
    budget: float,
    *,
    fisher_scores: Tensor | None = None,
    fisher_fallback: bool = False,
) -> dict[str, float]:
    """``replay/`` keys for one replay mask ``[tokens, layers]``."""
    counts = replay_counts(routes, mask, fisher_scores=fisher_scores)
    return replay_metrics_from_counts(counts, budget, fisher_fallback=fisher_fallback)


def routing_counts(routes: Routes, mask: Tensor) -> dict[str, float]:
    """The sums behind the ``routing/`` keys; all 0 without native routes (nothing compared)."""
    overlap = routes.native_overlap
    if overlap is None:
        return dict.fromkeys(ROUTING_COUNTS, 0.0)
    valid = routes.valid[:, None]
    mismatched = (overlap < routes.topk) & valid
    return {
        "compared_routes": float(routes.num_valid_routes),
        "compared_tokens": float(routes.num_valid_tokens),
        "compared_slots": float(routes.num_valid_routes * routes.topk),
        "overlap_slots": float((overlap * valid).sum(dtype=torch.float64)),
        "mismatched_routes": float(mismatched.sum()),
        "mismatched_tokens": float(mismatched.any(1).sum()),
        "recalled_routes": float((mismatched & mask).sum()),
        "residual_routes": float((mismatched & ~mask).sum()),
    }


def routing_metrics_from_counts(counts: Mapping[str, float]) -> dict[str, float]:
    """``routing/`` keys from :func:`routing_counts` sums: rollout versus native routes."""
    return {
        "routing/route_mismatch_rate": _ratio(counts["mismatched_routes"], counts["compared_routes"]),
        "routing/token_mismatch_rate": _ratio(counts["mismatched_tokens"], counts["compared_tokens"]),
        "routing/topk_overlap": _ratio(counts["overlap_slots"], counts["compared_slots"]),
        "routing/mismatch_recall": _ratio(counts["recalled_routes"], counts["mismatched_routes"]),
        "routing/residual_mismatch_rate": _ratio(counts["residual_routes"], counts["compared_routes"]),
    }


def routing_metrics(routes: Routes, mask: Tensor) -> dict[str, float]:
    """``routing/`` keys: rollout versus native routes, and what the mask did about them.

    All NaN when the routes carry no native routes (nothing to compare against).
    """
    return routing_metrics_from_counts(routing_counts(routes, mask))


def mismatch_metrics(
    logp_train: Tensor, logp_rollout: Tensor, valid: Tensor, *, extreme_threshold: float = 2.0
) -> dict[str, float]:
    """``mismatch/`` keys from per-token log-probs of the sampled tokens (any matching shape).

    With ``l = logp_train - logp_rollout`` and ``r = exp(l)``: ``kl_k1 = mean(-l)``,
    ``kl_k2 = mean(l^2 / 2)``, ``kl_k3 = mean(r - 1 - l)`` (Schulman's estimators of
    ``KL(rollout || train)`` from rollout samples), extreme-token fraction
    ``mean(max(r, 1/r) > extreme_threshold)``, and mean and max ``|l|``. Means run over valid
    tokens, in float64 so tiny mismatches are not lost to rounding.
    """
    if logp_train.shape != logp_rollout.shape or valid.shape != logp_train.shape:
        raise ValueError(
            f"log-prob shapes {tuple(logp_train.shape)} (train), {tuple(logp_rollout.shape)} (rollout) and valid "
            f"{tuple(valid.shape)} differ: expected one shape"
        )
    if extreme_threshold <= 1:
        raise ValueError(f"extreme_threshold={extreme_threshold}: expected a ratio > 1")
    log_ratio = (logp_train.double() - logp_rollout.double())[valid.bool()]
    if log_ratio.numel() == 0:
        raise ValueError("mismatch metrics need at least one valid token: valid is all False")
    abs_log_ratio = log_ratio.abs()
    return {
        "mismatch/kl_k1": float((-log_ratio).mean()),
        "mismatch/kl_k2": float((log_ratio.square() / 2).mean()),
        "mismatch/kl_k3": float(torch.expm1(log_ratio).sub(log_ratio).clamp(min=0).mean()),
        "mismatch/extreme_token_frac": float((abs_log_ratio > math.log(extreme_threshold)).double().mean()),
        "mismatch/abs_logratio_mean": float(abs_log_ratio.mean()),
        "mismatch/abs_logratio_max": float(abs_log_ratio.max()),
    }


def expert_load(routes: Routes, mask: Tensor | None = None) -> Tensor:
    """``[layers, experts]`` token counts of the routes the training forward used.

    Replayed routes (``mask`` True) use the rollout experts, the others the native experts; with
    no mask every route is native, and without native routes the rollout experts are counted.
    """
    layers, experts = routes.num_layers, routes.num_experts
    # (layer, expert) slots fit int16 for any real MoE (48 * 128 = 6144): bincount reads 2 bytes an
    # id instead of 8, and each chunk of valid tokens is one where, one add, one bincount.
    slot_dtype = torch.int16 if layers * experts <= torch.iinfo(torch.int16).max else torch.int32
    layer_base = (torch.arange(layers, device=routes.device, dtype=slot_dtype) * experts)[:, None]
    counts = torch.zeros(layers * experts, dtype=torch.long, device=routes.device)
    for rows in token_chunks(routes.valid, layers * routes.topk):
        if routes.native is None:
            ids = routes.rollout[rows]
        elif mask is None:
            ids = routes.native[rows]
        else:
            ids = torch.where(mask[rows][..., None], routes.rollout[rows], routes.native[rows])
        counts += torch.bincount((ids.to(slot_dtype) + layer_base).reshape(-1), minlength=layers * experts)
    return counts.reshape(layers, experts)


def load_metrics(load: Tensor) -> dict[str, float]:
    """``load/`` keys from a ``[layers, experts]`` load, reduced over layers.

    Normalised entropy ``H(p) / log E`` (1 = perfectly balanced), max violation
    ``max / mean - 1`` (0 = balanced), coefficient of variation ``std / mean`` (population std),
    and the fraction of (layer, expert) pairs that received no token.
    """
    load = load.double()
    experts = load.shape[1]
    totals = load.sum(1, keepdim=True)
    p = load / totals.clamp(min=1)
    entropy = -(p * p.clamp(min=1e-300).log()).sum(1) / math.log(experts) if experts > 1 else torch.ones(load.shape[0])
    mean = totals.squeeze(1) / experts
    violation = load.max(1).values / mean.clamp(min=1e-300) - 1
    cv = load.std(1, correction=0) / mean.clamp(min=1e-300)
    return {
        "load/entropy_norm": float(entropy.mean().clamp(0, 1)),
        "load/entropy_norm_min": float(entropy.min().clamp(0, 1)),
        "load/max_violation": float(violation.mean()),
        "load/max_violation_max": float(violation.max()),
        "load/cv": float(cv.mean()),
        "load/dead_expert_frac": float((load == 0).double().mean()),
    }


def route_diagnostics(
    routes: Routes,
    mask: Tensor,
    budget: float,
    *,
    logp_train: Tensor | None = None,
    logp_rollout: Tensor | None = None,
    fisher_scores: Tensor | None = None,
    fisher_fallback: bool = False,
    extreme_threshold: float = 2.0,
) -> dict[str, float]:
    """Every ``replay/``, ``routing/``, ``load/`` key, and ``mismatch/`` when log-probs are given.

    Log-probs are per token, ``[tokens]``, aligned with ``routes.valid``.
    """
    record = replay_metrics(routes, mask, budget, fisher_scores=fisher_scores, fisher_fallback=fisher_fallback)
    record.update(routing_metrics(routes, mask))
    record.update(load_metrics(expert_load(routes, mask)))
    if logp_train is not None and logp_rollout is not None:
        record.update(mismatch_metrics(logp_train, logp_rollout, routes.valid, extreme_threshold=extreme_threshold))
    return record
