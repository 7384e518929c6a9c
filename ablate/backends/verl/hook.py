"""Per-(token, layer) replay masks inside verl's R3, without editing verl.

verl 0.9.1 replays rollout routes in ``MegatronEngineWithLMHead.forward_step``: it builds one
per-token mask with ``build_r3_replay_mask`` and hands routes and mask to every router with
``set_router_replay_data``, which packs them (THD, context-parallel zigzag, sequence-parallel
scatter) and maps global layer ids to the local routers of the pipeline stage. The routers apply
``torch.where(mask, replayed, native)`` in ``RouterReplay.get_replay_topk``.

The hook swaps the two names inside ``transformer_impl``'s namespace only (nothing else in verl
sees a change) and adds three thin wrappers:

- ``set_router_replay_data``: asks the policy for a ``[tokens, layers]`` mask, then appends the
  mask, the valid-token flag and the token's row id as extra columns of the route tensor. verl
  packs that augmented tensor exactly like the routes, so every router receives its own layer's
  mask column already aligned with its rows; ``set_target_indices`` (patched only for the length
  of that call) splits the columns back off. No packing logic is duplicated.
- ``RouterReplay.get_replay_topk``: keeps the native top-k verl computes anyway for a masked
  replay, for the ``routing/`` diagnostics and for the ``mismatch`` policy.
- ``TopKRouter.routing``: registers a gradient hook on the router logits of valid tokens, whose
  per-token squares feed the Fisher tracker.

A mask is chosen per sequence (routes of one sequence, the budget counted within it, a generator
seeded from the run seed and the sequence's routes). The old-log-prob pass and every update pass
therefore replay exactly the same routes whatever the micro-batching, which keeps the PPO ratio
free of mask noise, and every policy replays the same number of routes per sequence.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ablate.budget import FIXED_BUDGETS
from ablate.fisher import FisherTracker
from ablate.policies import get_policy, route_scores
from ablate.routes import Routes, overlap_count

#: extra columns appended to each route: replay mask, valid token, row id + 1 (0 marks padding).
EXTRA_COLUMNS = 3
#: tracker settings that are not policy settings.
TRACKER_SETTINGS = ("decay", "normalize")

_COUNTERS = (
    "sequences",
    "valid_routes",
    "replayed_routes",
    "fisher_mass",
    "fisher_total",
    "fisher_fallback",
    "compared_routes",
    "mismatched_routes",
    "overlap",
    "compared_replayed",
    "overridden_routes",
    "residual_routes",
    "compared_tokens",
    "mismatched_tokens",
    "native_pending",
)


@dataclass
class _MicroBatch:
    """What the routers of one forward need to report back (rows are unpadded batch rows)."""

    num_rows: int
    num_layers: int
    topk: int
    offsets: Tensor
    keys: list[str]
    native: Tensor | None
    token_mismatch: Tensor
    token_compared: Tensor


@dataclass
class ReplayMaskHook:
    """Chooses per-(token, layer) replay masks for verl's R3 and measures what replay changed.

    Args:
        policy: a registered policy name (``random``, ``uniform``, ``fisher``, ``mismatch``, ...).
        budget: fraction of each sequence's valid routes to replay (``None`` for ``none``/``full``).
        seed: run seed; with a sequence's routes it seeds that sequence's generator.
        settings: policy settings; ``decay``/``normalize`` go to the Fisher tracker instead.
    """

    policy: str
    budget: float | None
    seed: int
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy in FIXED_BUDGETS and self.budget is None:
            self.budget = FIXED_BUDGETS[self.policy]
        self.tracker: FisherTracker | None = None
        self._policy = None
        self.phase = "update"
        self._updated_since_step = False
        self._native_cache: dict[str, Tensor] = {}
        self._micro: _MicroBatch | None = None
        self._fisher_sums: Tensor | None = None
        self._fisher_counts: Tensor | None = None
        self.reset_counters()

    # ----------------------------------------------------------------------------- selection
    def build_policy(self, num_layers: int, num_experts: int):
        if self._policy is None:
            settings = {k: v for k, v in self.settings.items() if k not in TRACKER_SETTINGS}
            if self.policy == "fisher":
                tracker_settings = {k: v for k, v in self.settings.items() if k in TRACKER_SETTINGS}
                self.tracker = FisherTracker(num_layers, num_experts, **tracker_settings)
                settings["fisher"] = self.tracker
            self._policy = get_policy(self.policy, **settings)
        return self._policy

    def sequence_key(self, routes: Tensor) -> str:
        return hashlib.blake2b(routes.detach().to("cpu", torch.int16).contiguous().numpy().tobytes(), digest_size=16).hexdigest()

    def select(self, rollout: Tensor, valid: Tensor, offsets: Tensor, num_experts: int) -> tuple[Tensor, list[str]]:
        """``[tokens, layers]`` mask for the flattened sequences ``rollout[offsets[i]:offsets[i+1]]``."""
        policy = self.build_policy(rollout.shape[1], num_experts)
        rollout_cpu, valid_cpu = rollout.detach().to("cpu", torch.int64), valid.detach().to("cpu", torch.bool)
        mask = torch.zeros(rollout.shape[:2], dtype=torch.bool)
        keys = []
        bounds = offsets.tolist()
        scores = self.tracker.scores() if self.tracker is not None and self.tracker.has_estimate else None
        for start, end in zip(bounds[:-1], bounds[1:]):
            key = self.sequence_key(rollout_cpu[start:end])
            keys.append(key)
            seq_valid = valid_cpu[start:end]
            if not bool(seq_valid.any()):
                continue
            native = self._native_cache.get(key)
            if self.policy == "mismatch" and native is None:
                # The first forward of a sequence (the old-log-prob pass) routes it natively and
                # records the native routes; later passes select on them (see README).
                self.counters["native_pending"] += 1
                self._count_mask(mask[start:end], seq_valid, rollout.shape[1], None, None)
                continue
            routes = Routes(rollout=rollout_cpu[start:end], valid=seq_valid, num_experts=num_experts, native=native)
            seed = int(hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).hexdigest(), 16) % (2**63)
            generator = torch.Generator().manual_seed(seed)
            seq_mask = policy.select(routes, self.budget, generator=generator)
            mask[start:end] = seq_mask
            self.counters["fisher_fallback"] += float(policy.info.get("fisher_fallback", 0.0))
            self._count_mask(seq_mask, seq_valid, rollout.shape[1], scores, routes)
        return mask.to(rollout.device), keys

    def _count_mask(self, mask: Tensor, valid: Tensor, num_layers: int, scores: Tensor | None, routes: Routes | None) -> None:
        c = self.counters
        c["sequences"] += 1
        c["valid_routes"] += float(valid.sum()) * num_layers
        c["replayed_routes"] += float(mask.sum())
        if scores is not None and routes is not None:
            per_route = route_scores(scores, routes)
            c["fisher_mass"] += float(per_route[mask].sum())
            c["fisher_total"] += float(per_route[routes.valid_routes()].sum())

    # ------------------------------------------------------------------ verl-facing wrappers
    def set_router_replay_data(self, original, layers_topk_idx, attention_mask, tf_config, vp_rank=None, replay_mask=None, local_cp_size=None, model=None):
        if replay_mask is None or not getattr(layers_topk_idx, "is_nested", False):
            # R2 or BSHD input: verl's own path, unchanged.
            return original(layers_topk_idx, attention_mask, tf_config, vp_rank, replay_mask=replay_mask, local_cp_size=local_cp_size, model=model)
        rollout, offsets = layers_topk_idx.values(), layers_topk_idx.offsets()
        valid = replay_mask.values().bool()
        rows, layers, topk = rollout.shape
        mask, keys = self.select(rollout, valid, offsets, int(tf_config.num_moe_experts))
        augmented = augment_routes(rollout, mask, valid)
        packed = torch.nested.nested_tensor_from_jagged(augmented, offsets=offsets)
        self._tag_router_layers(model, tf_config, layers)
        self._flush_micro_batch()
        needs_native = self.policy == "mismatch"
        self._micro = _MicroBatch(
            num_rows=rows,
            num_layers=layers,
            topk=topk,
            offsets=offsets.cpu(),
            keys=keys,
            native=torch.zeros(rows, layers, topk, dtype=torch.int32, device=rollout.device) if needs_native else None,
            token_mismatch=torch.zeros(rows, dtype=torch.bool, device=rollout.device),
            token_compared=torch.zeros(rows, dtype=torch.bool, device=rollout.device),
        )
        with split_augmented_targets(topk):
            original(packed, attention_mask, tf_config, vp_rank, replay_mask=None, local_cp_size=local_cp_size, model=model)

    def _tag_router_layers(self, model, tf_config, route_layers: int) -> None:
        from verl.utils.megatron.router_replay_utils import is_moe_layer, iter_model_routers

        if model is None:
            return
        by_layer = route_layers == tf_config.num_layers
        for layer_number, router in iter_model_routers(model):
            index = layer_number - 1
            router._ablate_layer = index if by_layer else sum(1 for i in range(index) if is_moe_layer(tf_config, i))

    def observe(self, replay, native: Tensor) -> None:
        """Called by a router in REPLAY_FORWARD with its native top-k for the current micro-batch."""
        mask = replay.target_replay_mask
        extra = getattr(mask, "_ablate", None)
        if extra is None or self._micro is None:
            return
        valid, rows = extra
        target = replay.target_topk_idx.to(native.device)
        mask = mask.to(native.device).bool()
        valid = valid.to(native.device)
        overlap = overlap_count(target[:, None, :], native[:, None, :])[:, 0]
        topk = target.shape[-1]
        mismatched = overlap < topk
        c = self.counters
        c["compared_routes"] += float(valid.sum())
        c["mismatched_routes"] += float((valid & mismatched).sum())
        c["overlap"] += float(overlap[valid].sum()) / topk
        c["compared_replayed"] += float((valid & mask).sum())
        c["overridden_routes"] += float((valid & mask & mismatched).sum())
        c["residual_routes"] += float((valid & ~mask & mismatched).sum())
        local_rows = rows[valid].to(self._micro.token_mismatch.device)
        self._micro.token_compared[local_rows] = True
        self._micro.token_mismatch[local_rows] |= mismatched[valid].to(self._micro.token_mismatch.device)
        layer = getattr(replay, "_ablate_layer", None)
        if self._micro.native is not None and layer is not None:
            self._micro.native[local_rows, layer] = native[valid].to(torch.int32) + 1

    def add_fisher(self, layer: int, logit_grads: Tensor, valid: Tensor, num_layers: int) -> None:
        grads = logit_grads.detach().reshape(-1, logit_grads.shape[-1])
        valid = valid.to(grads.device)
        if self._fisher_sums is None:
            shape = (num_layers, grads.shape[-1])
            self._fisher_sums = torch.zeros(shape, dtype=torch.float64, device=grads.device)
            self._fisher_counts = torch.zeros(shape, dtype=torch.float64, device=grads.device)
        self._fisher_sums[layer] += grads[valid].double().square().sum(0)
        self._fisher_counts[layer] += float(valid.sum())

    # ------------------------------------------------------------------ per-call bookkeeping
    def reset_counters(self) -> None:
        self.counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)

    def _flush_micro_batch(self) -> None:
        micro, self._micro = self._micro, None
        if micro is None:
            return
        self.counters["compared_tokens"] += float(micro.token_compared.sum())
        self.counters["mismatched_tokens"] += float(micro.token_mismatch.sum())
        if micro.native is None:
            return
        native = _sum_over_model_parallel(micro.native)
        bounds = micro.offsets.tolist()
        for key, start, end in zip(micro.keys, bounds[:-1], bounds[1:]):
            if key not in self._native_cache and bool((native[start:end] > 0).any()):
                # Rows the routers never saw (the final row R3 leaves native) keep id 0.
                self._native_cache[key] = (native[start:end] - 1).clamp(min=0).to("cpu", torch.int64)

    def begin(self, forward_only: bool) -> None:
        """Start of one ``forward_backward_batch`` call."""
        if forward_only and self._updated_since_step:
            self._close_step()
        self.phase = "log_prob" if forward_only else "update"
        self.reset_counters()

    def end(self, forward_only: bool) -> dict[str, float]:
        """End of the call: fold Fisher sums, reduce counters over all ranks, return metrics."""
        self._flush_micro_batch()
        if not forward_only:
            self._updated_since_step = True
            self._fold_fisher()
        return metrics_from_counters(_sum_over_world(self.counters), self.budget)

    def _fold_fisher(self) -> None:
        if self.tracker is None:
            return
        if self._fisher_sums is None:
            sums = torch.zeros(self.tracker.shape, dtype=torch.float64)
            counts = torch.zeros_like(sums)
        else:
            sums, counts = self._fisher_sums, self._fisher_counts
        sums, counts = _sum_tensor_over_world(sums), _sum_tensor_over_world(counts)
        # accumulate() adds (mean * count); passing the mean weighted by its count adds the sums.
        self.tracker.accumulate((sums / counts.clamp(min=1))[None].cpu(), counts[None].cpu())
        self._fisher_sums = self._fisher_counts = None

    def _close_step(self) -> None:
        if self.tracker is not None:
            self.tracker.step()
        self._native_cache.clear()
        self._updated_since_step = False


def augment_routes(rollout: Tensor, mask: Tensor, valid: Tensor) -> Tensor:
    """``[rows, layers, topk + 3]`` int32: routes, then replay mask, valid flag and row id + 1."""
    rows, layers, _ = rollout.shape
    row_ids = torch.arange(1, rows + 1, dtype=torch.int32, device=rollout.device)
    extra = torch.stack(
        [
            mask.to(torch.int32),
            valid.to(torch.int32)[:, None].expand(rows, layers),
            row_ids[:, None].expand(rows, layers),
        ],
        dim=-1,
    )
    return torch.cat([rollout.to(torch.int32), extra], dim=-1)


@contextlib.contextmanager
def split_augmented_targets(topk: int):
    """While verl distributes augmented routes, split each router's columns back apart."""
    from verl.utils.megatron.router_replay_patch import RouterReplay

    original = RouterReplay.set_target_indices

    def set_target_indices(self, topk_indices: Tensor, replay_mask: Tensor | None = None):
        if topk_indices.shape[-1] != topk + EXTRA_COLUMNS:
            raise RuntimeError(
                f"router replay targets have {topk_indices.shape[-1]} columns: expected topk + {EXTRA_COLUMNS} = "
                f"{topk + EXTRA_COLUMNS} from ablate's augmented routes"
            )
        layer_mask = topk_indices[:, topk].bool()
        layer_mask._ablate = (topk_indices[:, topk + 1].bool(), topk_indices[:, topk + 2].long() - 1)
        original(self, topk_indices[:, :topk].contiguous(), replay_mask=layer_mask)

    RouterReplay.set_target_indices = set_target_indices
    try:
        yield
    finally:
        RouterReplay.set_target_indices = original


