"""Synthetic MoE RL backend: a tiny MoE policy learns a digit task with GRPO on a CPU.

It reproduces the mechanism that makes routing replay matter, not the numbers of a real system:

1. **Policy model.** A small causal transformer whose feed-forward blocks are top-k MoE layers
   with a softmax router (token and position embeddings, attention, MoE, output head).
2. **Task.** A prompt is a task token and a few random digits; the response must count on from
   the last digit in steps that the task token sets (task t: steps of t + 1, modulo the base).
   The reward, checked exactly, is the fraction of response digits that follow the rule, so RL
   makes progress from a random start, and experts can specialise by task.
3. **Rollout engine.** Samples with the *same weights* held in bfloat16 (as an inference engine
   does), optionally with noise on the router logits (other kernels, other reduction orders).
   It records the routes of every position and the log-prob of every sampled token. Route
   mismatch then comes from near-ties in the router, as in real systems.
4. **Trainer.** In float32: an old-log-prob pass routes natively (giving the native routes the
   ``mismatch`` policy needs), the policy picks the replay mask, and the training forward uses
   the rollout expert set on masked routes with gate weights recomputed from the training router
   over that set (R3), native routes elsewhere. The loss is GRPO's clipped surrogate with
   group-normalised advantages and the importance ratio against the rollout log-probs.
   Hooks keep per-token gradients for the Fisher tracker.

Each step emits one diagnostics record with every key of the schema.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ablate.budget import check_budget
from ablate.cell import Cell, policy_for
from ablate.config import SyntheticConfig
from ablate.diagnostics import mismatch_metrics, route_diagnostics
from ablate.fisher import (
    GradientCapture,
    expert_output_sq_grads,
    linear_param_sq_grads,
    router_logit_sq_grads,
)
from ablate.routes import Routes

# --- the task ----------------------------------------------------------------------------


def rule_holds(task: Tensor, previous: Tensor, response: Tensor, base: int) -> Tensor:
    """``[n, R]`` bool: each response digit is the previous digit plus the task's step, mod base.

    Task ``t`` counts in steps of ``t + 1`` from the last prompt digit. Checking each transition
    against the digit actually emitted before it gives partial credit for every correct step.
    """
    before = torch.cat([previous[:, None], response[:, :-1]], dim=1)
    return response == (before + task[:, None] + 1) % base


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


def reward(cfg: SyntheticConfig, batch: Batch, response: Tensor) -> Tensor:
    """Fraction of response digits that follow the rule; task tokens in the response never do."""
    digit = response < cfg.vocab_digits
    return (rule_holds(batch.task, batch.digits[:, -1], response, cfg.vocab_digits) & digit).float().mean(-1)


# --- the policy model --------------------------------------------------------------------


@dataclass
class Replay:
    """Routes to replay in one forward: ``routes [tokens, layers, k]`` where ``mask [tokens, layers]``."""

    routes: Tensor
    mask: Tensor


class FisherProbe:
    """Keeps what each Fisher estimator needs from the training forward, per layer."""

    def __init__(self, estimator: str) -> None:
        self.estimator = estimator
        self.logits, self.outputs, self.pre = GradientCapture(), GradientCapture(), GradientCapture()
        self.inputs: dict[int, Tensor] = {}
        self.hidden: dict[int, Tensor] = {}
        self.chosen: dict[int, Tensor] = {}

    def sq_grads(self, num_experts: int, scale: float, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token squared gradients ``[tokens, layers, experts]`` and which tokens count.

        ``scale`` undoes the ``1 / tokens`` of a mean loss, so the estimate does not depend on
        the batch size. Only valid tokens count; expert estimators count only routed tokens.
        """
        chosen = torch.stack([self.chosen[layer] for layer in sorted(self.chosen)], dim=1)
        counted = valid[:, None, None].float()
        routed = torch.zeros(*chosen.shape[:2], num_experts).scatter_(-1, chosen, 1.0) * counted
        if self.estimator == "router_logits":
            return router_logit_sq_grads(self.logits.stacked() * scale), counted
        if self.estimator == "expert_outputs":
            return expert_output_sq_grads(self.outputs.stacked() * scale), routed
        per_layer = []
        for layer in sorted(self.chosen):
            x = self.inputs[layer][:, None, :]  # [tokens, 1, d]: every expert reads the same input
            w_in = linear_param_sq_grads(x, self.pre.grads[layer] * scale)
            w_out = linear_param_sq_grads(self.hidden[layer], self.outputs.grads[layer] * scale)
            per_layer.append(w_in + w_out)
        return torch.stack(per_layer, dim=1), routed


