"""Pure functions from tensors to the schema's ``replay/``, ``routing/``, ``mismatch/``, ``load/`` keys.

They run on the device of their inputs and never build a ``[tokens, layers, topk, topk]`` or
``[tokens, layers, topk, experts]`` tensor: a Qwen3-30B-A3B batch of 262,144 tokens has 100M
expert ids, and the diagnostics must cost a few passes over them, not a multiple of their size.
Undefined values (a recall with no mismatched route) are NaN, as the schema allows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ablate.fisher import route_scores
from ablate.routes import RouteDifferences, Routes, token_chunks

NAN = float("nan")


def _ratio(numerator: Tensor | float, denominator: Tensor | float) -> float:
    denominator = float(denominator)
    return float(numerator) / denominator if denominator else NAN


#: Additive counts of a batch from which every ``replay/`` and ``routing/`` key follows. Summed
#: over micro-batches and ranks (each route counted once), they give the keys of a whole step.
#: ``compared_*`` count the valid routes and tokens whose native routes are known.
#: ``unrecorded_routes`` is always 0 for :class:`Routes`, which hold recorded routes only; a
#: backend that receives routes the rollout never recorded (verl) adds them to the sum.
ROUTE_COUNTS = (
    "valid_routes", "replayed_routes", "unrecorded_routes", "compared_routes", "compared_tokens",
    "compared_replayed", "overridden_routes", "mismatched_routes", "mismatched_tokens", "mismatched_replayed",
    "shared_experts", "fisher_mass", "fisher_total",
)


def route_counts(routes: Routes, mask: Tensor, *, fisher_scores: Tensor | None = None,
                 used: Tensor | None = None) -> dict[str, float]:
    """The :data:`ROUTE_COUNTS` of one batch and replay mask ``[tokens, layers]``.

    ``fisher_mass`` and ``fisher_total`` are the Fisher route scores (``sum_{e in route} F[l, e]``)
    of the replayed and of all valid routes; 0 without ``fisher_scores``.

    ``used`` ``[tokens, layers, topk]`` are the experts the forward used where a replayed route is
    not simply the rollout's (a replay variant, docs/policies.md): the trainer's own recorded
    routes (R2) or the routes a score gate left (``threshold``). Then a replayed route is
    *overridden* where ``used`` differs from the native route, a mismatched route counts as
    replayed (restored) only where ``used`` is the rollout's, and the Fisher mass is that of ``used``.
    """
    return dict(zip(ROUTE_COUNTS, route_count_tensor(routes, mask, fisher_scores=fisher_scores, used=used).tolist()))


def route_count_tensor(routes: Routes, mask: Tensor, *, fisher_scores: Tensor | None = None,
                       observed: Tensor | None = None, used: Tensor | None = None) -> Tensor:
    """:func:`route_counts` as a float64 ``[len(ROUTE_COUNTS)]`` tensor on the routes' device, read nowhere.

    A caller that adds up many batches (the replay hook, every micro-batch of a step) keeps the sum
    on the device and reads it once. The one read of the device left is the sparse set of routes
    that differ from their native route (:attr:`Routes.native_differences`), a ``nonzero``.
    ``observed`` (a bool scalar): whether the native route of every valid route is known; where it
    is False, the ``routing/`` counts are left out rather than compared against a made-up route.
    """
    host = routes.host
    every_token = host is not None and sum(host.valid_counts) == routes.num_tokens
    mask = mask if every_token else mask & routes.valid[:, None]
    device = routes.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    valid_routes = (torch.tensor(float(routes.num_valid_routes), dtype=torch.float64, device=device) if host is not None
                    else routes.valid.sum(dtype=torch.float64) * routes.num_layers)
    replayed = mask.sum(dtype=torch.float64)
    counts = dict.fromkeys(ROUTE_COUNTS, zero)
    counts.update(valid_routes=valid_routes, replayed_routes=replayed)
    differences = routes.native_differences
    if differences is not None:
        valid_tokens = valid_routes / routes.num_layers
        compared = {"compared_routes": valid_routes, "compared_tokens": valid_tokens, "compared_replayed": replayed,
                    **_mismatch_counts(routes, mask, differences, every_token, valid_routes)}
        if used is not None:
            compared.update(_applied_counts(routes, mask, used))
        if observed is not None:
            compared = {key: value * observed for key, value in compared.items()}
        counts.update(compared)
    if fisher_scores is not None:
        scored = routes if used is None else Routes(used, routes.valid, routes.num_experts, ids_checked=True)
        score = route_scores(fisher_scores, scored)  # 0 on invalid tokens; read-only (kept on routes)
        counts["fisher_total"] = score.sum(dtype=torch.float64)
        counts["fisher_mass"] = torch.where(mask, score, 0.0).sum(dtype=torch.float64)
    return torch.stack([counts[key] for key in ROUTE_COUNTS])


def _mismatch_counts(routes: Routes, mask: Tensor, differences: RouteDifferences, every_token: bool,
                     valid_routes: Tensor) -> dict[str, Tensor]:
    """The mismatch counts of the valid routes, read from the few routes that differ from their native route.

    Every route not in ``differences`` shares all ``topk`` experts: it is neither mismatched nor
    overridden, and adds ``topk`` shared experts. Counted with weights, never by selecting the
    mismatched entries (a boolean index would read their number back from the device).
    """
    topk, layers = routes.topk, routes.num_layers
    index, overlap = differences.index.long(), differences.overlap
    tokens = index.div(layers, rounding_mode="floor")
    mismatched = overlap < topk
    if not every_token:
        mismatched &= routes.valid[tokens]
    overridden = (mask.reshape(-1)[index] & mismatched).sum(dtype=torch.float64)
    # A token with any mismatched route: its flag set by the largest of its entries' flags.
    flags = torch.zeros(routes.num_tokens, dtype=torch.uint8, device=index.device)
    flags.scatter_reduce_(0, tokens, mismatched.to(torch.uint8), reduce="amax")
    missing = torch.where(mismatched, topk - overlap, 0).sum(dtype=torch.float64)  # experts the mismatches do not share
    return {
        "overridden_routes": overridden,
        "mismatched_routes": mismatched.sum(dtype=torch.float64),
        "mismatched_tokens": flags.sum(dtype=torch.float64),
        "mismatched_replayed": overridden,
        "shared_experts": valid_routes * topk - missing,
    }


def _applied_counts(routes: Routes, mask: Tensor, used: Tensor) -> dict[str, Tensor]:
    """What replay changed where the routes used are not the rollout's: overridden and restored routes."""
    assert routes.native is not None
    used = used.sort(-1).values
    changed = (used != routes.native.sort(-1).values).any(-1) & mask
    rollout = routes.rollout.sort(-1).values
    mismatched = (rollout != routes.native.sort(-1).values).any(-1)
    restored = mismatched & mask & (used == rollout).all(-1)
    valid = routes.valid[:, None]
    return {"overridden_routes": (changed & valid).sum(dtype=torch.float64),
            "mismatched_replayed": (restored & valid).sum(dtype=torch.float64)}