# ------------------------------------------------------------------------------ installation
_ACTIVE: ReplayMaskHook | None = None
_ORIGINALS: dict[str, Any] = {}


def active_hook() -> ReplayMaskHook | None:
    return _ACTIVE


def install(hook: ReplayMaskHook) -> ReplayMaskHook:
    """Route verl's R3 through ``hook``. Idempotent; :func:`uninstall` restores verl."""
    global _ACTIVE
    from megatron.core.transformer.moe.router import TopKRouter

    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction, apply_router_replay_patch
    from verl.workers.engine.megatron import transformer_impl

    uninstall()
    # verl applies its patch when an R3 engine is built; applying it first lets us wrap the
    # patched routing. verl's later call returns early for an already patched TopKRouter. The
    # check keeps the router registry intact when the model already exists.
    if not getattr(TopKRouter, "_router_replay_patched", False):
        apply_router_replay_patch()
    _ORIGINALS.update(
        set_router_replay_data=transformer_impl.set_router_replay_data,
        get_replay_topk=RouterReplay.get_replay_topk,
        routing=TopKRouter.routing,
        forward_backward_batch=transformer_impl.MegatronEngine.forward_backward_batch,
    )
    original_set = router_replay_utils.set_router_replay_data
    original_topk = RouterReplay.get_replay_topk
    original_routing = TopKRouter.routing
    original_fbb = transformer_impl.MegatronEngine.forward_backward_batch

    def set_router_replay_data(*args, **kwargs):
        return hook.set_router_replay_data(original_set, *args, **kwargs)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or not hasattr(self.target_replay_mask, "_ablate"):
            return original_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
        captured = []

        def compute_native(s, k, num_groups=None, group_topk=None):
            probs, indices = default_compute_topk(s, k, num_groups=num_groups, group_topk=group_topk)
            captured.append(indices)
            return probs, indices

        out = original_topk(self, scores, topk, num_groups, group_topk, compute_native)
        if captured:
            with torch.no_grad():
                hook.observe(self, captured[0])
        return out

    def routing(self, logits, *args, **kwargs):
        replay = getattr(self, "router_replay", None)
        if hook.tracker is not None and replay is not None and torch.is_grad_enabled() and logits.requires_grad:
            pending = _pending_mask(replay, RouterReplayAction)
            extra = getattr(pending, "_ablate", None)
            layer = getattr(replay, "_ablate_layer", None)
            if extra is not None and layer is not None:
                valid = extra[0]
                num_layers = hook.tracker.shape[0]
                logits.register_hook(lambda grad: hook.add_fisher(layer, grad, valid, num_layers))
        return original_routing(self, logits, *args, **kwargs)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        hook.begin(forward_only)
        output = original_fbb(self, data, loss_function, forward_only=forward_only)
        metrics = hook.end(forward_only)
        if not forward_only and isinstance(output, dict) and "metrics" in output:
            for key, value in metrics.items():
                output["metrics"].setdefault(verl_metric_name(key), []).append(value)
        return output

    transformer_impl.set_router_replay_data = set_router_replay_data
    RouterReplay.get_replay_topk = get_replay_topk
    TopKRouter.routing = routing
    transformer_impl.MegatronEngine.forward_backward_batch = forward_backward_batch
    _ACTIVE = hook
    return hook


