"""Per-(layer, expert) Fisher estimate from per-token squared gradients.

``F[l, e]`` estimates the expected squared gradient of the training objective with respect to
the parameters (or activations) of expert ``e`` in layer ``l``. It is built from *per-token*
squared gradients: the square of a batch gradient would let tokens cancel each other and
measure agreement, not sensitivity. Three estimators give the per-token quantity
``g2[t, l, e]`` (formulas in docs/fisher.md):

- ``router_logits``: ``(dL/dz[t, l, e])^2`` for router logit ``z``; every token counts for
  every expert of its layer.
- ``expert_outputs``: ``||dL/do[t, l, e]||^2`` for the output ``o`` of expert ``e`` on token
  ``t``; counts only the tokens routed to ``e``.
- ``expert_params``: ``||dL/dW_e||^2`` restricted to token ``t``, exact for an expert made of
  linear maps: a linear map ``y = W x`` gives per-token ``||dL/dy||^2 * ||x||^2`` (the
  "ghost norm"), summed over the expert's maps; counts only routed tokens.

The tracker sums ``g2`` and token counts within a step, turns them into a per-step mean at
:meth:`FisherTracker.step`, and smooths the means across steps with an exponential moving
average. A policy reads the estimate of the *previous* step: the mask must exist before the
training forward pass that produces this step's gradients.

A non-finite per-token square (an overflow, a NaN from a broken backward) would make its
(layer, expert) entry NaN for good, and the ``fisher`` policy would then rank by noise. The
tracker skips such contributions, counts them (:attr:`FisherTracker.nonfinite_last_step`, logged
as ``replay/fisher_nonfinite``) and warns when a step had any.
"""

from __future__ import annotations

import logging
import numbers
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ablate import config
from ablate.routes import Routes, token_chunks

Estimator = Literal["router_logits", "expert_outputs", "expert_params"]
Normalization = Literal["none", "layer", "global"]
#: The choices, from the config schema's enums (their one definition).
ESTIMATORS: tuple[str, ...] = tuple(choice.value for choice in config.Estimator)
NORMALIZATIONS: tuple[str, ...] = tuple(choice.value for choice in config.Normalization)

log = logging.getLogger(__name__)


class FisherError(ValueError):
    """A Fisher tracker setting or input outside what the estimate can use."""


def check_tracker_settings(*, decay: object = 0.9, normalize: object = "none") -> tuple[float, str]:
    """``(decay, normalize)`` checked, or a :class:`FisherError` naming the bad value.

    Call it wherever the settings arrive (a config, a checkpoint) so a bad value fails before any
    work starts.
    """
    if not config.is_ema_decay(decay):
        raise FisherError(f"decay={decay!r} in the Fisher tracker: expected {config.EMA_DECAY}")
    if normalize not in NORMALIZATIONS:
        raise FisherError(f"normalize={normalize!r} in the Fisher tracker: expected one of {', '.join(NORMALIZATIONS)}")
    return float(decay), str(normalize)


