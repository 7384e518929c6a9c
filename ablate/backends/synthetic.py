"""Synthetic MoE RL backend: a tiny MoE policy learns a digit task with verl's PPO step on a CPU.

It reproduces the mechanisms that make routing replay matter, not the numbers of a real system:

1. **Task.** A prompt is a task token and a few random digits; the response must count on from
   the last digit in steps that the task token sets (task t: steps of t + 1, modulo the base).
   The reward is the fraction of response digits that follow the rule. A *task shift* at a given
   step changes every rule (task t: steps of t + 1 + tasks), so the experts must re-specialise.
2. **Policy model.** A small causal transformer whose feed-forward blocks are top-k MoE layers
   with a softmax router. Experts run sparsely: only the (token, expert) pairs a route picked.
3. **Rollout engine.** A copy of the weights in other numerics (bfloat16), with a KV cache: every
   position is computed once, so the routes it records are exactly the routes that produced
   each sampled token. Its router differs from the trainer's by i.i.d. noise on the logits
   (drawn once per sequence, position, layer and expert) and, optionally, by a fixed change of
   its router weights (other kernels: the same tokens are misrouted step after step). With a
   ``rollout_lag`` it samples with weights some steps old, as asynchronous RL does.
4. **Trainer: verl's PPO step.** In float32. The old-log-prob pass recomputes the log-probs of the
   sampled tokens with the replay mask (verl's R3 replays in that pass too), for every policy:
   ``mismatch``, which chooses its mask from native routes, gets them from one more pass
   (``mismatch_native_old_pass=true`` instead takes its ratio against that native pass, as the
   verl backend did). Replayed routes use the rollout expert set with gates from the training
   router's logits renormalised over that set (R3); other routes are native. The loss is verl's
   vanilla PPO loss (dual clip, token mean) with GRPO advantages, the ratio taken against the
   old log-probs (``bypass_mode=false``, verl's default) or the rollout log-probs (``true``),
   over ``ppo_epochs`` passes of ``ppo_mini_batch_size``-prompt mini-batches, each one
   optimizer step, with verl's optional truncated importance weights (``rollout_is``).
   Hooks keep per-token gradients for the Fisher tracker.

Each step emits one diagnostics record with every key of the schema. The ``mismatch/`` and
``routing/`` keys compare the rollout with the trainer's replayed old-log-prob pass. On a probed
step (``probes``, ``probe_every``: docs/probes.md) each probe's mask is scored by one more
forward-only pass of the same weights on the same batch, between the old-log-prob pass and the
update; it draws from its own generator and touches nothing the update reads.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ablate.backends import RunContext
from ablate.backends.synthetic_config import BACKEND, SyntheticConfig
from ablate.cell import Cell
from ablate.config import choice_value
from ablate.diagnostics import expert_load, load_metrics, mismatch_metrics
from ablate.fisher import GradientCapture, expert_output_sq_grads, linear_param_sq_grads, router_logit_sq_grads
from ablate.replay import ReplaySession
from ablate.routes import Routes, native_margin
from ablate.seeding import stream, stream_seed

# --- the task ----------------------------------------------------------------------------


@dataclass
class Batch:
    task: Tensor  # [n]
    digits: Tensor  # [n, D]
    prompts: Tensor  # [n, 1 + D]: task token, digits


def sample_prompts(cfg: SyntheticConfig, generator: torch.Generator) -> Batch:
    """``prompts_per_step`` prompts, each repeated ``group_size`` times for GRPO."""
    n = cfg.prompts_per_step
    task = torch.randint(0, cfg.tasks, (n,), generator=generator)
    digits = torch.randint(0, cfg.vocab_digits, (n, cfg.digits), generator=generator)
    task, digits = task.repeat_interleave(cfg.group_size), digits.repeat_interleave(cfg.group_size, dim=0)
    prompts = torch.cat([(cfg.vocab_digits + task)[:, None], digits], dim=1)
    return Batch(task, digits, prompts)


def task_shifted(cfg: SyntheticConfig, step: int) -> bool:
    return cfg.task_shift_step is not None and step >= cfg.task_shift_step


def reward(cfg: SyntheticConfig, batch: Batch, response: Tensor, shifted: bool) -> Tensor:
    """Fraction of response digits that are the digit before them plus the task's step, mod base.

    Checking each transition against the digit actually emitted before it gives partial credit
    for every correct step. Task tokens in the response never count.
    """
    stride = batch.task + 1 + (cfg.tasks if shifted else 0)
    before = torch.cat([batch.digits[:, -1:], response[:, :-1]], dim=1)
    correct = response == (before + stride[:, None]) % cfg.vocab_digits
    return (correct & (response < cfg.vocab_digits)).float().mean(-1)


def chance_reward(cfg: SyntheticConfig) -> float:
    """Expected reward of a uniformly random response: one token in the vocabulary is right."""
    return 1.0 / (cfg.vocab_digits + cfg.tasks)


# --- the policy model --------------------------------------------------------------------


@dataclass
class Replay:
    """Routes to replay in one forward: ``routes [tokens, layers, k]`` where ``mask [tokens, layers]``.

    ``weights`` ``[tokens, layers, k]``: gate weights to use with the replayed routes instead of
    recomputing them (``replay.weights=rollout``). ``gate``: a policy's slot gate
    (:meth:`ablate.policies.ThresholdReplay.gate`), applied with the trainer's router scores.
    """

    routes: Tensor
    mask: Tensor
    weights: Tensor | None = None
    gate: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None

    def rows(self, tokens: slice) -> Replay:
        """The replay of a block of tokens (one mini-batch's)."""
        return Replay(self.routes[tokens], self.mask[tokens], None if self.weights is None else self.weights[tokens],
                      self.gate)


class FisherProbe:
    """Keeps, per layer, what the configured Fisher estimator needs from the training forward."""

    def __init__(self, estimator: str, num_experts: int) -> None:
        self.estimator, self.num_experts = estimator, num_experts
        self.logits, self.pre, self.outputs = GradientCapture(), GradientCapture(), GradientCapture()
        self.routed: dict[int, dict[str, Tensor]] = {}  # layer -> (token, expert) pairs and inputs

    def sq_grads(self, valid: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Per-token squared gradients ``[tokens, layers, experts]`` and which tokens count.

        ``scale`` undoes the ``1 / tokens`` of a mean loss, so the estimate does not depend on
        the mini-batch size. Only valid tokens count; expert estimators count only routed tokens.
        """
        counted = valid[:, None, None].float()
        if self.estimator == "router_logits":
            return router_logit_sq_grads(self.logits.stacked() * scale), counted
        tokens, per_layer, routed = valid.shape[0], [], []
        for layer in sorted(self.routed):
            pairs = self.routed[layer]
            out_grad = self.outputs.grads[layer] * scale
            if self.estimator == "expert_outputs":
                value = expert_output_sq_grads(out_grad)
            else:  # expert_params: the ghost norms of the expert's two linear maps
                pre_grad = self.pre.grads[layer] * scale
                value = linear_param_sq_grads(pairs["x"], pre_grad) + linear_param_sq_grads(pairs["hidden"], out_grad)
            index = (pairs["token"], pairs["expert"])
            per_layer.append(torch.zeros(tokens, self.num_experts).index_put_(index, value))
            routed.append(torch.zeros(tokens, self.num_experts).index_put_(index, torch.ones(())))
        return torch.stack(per_layer, dim=1), torch.stack(routed, dim=1) * counted


class MoE(nn.Module):
    """Top-k MoE feed-forward with a softmax router; each expert computes only its routed tokens."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        super().__init__()
        d, h, e = cfg.d_model, cfg.expert_hidden, cfg.experts
        self.topk, self.temperature = cfg.topk, cfg.router_temperature
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.randn(e, d, h) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(e, h, d) / math.sqrt(h))

    def forward(
        self, x: Tensor, layer: int, replay: Replay | None, noise: Tensor | None, probe: FisherProbe | None,
        margins: list[Tensor] | None = None, gate_weights: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.router(x) / self.temperature
        if noise is not None:
            logits = logits + noise
        native = logits.topk(self.topk, dim=-1).indices
        if margins is not None:
            margins.append(native_margin(logits.detach(), native))
        if replay is None:
            chosen = native
        else:
            replayed = replay.routes[:, layer]
            if replay.gate is not None:  # the trainer's scores keep or hand back each replayed expert
                replayed = replay.gate(logits.detach().softmax(-1), replayed, native)[0]
            chosen = torch.where(replay.mask[:, layer, None], replayed, native)
        if probe is not None and probe.estimator == "router_logits":
            logits = probe.logits.watch(layer, logits)
        # R3 gates: the router's softmax renormalised over the chosen expert set.
        gates = logits.gather(-1, chosen).softmax(-1)
        if replay is not None and replay.weights is not None:
            # The rollout's own weights where a route is replayed: constants, so the router gets no
            # gradient through those routes, only through the ones it routes natively.
            gates = torch.where(replay.mask[:, layer, None], replay.weights[:, layer], gates)
        if gate_weights is not None:
            gate_weights.append(gates.detach())
        # Sort the (token, expert) pairs by expert: one grouped matmul per weight computes every
        # expert on exactly its tokens.
        expert = chosen.reshape(-1)
        order = expert.argsort(stable=True)
        token, expert = order // self.topk, expert[order]
        ends = torch.bincount(expert, minlength=self.w_in.shape[0]).cumsum(0).to(torch.int32)
        x_routed = x[token]
        pre = F.grouped_mm(x_routed, self.w_in, offs=ends)
        hidden = F.gelu(pre)
        out = F.grouped_mm(hidden, self.w_out, offs=ends)
        if probe is not None and probe.estimator != "router_logits":
            probe.routed[layer] = {"token": token, "expert": expert, "x": x_routed.detach(), "hidden": hidden.detach()}
            probe.pre.watch(layer, pre)  # hidden was computed from pre: the hook still sees its gradient
            out = probe.outputs.watch(layer, out)
        weighted = out * gates.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, weighted), chosen, native


class Block(nn.Module):
    def __init__(self, cfg: SyntheticConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm_attn, self.norm_moe = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x: Tensor, layer: int, cache: list[tuple[Tensor, Tensor]] | None, **moe_args) -> tuple[Tensor, Tensor, Tensor]:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(batch, seq, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:  # decoding: earlier positions come from the cache, never recomputed
            if len(cache) > layer:
                k, v = torch.cat([cache[layer][0], k], dim=2), torch.cat([cache[layer][1], v], dim=2)
                cache[layer] = (k, v)
            else:
                cache.append((k, v))
        # A query block as long as the keys is a prefix (causal); a single new query sees every key.
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2] and seq > 1)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, d))
        y, chosen, native = self.moe(self.norm_moe(x).reshape(batch * seq, d), layer, **moe_args)
        return x + y.view(batch, seq, d), chosen, native