def uninstall() -> None:
    global _ACTIVE
    if not _ORIGINALS:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    from verl.utils.megatron.router_replay_patch import RouterReplay
    from verl.workers.engine.megatron import transformer_impl

    transformer_impl.set_router_replay_data = _ORIGINALS.pop("set_router_replay_data")
    RouterReplay.get_replay_topk = _ORIGINALS.pop("get_replay_topk")
    TopKRouter.routing = _ORIGINALS.pop("routing")
    transformer_impl.MegatronEngine.forward_backward_batch = _ORIGINALS.pop("forward_backward_batch")
    _ACTIVE = None


def _pending_mask(replay, actions) -> Tensor | None:
    """The mask the router is about to use: current target, or the next backward-recompute one."""
    if replay.router_replay_action == actions.REPLAY_FORWARD:
        return replay.target_replay_mask
    if replay.router_replay_action == actions.REPLAY_BACKWARD and replay.replay_backward_mask_list:
        return replay.replay_backward_mask_list[0]
    return None


# ---------------------------------------------------------------------------------- metrics
def verl_metric_name(key: str) -> str:
    """The name a hook metric travels under through verl, which averages it over update calls.

    Ratios keep their schema names: an average of per-call ratios is still a ratio. Counts and
    flags would stop being whole numbers, so they travel under ``ablate_verl/<key>_per_update``,
    outside the schema, as what they then are: means per update call.
    """
    from ablate.diagnostics import SCHEMA

    if SCHEMA[key].kind in ("count", "flag"):
        return f"ablate_verl/{key.replace('/', '_')}_per_update"
    return key