def metrics_from_counts(
    counts: dict[str, float],
    budget: float,
    topk: int,
    *,
    fisher_fallback: bool = False,
    fisher_nonfinite: int | None = None,
    replaced_slots: float = 0.0,
) -> dict[str, float]:
    """Every ``replay/`` and ``routing/`` key from (summed) :data:`ROUTE_COUNTS`.

    - ``replay/override_rate``: overridden / replayed routes with native routes known.
    - ``replay/effective_budget``: overridden / valid routes with native routes known, the share
      of valid routes that replay actually changed (``budget_realized x override_rate``; 0 when
      nothing is replayed). NaN without native routes.
    - ``replay/replace_rate``: ``replaced_slots`` (replayed experts a score gate handed back) / the
      replayed routes' ``topk`` slots; NaN when nothing is replayed.
    - ``replay/fisher_mass``: Fisher score of the replayed routes / of all valid routes.
    - ``replay/fisher_nonfinite``: the Fisher tracker's skipped non-finite contributions
      (:attr:`ablate.FisherTracker.nonfinite_last_step`); NaN when no tracker is given.
    - ``routing/*``: rollout against native routes, over the routes whose native routes are known.
    """
    c = counts
    compared, mismatched = c["compared_routes"], c["mismatched_routes"]
    return {
        "replay/budget_requested": float(budget),
        "replay/budget_realized": _ratio(c["replayed_routes"], c["valid_routes"]),
        "replay/valid_routes": float(c["valid_routes"]),
        "replay/replayed_routes": float(c["replayed_routes"]),
        "replay/unrecorded_routes": float(c["unrecorded_routes"]),
        "replay/override_rate": _ratio(c["overridden_routes"], c["compared_replayed"]),
        "replay/effective_budget": _ratio(c["overridden_routes"], compared),
        "replay/replace_rate": _ratio(replaced_slots, c["replayed_routes"] * topk),
        "replay/fisher_mass": _ratio(c["fisher_mass"], c["fisher_total"]),
        "replay/fisher_fallback": float(bool(fisher_fallback)),
        "replay/fisher_nonfinite": NAN if fisher_nonfinite is None else float(fisher_nonfinite),
        "routing/route_mismatch_rate": _ratio(mismatched, compared),
        "routing/token_mismatch_rate": _ratio(c["mismatched_tokens"], c["compared_tokens"]),
        "routing/topk_overlap": _ratio(c["shared_experts"], compared * topk),
        "routing/mismatch_recall": _ratio(c["mismatched_replayed"], mismatched),
        "routing/residual_mismatch_rate": _ratio(mismatched - c["mismatched_replayed"], compared),
    }