class MoEPolicy(nn.Module):
    def __init__(self, cfg: SyntheticConfig, seq_len: int) -> None:
        super().__init__()
        vocab = cfg.vocab_digits + cfg.tasks
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.position = nn.Parameter(0.02 * torch.randn(seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab)

    def forward(
        self, tokens: Tensor, replay: Replay | None = None, noise: Tensor | None = None,
        cache: list[tuple[Tensor, Tensor]] | None = None, probe: FisherProbe | None = None,
        margins: list[Tensor] | None = None, gate_weights: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Logits ``[B, S, V]``, routes used and native routes, both ``[B * S, layers, k]``.

        ``noise`` ``[B, S, layers, experts]`` is added to the router logits; with a ``cache``
        the tokens continue the cached positions. ``margins``, when given, receives each layer's
        ``[B * S]`` native margin (:func:`ablate.routes.native_margin`), in layer order;
        ``gate_weights`` each layer's ``[B * S, k]`` gate weights of the routes used.
        """
        start = cache[0][0].shape[2] if cache else 0
        x = self.embed(tokens) + self.position[start : start + tokens.shape[1]]
        used, native = [], []
        for layer, block in enumerate(self.blocks):
            layer_noise = None if noise is None else noise[:, :, layer].reshape(-1, noise.shape[-1])
            x, chosen, own = block(x, layer, cache, replay=replay, noise=layer_noise, probe=probe, margins=margins,
                                   gate_weights=gate_weights)
            used.append(chosen)
            native.append(own)
        return self.head(self.norm(x)), torch.stack(used, 1), torch.stack(native, 1)

    def expert_parameters(self) -> list[Tensor]:
        return [p for block in self.blocks for p in (block.moe.w_in, block.moe.w_out)]

    def router_parameters(self) -> list[Tensor]:
        return [block.moe.router.weight for block in self.blocks]


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


# --- the rollout engine ------------------------------------------------------------------


@dataclass
class Rollout:
    sequences: Tensor  # [B, P + R]
    log_probs: Tensor  # [B, R]: of each sampled token, in the engine's numerics
    routes: Tensor  # [B, P + R - 1, layers, k]: of every position fed to the engine
    router_noise: Tensor  # [B, P + R - 1, layers, experts]: what the engine added to its router logits
    gate_weights: Tensor | None = None  # [B, P + R - 1, layers, k]: the engine's weights of its routes, if recorded


class RolloutEngine:
    """The inference engine: a copy of the weights in other numerics, synced after each update.

    Lower precision is emulated the way bfloat16 kernels behave (float32 arithmetic, results
    stored in bfloat16): the weights, the embeddings, the residual stream after every block, the
    router logits and the output logits are held in ``rollout_dtype``. CPU bfloat16 kernels for
    these tiny shapes are several times slower than this emulation.
    ``router_perturbation`` is the standard deviation of a fixed random change of each router's
    weights, in logit units for a unit-variance input: the engine's kernels compute a slightly
    different router, the same way at every step.
    """

    def __init__(self, model: MoEPolicy, cfg: SyntheticConfig, generator: torch.Generator) -> None:
        self.model = copy.deepcopy(model)
        self.dtype = getattr(torch, cfg.rollout_dtype)
        if self.dtype != torch.float32:
            rounded = [self.model.embed, self.model.head, *self.model.blocks]
            for module in rounded + [block.moe.router for block in self.model.blocks]:
                module.register_forward_hook(self._round_output)
        self.router_noise, self.generator = cfg.router_noise, generator
        self.perturbation = [
            cfg.router_perturbation * torch.randn(w.shape, generator=generator) / math.sqrt(w.shape[1])
            for w in model.router_parameters()
        ]
        self.sync(model.state_dict())

    def _round_output(self, module: nn.Module, args: tuple, output: Tensor | tuple) -> Tensor | tuple:
        if isinstance(output, tuple):  # (hidden states, routes used, native routes)
            return (output[0].to(self.dtype).float(), *output[1:])
        return output.to(self.dtype).float()

    @torch.no_grad()
    def sync(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)
        for weight, delta in zip(self.model.router_parameters(), self.perturbation):
            weight += delta
        for weight in self.model.parameters():
            weight.copy_(weight.to(self.dtype))

    @torch.no_grad()
    def generate(self, prompts: Tensor, length: int, sampler: torch.Generator, *,
                 record_weights: bool = False) -> Rollout:
        """Sample ``length`` tokens after ``prompts``: a prefill, then one cached step per token.

        ``record_weights``: record the gate weights of every route with its expert ids.
        """
        batch, prompt_len = prompts.shape
        fed = prompt_len + length - 1  # the last sampled token is never fed back
        shape = (batch, fed, len(self.model.blocks), self.model.blocks[0].moe.w_in.shape[0])
        noise = self.router_noise * torch.randn(shape, generator=self.generator)
        cache: list[tuple[Tensor, Tensor]] = []
        sequences, fresh, logps, routes, weights = prompts, prompts, [], [], []
        for _ in range(length):
            start, width = sequences.shape[1] - fresh.shape[1], fresh.shape[1]
            layer_weights: list[Tensor] | None = [] if record_weights else None
            logits, used, _ = self.model(fresh, noise=noise[:, start : start + width], cache=cache,
                                         gate_weights=layer_weights)
            routes.append(used.view(batch, width, *used.shape[1:]))
            if layer_weights is not None:
                weights.append(torch.stack(layer_weights, 1).view(batch, width, *used.shape[1:]))
            log_probs = logits[:, -1].log_softmax(-1)
            fresh = torch.multinomial(log_probs.exp(), 1, generator=sampler)
            logps.append(log_probs.gather(-1, fresh))
            sequences = torch.cat([sequences, fresh], dim=1)
        return Rollout(sequences, torch.cat(logps, 1), torch.cat(routes, 1), noise,
                       torch.cat(weights, 1) if record_weights else None)


# --- verl's PPO step ---------------------------------------------------------------------


def rollout_is_weights(
    log_ratio: Tensor, level: str, threshold: float, batch_normalize: bool,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights ``[B, R]`` of verl's ``compute_rollout_correction_weights``.

    ``log_ratio`` is ``old - rollout`` log-probs of the response tokens (all valid here).
    ``token``: ``min(exp(l), threshold)`` per token; ``sequence``: ``min(exp(sum l), threshold)``
    for every token of the sequence; ``exp`` of a log-ratio clamped to [-20, 20]. Returns the
    weights and verl's ``rollout_is_mean`` (before normalisation) and
    ``rollout_is_ratio_fraction_high`` (tokens, or sequences, above the threshold).
    """
    if level == "token":
        raw = log_ratio.clamp(-20, 20).exp()
        above = (raw > threshold).float().mean()
    else:
        total = log_ratio.sum(-1, keepdim=True)
        raw = total.clamp(-20, 20).exp().expand_as(log_ratio)
        above = (total > math.log(threshold)).float().mean()
    weights = raw.clamp(max=threshold)
    metrics = {"train/is_weight_mean": float(weights.mean()), "train/is_truncated_frac": float(above)}
    if batch_normalize:
        weights = weights / weights.mean()
    return weights, metrics


def ppo_loss(
    log_probs: Tensor, reference: Tensor, advantages: Tensor, weights: Tensor | None, clip_ratio: float, clip_ratio_c: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """verl's ``compute_policy_loss_vanilla`` with ``token-mean`` aggregation over ``[n, R]`` tokens.

    Returns the loss, ``pg_clipfrac`` (tokens where the clipped term wins, so the clip removes
    their gradient) and ``pg_clipfrac_lower`` (negative-advantage tokens capped by the dual clip).
    """
    ratio = (log_probs - reference).clamp(-20.0, 20.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    pessimistic = torch.maximum(unclipped, clipped)
    capped = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(capped, pessimistic), pessimistic)
    if weights is not None:
        losses = losses * weights
    clip_frac = (clipped > unclipped).float().mean()
    clip_frac_lower = ((pessimistic > capped) & (advantages < 0)).float().mean()
    return losses.mean(), clip_frac, clip_frac_lower


def mini_batches(cfg: SyntheticConfig) -> list[slice]:
    """Sequence rows of each update, in order: verl splits without shuffling (``shuffle=false``)."""
    size = cfg.ppo_mini_batch_size * cfg.group_size
    batch = cfg.prompts_per_step * cfg.group_size
    return [slice(start, start + size) for start in range(0, batch, size)] * cfg.ppo_epochs


# --- the training loop -------------------------------------------------------------------


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def relative_drift(params: list[Tensor], initial: list[Tensor]) -> float:
    delta = math.sqrt(sum(float((p.detach() - p0).square().sum()) for p, p0 in zip(params, initial)))
    return delta / max(math.sqrt(sum(float(p0.square().sum()) for p0 in initial)), 1e-12)


@dataclass
class StepBatch:
    """What a probe pass needs of one step: the batch, its routes and the rollout's log-probs."""

    inputs: Tensor  # [B, S]
    targets: Tensor  # [B, S]
    response: slice
    rollout_routes: Tensor  # [B * S, layers, k]
    valid: Tensor  # [B * S]
    offsets: Tensor
    rollout_log_probs: Tensor  # [B, R]


@torch.no_grad()
def score_probes(
    session: ReplaySession, model: MoEPolicy, batch: StepBatch, native: Tensor | None, *, num_experts: int,
    extreme_threshold: float,
) -> None:
    """One forward-only pass per probe mask on the step's batch: its ``probe/<id>/`` keys, to the session.

    ``native`` is the step's native routes when the cell already computed them (``mismatch``);
    otherwise one native pass is run here, only if a probe selects on native routes. The replay
    keys compare each mask with the native routes of its own pass, as the cell's keys do.
    """
    every_token = torch.ones_like(batch.rollout_log_probs, dtype=torch.bool)
    for probe in session.probes():
        needs_native = probe.policy.needs_native_routes
        if needs_native and native is None:
            native = model(batch.inputs)[2]
        routes = Routes(rollout=batch.rollout_routes, valid=batch.valid, num_experts=num_experts,
                        offsets=batch.offsets, native=native if needs_native else None)
        mask = session.select(routes, probe=probe)
        logits, _, native_in_probe = model(batch.inputs, replay=Replay(batch.rollout_routes, mask))
        logp = token_log_probs(logits, batch.targets)[:, batch.response]
        counts = session.new_counts()
        session.count(Routes(rollout=batch.rollout_routes, valid=batch.valid, num_experts=num_experts,
                             native=native_in_probe), mask, into=counts)
        session.add_probe(probe.probe, session.read_counts(counts), mismatch_metrics(logp, batch.rollout_log_probs, every_token,
                                                             extreme_threshold=extreme_threshold))


@dataclass(frozen=True)
class Variant:
    """How the cell replays a route (docs/policies.md, "Replay variants"); the policy says which routes.

    ``train_routes``: R2, the trainer's own routes of the old-log-prob pass (which routes natively)
    instead of the rollout's. ``rollout_weights``: the rollout's gate weights with its ids instead
    of weights recomputed from the trainer's scores. ``gate``: the policy's slot gate (``threshold``).
    """

    train_routes: bool = False
    rollout_weights: bool = False
    gate: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None

    @classmethod
    def of(cls, cell: Cell, session: ReplaySession) -> Variant:
        policy = session.policy
        return cls(cell.replay.source == "train", cell.replay.weights == "rollout",
                   policy.gate if policy.gates_slots else None)  # type: ignore[attr-defined]

    def count(self, session: ReplaySession, routes: Routes, mask: Tensor, used: Tensor) -> None:
        """The old-log-prob pass's route counts. R3 replays the rollout's routes as they are; R2 replays
        the routes this pass used itself, and a gate changes some of the rollout's: both count ``used``."""
        if self.train_routes:
            session.count(routes, mask, used=used)
        elif self.gate is not None:
            replayed = mask & routes.valid[:, None]
            kept = (routes.rollout[..., :, None] == used[..., None, :]).any(-1).sum(-1)
            session.count(routes, mask, used=used, replaced_slots=float((routes.topk - kept)[replayed].sum()))
        else:
            session.count(routes, mask)


def run_cell_steps(cell: Cell, log_step: Callable[[int, dict[str, float]], None]) -> MoEPolicy:
    """Train one cell for ``cfg.steps`` steps, calling ``log_step(step, record)`` after each.

    Returns the trained model: probed and unprobed runs of a seed end with the same weights.
    """
    cfg = BACKEND.config_of(cell)
    cfg.check()
    session = ReplaySession(cell.replay, cfg.layers, cfg.experts, cfg.topk)
    fisher = session.tracker
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(stream_seed(cell.seed, "init"))  # model initialisation: the same for every policy of a seed
    prompt_len, response_len = 1 + cfg.digits, cfg.response_length
    seq_len = prompt_len + response_len - 1
    model = MoEPolicy(cfg, seq_len)
    streams = {name: stream(cell.seed, name) for name in ("prompts", "sampling", "router_noise")}
    engine = RolloutEngine(model, cfg, streams["router_noise"])
    # The engine samples with the weights of `rollout_lag` steps ago: the oldest state kept here.
    history = deque([snapshot(model)], maxlen=cfg.rollout_lag + 1)
    parameters, experts, routers = list(model.parameters()), model.expert_parameters(), model.router_parameters()
    optimizer = torch.optim.Adam(parameters, lr=cfg.lr, foreach=True)
    initial_experts, initial_routers = [p.detach().clone() for p in experts], [p.detach().clone() for p in routers]

    batch_size = cfg.prompts_per_step * cfg.group_size
    first_valid = prompt_len if choice_value(cfg.replay_tokens) == "response" else 0
    valid = (torch.arange(seq_len) >= first_valid).repeat(batch_size)
    # Sequence boundaries: `uniform` spreads its quota over sequences and positions with them.
    offsets = torch.arange(0, batch_size * seq_len + 1, seq_len)
    response = slice(prompt_len - 1, seq_len)  # positions whose next token is a response token
    needs_native = session.needs_native
    estimator = choice_value(cell.fisher.estimator)
    variant = Variant.of(cell, session)

    for step in range(cfg.steps):
        batch = sample_prompts(cfg, streams["prompts"])
        rollout = engine.generate(batch.prompts, response_len, streams["sampling"],
                                  record_weights=variant.rollout_weights)
        shifted = task_shifted(cfg, step)
        rewards = reward(cfg, batch, rollout.sequences[:, prompt_len:], shifted)
        grouped = rewards.view(cfg.prompts_per_step, cfg.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        inputs, targets = rollout.sequences[:, :-1], rollout.sequences[:, 1:]
        flat_rollout = rollout.routes.reshape(batch_size * seq_len, cfg.layers, cfg.topk)
        flat_weights = None if rollout.gate_weights is None else rollout.gate_weights.reshape(flat_rollout.shape)

        # The old-log-prob pass, in training numerics, replays the mask (verl's R3 does), so
        # every policy takes its ratio against the same kind of reference. `mismatch` chooses
        # its mask from native routes: it pays one native pass first (as the verl backend does),
        # or, with mismatch_native_old_pass, takes its ratio against that native pass. R2 instead
        # routes natively here and records the trainer's own routes, which the updates replay.
        with torch.no_grad():
            margins: list[Tensor] = []
            if variant.train_routes:
                replayed_logits, used, native_in_replay = model(inputs, margins=margins)
                native_pass, source = None, native_in_replay
            else:
                native_pass = model(inputs, margins=margins) if needs_native else None
                source = flat_rollout
            native = native_in_replay if variant.train_routes else None if native_pass is None else native_pass[2]
            routes = Routes(rollout=source, valid=valid, num_experts=cfg.experts, offsets=offsets,
                            native=native if needs_native else None,
                            native_margin=torch.stack(margins, 1) if margins and needs_native else None)
            mask = session.select(routes)
            replay = Replay(source, mask, flat_weights, variant.gate)
            if not variant.train_routes:
                replayed_logits, used, native_in_replay = model(inputs, replay=replay)
            # What the mask changed, against the native routes of the pass that replayed it.
            diagnostics_routes = Routes(rollout=flat_rollout, valid=valid, num_experts=cfg.experts, native=native_in_replay)
            variant.count(session, diagnostics_routes, mask, used)
            logp_replayed = token_log_probs(replayed_logits, targets)[:, response]
            logp_old = logp_replayed
            if native_pass is not None and cfg.mismatch_native_old_pass:
                logp_old = token_log_probs(native_pass[0], targets)[:, response]
            response_log_probs = replayed_logits[:, response].log_softmax(-1)
            entropy = -(response_log_probs.exp() * response_log_probs).sum(-1).mean()
        if session.probed:
            score_probes(session, model, StepBatch(inputs, targets, response, flat_rollout, valid, offsets,
                                                   rollout.log_probs),
                         native, num_experts=cfg.experts,
                         extreme_threshold=cfg.extreme_threshold)

        correction: dict[str, float] = {"train/is_weight_mean": math.nan, "train/is_truncated_frac": math.nan}
        weights = None
        if cfg.bypass_mode:
            reference = rollout.log_probs  # verl's bypass mode with the ppo_clip loss: no IS weights
        else:
            reference = logp_old
            if cfg.rollout_is is not None:
                weights, correction = rollout_is_weights(
                    logp_old - rollout.log_probs, choice_value(cfg.rollout_is), cfg.rollout_is_threshold,
                    cfg.rollout_is_batch_normalize,
                )

        updates = mini_batches(cfg)
        totals = dict.fromkeys(("train/loss", "train/grad_norm", "train/clip_frac", "train/clip_frac_lower"), 0.0)
        for rows in updates:
            tokens = slice(rows.start * seq_len, rows.stop * seq_len)
            probe = FisherProbe(estimator, cfg.experts)
            logits, _, _ = model(inputs[rows], replay=replay.rows(tokens), probe=probe)
            loss, clip_frac, clip_frac_lower = ppo_loss(
                token_log_probs(logits, targets[rows])[:, response], reference[rows], advantages[rows],
                None if weights is None else weights[rows], cfg.clip_ratio, cfg.clip_ratio_c,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, cfg.max_grad_norm)
            optimizer.step()
            fisher.accumulate(*probe.sq_grads(valid[tokens], scale=float((rows.stop - rows.start) * response_len)))
            for key, value in zip(totals, (loss.detach(), grad_norm, clip_frac, clip_frac_lower)):
                totals[key] += float(value) / len(updates)
        record = session.close_step()  # replay/, routing/ and probe keys; one step of the Fisher estimate
        history.append(snapshot(model))
        engine.sync(history[0])

        with torch.no_grad():
            record.update(load_metrics(expert_load(Routes(rollout=used, valid=valid, num_experts=cfg.experts,
                                                          ids_checked=True))))
            record.update(mismatch_metrics(
                logp_replayed, rollout.log_probs, torch.ones_like(logp_replayed, dtype=torch.bool),
                extreme_threshold=cfg.extreme_threshold,
            ))
        record.update(totals)
        record.update(correction)
        record.update({
            "drift/experts": relative_drift(experts, initial_experts),
            "drift/router": relative_drift(routers, initial_routers),
            "train/reward": float(rewards.mean()),
            "train/reward_std": float(rewards.std(correction=0)),
            "train/reward_chance": chance_reward(cfg),
            "train/task_shifted": float(shifted),
            "train/entropy": float(entropy),
        })
        log_step(step, record)
    return model


def run(cell: Cell, context: RunContext) -> None:
    run_cell_steps(cell, context.log_step)