def metrics_from_counters(c: dict[str, float], budget: float | None) -> dict[str, float]:
    """Schema v1 ``replay/`` and ``routing/`` keys from summed counters (NaN where undefined)."""

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else float("nan")

    metrics = {
        "replay/budget_requested": float(budget if budget is not None else float("nan")),
        "replay/budget_realized": ratio(c["replayed_routes"], c["valid_routes"]),
        "replay/valid_routes": int(c["valid_routes"]),
        "replay/replayed_routes": int(c["replayed_routes"]),
        "replay/override_rate": ratio(c["overridden_routes"], c["compared_replayed"]),
        "replay/fisher_mass": ratio(c["fisher_mass"], c["fisher_total"]),
        "replay/fisher_fallback": float(c["fisher_fallback"] > 0),
        "routing/route_mismatch_rate": ratio(c["mismatched_routes"], c["compared_routes"]),
        "routing/token_mismatch_rate": ratio(c["mismatched_tokens"], c["compared_tokens"]),
        "routing/topk_overlap": ratio(c["overlap"], c["compared_routes"]),
        "routing/mismatch_recall": ratio(c["overridden_routes"], c["mismatched_routes"]),
        "routing/residual_mismatch_rate": ratio(c["residual_routes"], c["compared_routes"]),
    }
    if c["valid_routes"] == 0:
        metrics["replay/budget_realized"] = float("nan")
    return metrics


def _world() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _sum_tensor_over_world(tensor: Tensor) -> Tensor:
    """Every (token, layer) is routed on exactly one rank (sequence parallel is required for MoE
    with TP > 1), so a world sum gives global counts and Fisher sums."""
    if not _world():
        return tensor
    from verl.utils.device import get_device_name

    reduced = tensor.to(get_device_name()).clone()
    torch.distributed.all_reduce(reduced)
    return reduced.to(tensor.device)


def _sum_over_world(counters: dict[str, float]) -> dict[str, float]:
    keys = sorted(counters)
    values = _sum_tensor_over_world(torch.tensor([counters[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, values.tolist()))


def _sum_over_model_parallel(native: Tensor) -> Tensor:
    """Native routes of one micro-batch, gathered from the ranks that each routed a slice of it."""
    if not _world():
        return native
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_and_context_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        native = native.clone()
        torch.distributed.all_reduce(native, group=group)
    return native