class FisherTracker:
    """Accumulates per-token squared gradients into a smoothed ``[layers, experts]`` estimate.

    Args:
        num_layers: the estimate's rows, one per MoE layer.
        num_experts: the estimate's columns, one per expert.
        decay: EMA decay across steps, in [0, 1). 0 keeps only the latest step. The EMA is
            bias-corrected per entry (as in Adam), so early steps are not pulled towards zero.
        normalize: how :meth:`scores` rescales the estimate: ``"none"``; ``"layer"`` (each layer
            sums to 1, so every layer competes equally for the budget); ``"global"`` (the whole
            estimate sums to 1; layers with larger gradients win more routes).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        *,
        decay: float = 0.9,
        normalize: Normalization = "none",
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise FisherError(f"{name}={value!r} in the Fisher tracker: expected a positive integer")
        self.decay, self.normalize = check_tracker_settings(decay=decay, normalize=normalize)
        shape = (num_layers, num_experts)
        self._sums = torch.zeros(shape, dtype=torch.float64, device=device)
        self._counts = torch.zeros(shape, dtype=torch.float64, device=device)
        self._ema = torch.zeros(shape, dtype=torch.float64, device=device)
        self._updates = torch.zeros(shape, dtype=torch.long, device=device)
        self._nonfinite = torch.zeros((), dtype=torch.float64, device=device)
        self.steps = 0
        #: Whether some entry has an estimate, and the scores of the estimate: kept on the host side
        #: between steps, so that a policy reading them per micro-batch never reads the device.
        self._has_estimate = False
        self._scores: tuple[str, Tensor] | None = None
        #: Non-finite contributions skipped in the last closed step, and since the tracker began.
        self.nonfinite_last_step = 0
        self.nonfinite_total = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self._ema.shape)  # type: ignore[return-value]

    @property
    def has_estimate(self) -> bool:
        """True once at least one step with gradient information has been closed."""
        return self._has_estimate

    def accumulate(self, sq_grads: Tensor, weights: Tensor) -> None:
        """Add one micro-batch of per-token squared gradients.

        Args:
            sq_grads: ``[tokens, layers, experts]`` per-token squared gradients.
            weights: broadcastable to ``sq_grads``: which tokens count for which (layer, expert),
                e.g. ``valid[:, None, None]`` for router logits, or the routed-to indicator
                ``[tokens, layers, experts]`` for expert estimators. Non-negative; 1 per token.

        A contribution (an entry with a nonzero weight) whose square is NaN or infinite is skipped
        and counted; its token does not count for that (layer, expert) either.
        """
        if sq_grads.dim() != 3 or tuple(sq_grads.shape[1:]) != self.shape:
            raise FisherError(
                f"sq_grads has shape {tuple(sq_grads.shape)}: expected [tokens, layers, experts] with "
                f"[layers, experts]={self.shape}"
            )
        weights = weights.to(device=self._sums.device, dtype=torch.float64)
        if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
            raise FisherError("weights of the Fisher tracker hold a negative or non-finite value: expected counts >= 0")
        sq = sq_grads.detach().to(device=self._sums.device, dtype=torch.float64)
        weights = weights.expand_as(sq)
        broken = ~torch.isfinite(sq)
        if bool(broken.any()):  # the rare path: full-size masked copies only when needed
            sq = sq.masked_fill(broken, 0.0)  # also where the weight is 0: NaN * 0 is NaN
            broken &= weights != 0
            self._nonfinite += broken.sum()
            weights = weights.masked_fill(broken, 0.0)
        self._sums += (sq * weights).sum(0)
        self._counts += weights.sum(0)

    def add_sums(self, sums: Tensor, counts: Tensor, skipped: int = 0) -> None:
        """Add per-(layer, expert) sums of finite per-token squared gradients, their token counts, and how
        many non-finite ones the caller skipped: what :meth:`accumulate` adds, summed already (the replay
        hook sums them over micro-batches and ranks)."""
        self._sums += sums.to(self._sums)
        self._counts += counts.to(self._counts)
        self._nonfinite += skipped

    def step(self) -> None:
        """Close the current step: fold its per-token mean into the EMA, then reset the sums.

        Entries that saw no token this step keep their previous estimate instead of decaying
        towards zero: an expert nobody routed to has no new evidence, not evidence of zero.
        """
        self.nonfinite_last_step = int(self._nonfinite.tolist())  # once per step
        self.nonfinite_total += self.nonfinite_last_step
        self._nonfinite.zero_()
        if self.nonfinite_last_step:
            log.warning(
                "Fisher tracker step %d skipped %d non-finite per-token squared gradients (%d so far): the estimate "
                "uses the finite ones", self.steps, self.nonfinite_last_step, self.nonfinite_total,
            )
        seen = self._counts > 0
        mean = torch.where(seen, self._sums / self._counts.clamp(min=1), torch.zeros_like(self._sums))
        self._ema = torch.where(seen, self.decay * self._ema + (1 - self.decay) * mean, self._ema)
        self._updates += seen.long()
        self._sums.zero_()
        self._counts.zero_()
        self.steps += 1
        self._has_estimate = bool((self._updates > 0).any().tolist())
        self._scores = None

    def estimate(self) -> Tensor:
        """Bias-corrected EMA ``[layers, experts]`` (float32), zero where nothing was seen yet."""
        correction = 1 - self.decay ** self._updates.double()
        return torch.where(self._updates > 0, self._ema / correction.clamp(min=1e-300), torch.zeros_like(self._ema)).float()

    def scores(self) -> Tensor:
        """The estimate, normalised as configured: what the ``fisher`` policy ranks by.

        The same tensor until the next :meth:`step` (read-only): its readers may key what they
        derive of it by the tensor itself.
        """
        if self._scores is None or self._scores[0] != self.normalize:
            self._scores = (self.normalize, self._normalized())
        return self._scores[1]

    def _normalized(self) -> Tensor:
        estimate = self.estimate()
        if self.normalize == "layer":
            return estimate / estimate.sum(1, keepdim=True).clamp(min=torch.finfo(estimate.dtype).tiny)
        if self.normalize == "global":
            return estimate / estimate.sum().clamp(min=torch.finfo(estimate.dtype).tiny)
        return estimate

    def state_dict(self) -> dict[str, object]:
        return {
            "decay": self.decay,
            "normalize": self.normalize,
            "steps": self.steps,
            "sums": self._sums.clone(),
            "counts": self._counts.clone(),
            "ema": self._ema.clone(),
            "updates": self._updates.clone(),
            "nonfinite_total": self.nonfinite_total,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        ema = state["ema"]
        assert isinstance(ema, Tensor)
        if tuple(ema.shape) != self.shape:
            raise FisherError(f"Fisher state has shape {tuple(ema.shape)}: expected [layers, experts]={self.shape}")
        self.decay, self.normalize = check_tracker_settings(decay=state["decay"], normalize=state["normalize"])
        self.steps = int(state["steps"])  # type: ignore[arg-type]
        self.nonfinite_total = int(state.get("nonfinite_total", 0))  # type: ignore[arg-type]
        device = self._ema.device
        self._sums = state["sums"].to(device)  # type: ignore[union-attr]
        self._counts = state["counts"].to(device)  # type: ignore[union-attr]
        self._ema = ema.to(device)
        self._updates = state["updates"].to(device)  # type: ignore[union-attr]
        self._has_estimate = bool((self._updates > 0).any())
        self._scores = None


class GradientCapture:
    """Keeps the gradients of chosen activations during ``backward`` via tensor hooks.

    Usage inside a forward pass: ``logits = capture.watch(layer, logits)``; after
    ``loss.backward()``, ``capture.stacked()`` gives ``[tokens, layers, ...]`` gradients.
    Hooks cost one extra reference per tensor and no extra backward pass.
    """

    def __init__(self) -> None:
        self.grads: dict[int, Tensor] = {}

    def watch(self, layer: int, tensor: Tensor) -> Tensor:
        if tensor.requires_grad:
            tensor.register_hook(lambda grad, layer=layer: self._keep(layer, grad))
        return tensor

    def _keep(self, layer: int, grad: Tensor) -> None:
        # A tensor used twice gets two hook calls; their sum is the full gradient.
        self.grads[layer] = grad.detach() + self.grads[layer] if layer in self.grads else grad.detach()

    def stacked(self) -> Tensor:
        if not self.grads:
            raise RuntimeError("no gradient was captured: call watch() in the forward pass and backward() first")
        return torch.stack([self.grads[layer] for layer in sorted(self.grads)], dim=1)

    def clear(self) -> None:
        self.grads.clear()


def router_logit_sq_grads(logit_grads: Tensor) -> Tensor:
    """``router_logits`` estimator: ``[tokens, layers, experts]`` squared router-logit gradients."""
    return logit_grads.float().square()


def expert_output_sq_grads(output_grads: Tensor) -> Tensor:
    """``expert_outputs`` estimator from ``[tokens, layers, experts, hidden]`` output gradients."""
    return output_grads.float().square().sum(-1)


def linear_param_sq_grads(inputs: Tensor, output_grads: Tensor, *, bias: bool = False) -> Tensor:
    """Per-token ``||dL/dW||^2`` of a linear map ``y = W x (+ b)`` from its input and output grad.

    ``dL/dW`` restricted to token t is the outer product ``dL/dy_t x_t^T``, whose squared
    Frobenius norm is ``||dL/dy_t||^2 ||x_t||^2``; a bias adds ``||dL/dy_t||^2``. Shapes are
    ``[..., in]`` and ``[..., out]``; the result drops the last dimension. Sum it over an
    expert's linear maps for the ``expert_params`` estimator.
    """
    grad_sq = output_grads.float().square().sum(-1)
    return grad_sq * (inputs.float().square().sum(-1) + float(bias))


#: Where :func:`route_scores` keeps its last scores on a :class:`Routes` (with the estimate they are of).
_SCORES_KEY = "_route_scores"


def route_scores(estimate: Tensor, routes: Routes) -> Tensor:
    """``[tokens, layers]`` Fisher score of each rollout route: ``sum_{e in route} F[l, e]``. Read-only.

    Kept on ``routes`` for the estimate they are of (compared by value), so that the ``fisher``
    policy and the diagnostics of the same routes score them once (:meth:`Routes.with_native`
    keeps them too): the scores are a full pass over the routes.
    """
    expected = (routes.num_layers, routes.num_experts)
    if tuple(estimate.shape) != expected:
        raise FisherError(f"Fisher estimate has shape {tuple(estimate.shape)}: expected [layers, experts]={expected}")
    # One holder per batch of rollout routes, shared with the routes :meth:`Routes.with_native` makes of
    # them (a cached_property's way onto a frozen dataclass): what one of them scores, all of them keep.
    kept = routes.__dict__.setdefault(_SCORES_KEY, {})
    if kept:
        tensor, version, values, score = kept["scores"]
        # The same tensor, unchanged (every in-place change bumps its version): known without reading
        # the device. Another tensor: compared by value (a tracker hands out one tensor per step).
        if (tensor is estimate and version == estimate._version) or (
                values.device == estimate.device and torch.equal(values, estimate)):
            kept["scores"] = (estimate, estimate._version, values, score)
            return score
    score = _route_scores(estimate, routes)
    kept["scores"] = (estimate, estimate._version, estimate.clone(), score)
    return score
    score = _route_scores(estimate, routes)
    routes.__dict__[_SCORES_KEY] = (estimate, estimate._version, estimate.clone(), score)  # a cached_property's way
    return score


def _route_scores(estimate: Tensor, routes: Routes) -> Tensor:
    table = estimate.to(device=routes.device, dtype=torch.float32).reshape(-1, 1)
    # One bag of k (layer, expert) rows per route: embedding_bag sums the k scores in one fused
    # gather, over chunks of tokens, instead of k full-size int64 index tensors and gathers.
    # Each slot's layer offset, spelled out for every slot ([layers, topk], not [layers, 1]): the add
    # then broadcasts over tokens only, in runs of layers * topk ids rather than topk.
    layer_base = (torch.arange(routes.num_layers, device=routes.device, dtype=torch.int32) * routes.num_experts)[:, None]
    layer_base = layer_base.expand(routes.num_layers, routes.topk).contiguous()
    # Invalid tokens score 0, and padding may hold any id. When most tokens are valid, scoring
    # every token over contiguous slices (padding ids clamped into range, their scores zeroed
    # after) is cheaper than gathering the valid rows out and scattering their scores back.
    valid_count = routes.num_valid_tokens
    every_row = 2 * valid_count >= routes.num_tokens
    padded = every_row and valid_count < routes.num_tokens  # rows of padding are scored, then zeroed
    chunks = token_chunks(routes.num_tokens if every_row else routes.valid, routes.num_layers * routes.topk)

    def scored(rows) -> Tensor:
        ids = routes.rollout[rows].to(torch.int32, copy=True)  # converted alone: a mixed-type add is slower
        if padded:
            ids.clamp_(0, routes.num_experts - 1)
        bags = ids.add_(layer_base).reshape(-1, routes.topk)
        return F.embedding_bag(bags, table, mode="sum").reshape(-1, routes.num_layers)

    if every_row and len(chunks) == 1:  # one chunk of every token (a verl micro-batch): its scores are the result
        score = scored(chunks[0])
    else:
        score = torch.zeros(routes.num_tokens, routes.num_layers, device=routes.device)
        for rows in chunks:
            score[rows] = scored(rows)
    if padded:
        score.masked_fill_(~routes.valid[:, None], 0.0)
    return score