def replay_metrics(
    routes: Routes,
    mask: Tensor,
    budget: float,
    *,
    fisher_scores: Tensor | None = None,
    fisher_fallback: bool = False,
    fisher_nonfinite: int | None = None,
) -> dict[str, float]:
    """``replay/`` keys for one replay mask ``[tokens, layers]`` (see :func:`metrics_from_counts`)."""
    counts = route_counts(routes, mask, fisher_scores=fisher_scores)
    metrics = metrics_from_counts(
        counts, budget, routes.topk, fisher_fallback=fisher_fallback, fisher_nonfinite=fisher_nonfinite
    )
    return _section("replay", metrics)


def routing_metrics(routes: Routes, mask: Tensor) -> dict[str, float]:
    """``routing/`` keys: rollout versus native routes, and what the mask did about them.

    All NaN when the routes carry no native routes (nothing to compare against).
    """
    return _section("routing", metrics_from_counts(route_counts(routes, mask), NAN, routes.topk))


def _section(section: str, metrics: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if key.startswith(section + "/")}


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
    fisher_nonfinite: int | None = None,
    extreme_threshold: float = 2.0,
) -> dict[str, float]:
    """Every ``replay/``, ``routing/``, ``load/`` key, and ``mismatch/`` when log-probs are given.

    Log-probs are per token, ``[tokens]``, aligned with ``routes.valid``.
    """
    # One pass of route_counts serves both the replay/ and routing/ sections.
    counts = route_counts(routes, mask, fisher_scores=fisher_scores)
    record = metrics_from_counts(
        counts, budget, routes.topk, fisher_fallback=fisher_fallback, fisher_nonfinite=fisher_nonfinite
    )
    record.update(load_metrics(expert_load(routes, mask)))
    if logp_train is not None and logp_rollout is not None:
        record.update(mismatch_metrics(logp_train, logp_rollout, routes.valid, extreme_threshold=extreme_threshold))
    return record