class MoE(nn.Module):
    """Top-k MoE feed-forward with a softmax router; experts are computed densely (tiny sizes)."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        super().__init__()
        d, h, e = cfg.d_model, cfg.expert_hidden, cfg.experts
        self.topk, self.temperature = cfg.topk, cfg.router_temperature
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.randn(e, h, d) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(e, d, h) / math.sqrt(h))

    def forward(
        self, x: Tensor, layer: int, replay: Replay | None, noise: float, generator: torch.Generator | None,
        probe: FisherProbe | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.router(x) / self.temperature
        if noise > 0:
            logits = logits + noise * torch.randn(logits.shape, generator=generator).to(logits.dtype)
        native = logits.topk(self.topk, dim=-1).indices
        chosen = native if replay is None else torch.where(replay.mask[:, layer, None], replay.routes[:, layer], native)
        if probe is not None:
            logits = probe.logits.watch(layer, logits)
        # R3 gates: the (training) router's softmax renormalised over the chosen expert set.
        gates = logits.gather(-1, chosen).softmax(-1)
        pre = torch.einsum("nd,ehd->neh", x, self.w_in)
        hidden = F.gelu(pre)
        out = torch.einsum("neh,edh->ned", hidden, self.w_out)
        if probe is not None:
            probe.inputs[layer], probe.hidden[layer], probe.chosen[layer] = x, hidden, chosen
            probe.pre.watch(layer, pre)
            out = probe.outputs.watch(layer, out)
        picked = out.gather(1, chosen[..., None].expand(-1, -1, out.shape[-1]))
        return (gates[..., None] * picked).sum(1), chosen, native


class Block(nn.Module):
    def __init__(self, cfg: SyntheticConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm_attn, self.norm_moe = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x: Tensor, layer: int, **moe_args) -> tuple[Tensor, Tensor, Tensor]:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.norm_attn(x)).view(batch, seq, 3, self.heads, d // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
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
        self, tokens: Tensor, replay: Replay | None = None, noise: float = 0.0,
        generator: torch.Generator | None = None, probe: FisherProbe | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Logits ``[B, S, V]``, routes used and native routes, both ``[B * S, layers, k]``."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        used, native = [], []
        for layer, block in enumerate(self.blocks):
            x, chosen, own = block(x, layer, replay=replay, noise=noise, generator=generator, probe=probe)
            used.append(chosen)
            native.append(own)
        return self.head(self.norm(x)), torch.stack(used, 1), torch.stack(native, 1)

    def expert_parameters(self) -> list[Tensor]:
        return [p for block in self.blocks for p in (block.moe.w_in, block.moe.w_out)]

    def router_parameters(self) -> list[Tensor]:
        return [block.moe.router.weight for block in self.blocks]


# --- the rollout engine ------------------------------------------------------------------


class RolloutEngine:
    """The inference engine: a copy of the weights in other numerics, synced after each update."""

    def __init__(self, model: MoEPolicy, dtype: torch.dtype, router_noise: float, generator: torch.Generator) -> None:
        self.model = copy.deepcopy(model).to(dtype)
        self.router_noise, self.generator = router_noise, generator

    def sync(self, model: MoEPolicy) -> None:
        self.model.load_state_dict(model.state_dict())  # casts to the engine's dtype

    @torch.no_grad()
    def generate(self, prompts: Tensor, length: int, sampler: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """Sample ``length`` tokens; return sequences, sampled log-probs ``[B, length]`` and the
        routes of every fed position ``[B, P + length - 1, layers, k]``.

        Without a KV cache, each decode step recomputes the prefix; the routes recorded for a
        position are those of the step that first processed it (prefill for the prompt), as an
        engine with a KV cache would record them.
        """
        tokens, logps, routes = prompts, [], []
        batch = prompts.shape[0]
        for step in range(length):
            logits, used, _ = self.model(tokens, noise=self.router_noise, generator=self.generator)
            used = used.view(batch, tokens.shape[1], *used.shape[1:])
            routes.append(used if step == 0 else used[:, -1:])
            log_probs = logits[:, -1].float().log_softmax(-1)
            token = torch.multinomial(log_probs.exp(), 1, generator=sampler)
            logps.append(log_probs.gather(-1, token))
            tokens = torch.cat([tokens, token], dim=1)
        return tokens, torch.cat(logps, 1), torch.cat(routes, 1)


# --- the training loop -------------------------------------------------------------------


def relative_drift(params: list[Tensor], initial: list[Tensor]) -> float:
    delta = math.sqrt(sum(float((p.detach() - p0).square().sum()) for p, p0 in zip(params, initial)))
    return delta / max(math.sqrt(sum(float(p0.square().sum()) for p0 in initial)), 1e-12)


def run_cell_steps(cell: Cell, log_step: Callable[[int, dict[str, float]], None]) -> None:
    """Train one cell for ``cfg.steps`` steps, calling ``log_step(step, record)`` after each."""
    cfg: SyntheticConfig = cell.backend  # type: ignore[assignment]
    policy, fisher = policy_for(cell, cfg.layers, cfg.experts)
    budget = check_budget(cell.budget, policy.name)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cell.seed)  # model initialisation: the same for every policy of a seed
    prompt_len, response_len = 1 + cfg.digits, cfg.digits
    seq_len = prompt_len + response_len - 1  # the last sampled token is never fed back
    model = MoEPolicy(cfg, seq_len)
    streams = {name: torch.Generator().manual_seed(cell.seed * 7919 + offset) for offset, name in enumerate(
        ("prompts", "sampling", "selection", "router_noise"))}
    engine = RolloutEngine(model, getattr(torch, cfg.rollout_dtype), cfg.router_noise, streams["router_noise"])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    initial_experts = [p.detach().clone() for p in model.expert_parameters()]
    initial_router = [p.detach().clone() for p in model.router_parameters()]

    positions = torch.arange(seq_len)
    valid_position = positions >= (prompt_len if cfg.replay_tokens.value == "response" else 0)
    batch_size = cfg.prompts_per_step * cfg.group_size
    valid = valid_position.repeat(batch_size)
    response_slice = slice(prompt_len - 1, seq_len)  # positions whose next token is a response token

    for step in range(cfg.steps):
        batch = sample_prompts(cfg, streams["prompts"])
        sequences, logp_rollout, rollout_routes = engine.generate(batch.prompts, response_len, streams["sampling"])
        rewards = reward(cfg, batch, sequences[:, prompt_len:])
        grouped = rewards.view(cfg.prompts_per_step, cfg.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        inputs, targets = sequences[:, :-1], sequences[:, 1:]
        flat_rollout = rollout_routes.reshape(batch_size * seq_len, cfg.layers, cfg.topk)

        # Old-log-prob pass in training numerics, routing natively: the native routes exist
        # before the mask is chosen, as in verl's old-log-prob pass.
        with torch.no_grad():
            _, _, native_before = model(inputs)
        routes = Routes(rollout=flat_rollout, valid=valid, num_experts=cfg.experts, native=native_before)
        estimate_used = fisher.scores() if fisher.has_estimate else None
        mask = policy.select(routes, budget, generator=streams["selection"])

        probe = FisherProbe(cell.fisher.estimator.value)
        logits, _, native_now = model(inputs, replay=Replay(flat_rollout, mask), probe=probe)
        log_probs = logits.log_softmax(-1)
        logp_all = log_probs.gather(-1, targets[..., None]).squeeze(-1)
        logp_train = logp_all[:, response_slice]
        ratio = torch.exp(logp_train - logp_rollout)
        adv = advantages[:, None]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
        loss = -surrogate.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        optimizer.step()
        engine.sync(model)
        fisher.accumulate(*probe.sq_grads(cfg.experts, scale=float(ratio.numel()), valid=valid))
        fisher.step()

        with torch.no_grad():
            entropy = -(log_probs[:, response_slice].exp() * log_probs[:, response_slice]).sum(-1).mean()
            # Diagnostics compare the rollout routes with the routes the training router chose
            # in the replayed forward itself (what verl's replay sees as "native").
            diagnostics_routes = Routes(rollout=flat_rollout, valid=valid, num_experts=cfg.experts, native=native_now)
            record = route_diagnostics(
                diagnostics_routes, mask, budget, fisher_scores=estimate_used,
                fisher_fallback=bool(policy.info.get("fisher_fallback", 0.0)),
            )
            record.update(mismatch_metrics(
                logp_train.detach(), logp_rollout, torch.ones_like(logp_rollout, dtype=torch.bool),
                extreme_threshold=cfg.extreme_threshold,
            ))
        record.update({
            "drift/experts": relative_drift(model.expert_parameters(), initial_experts),
            "drift/router": relative_drift(model.router_parameters(), initial_router),
            "train/reward": float(rewards.mean()),
            "train/reward_std": float(rewards.std(correction=0)),
            "train/loss": float(loss.detach()),
            "train/grad_norm": grad_norm,
            "train/clip_frac": float(((ratio - 1).abs() > cfg.clip_eps).float().mean()),
            "train/entropy": float(entropy),
        })
        log_step(step, record)
