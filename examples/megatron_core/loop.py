"""Partial replay in a Megatron-core RL loop of your own: sample, score, update, on a CPU in seconds.

A tiny GPT-MoE model from Megatron-core's own classes learns to emit one token. Each step:

1. **sample**: the "rollout engine" (the same weights, computing in bfloat16 as an inference
   engine would) samples a response per prompt, then records the routes of every token in one
   pass with Megatron-core's ``RouterReplayAction.RECORD``;
2. **score**: the reward is the share of response tokens equal to ``TARGET``;
3. **update**: the trainer (float32) replays the rollout's routes through Megatron-core's
   ``RouterReplay``, exactly as NeMo RL, SkyRL and AReaL do, and takes a policy-gradient step.
   Inside ``partial_replay`` only the policy's budget of those routes is replayed; every other
   route is the trainer's own. The step ends with ``replay.metrics()``, printed.

Run it from a checkout with megatron-core 0.16.1 installed (``bash .ci/verl-env.sh`` builds
such an environment)::

    .venv-verl/bin/python examples/megatron_core/loop.py --policy random --budget 0.25
    .venv-verl/bin/python examples/megatron_core/loop.py --policy mismatch --budget 0.25 --steps 5
    .venv-verl/bin/python examples/megatron_core/loop.py --policy full --budget none
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

VOCAB, PROMPT, RESPONSE, PROMPTS, TARGET = 16, 4, 8, 4, 3
PRINTED = ("replay/budget_realized", "replay/replayed_routes", "replay/valid_routes", "routing/route_mismatch_rate",
           "replay/effective_budget", "mismatch/kl_k3")


def on_the_cpu() -> None:
    """What Megatron-core 0.16.1 needs to run on a CPU; none of it is replay.

    A router moves its weight to ``torch.cuda.current_device()``, its gating function reads a
    Transformer Engine symbol that is undefined without Transformer Engine, and attention in
    training forks the CUDA random-number tracker around its dropout.
    """
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: torch.device("cpu")
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def tiny_moe():
    """A GPT model of two MoE layers (8 experts, top-2) whose routers replay through Megatron-core's RouterReplay."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=2,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,  # one Megatron-core RouterReplay per router
        use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=PROMPT + RESPONSE)


def forward(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[sequences, positions, vocab]`` logits of a causal forward."""
    positions = torch.arange(tokens.shape[1])[None]
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1]), diagonal=1).bool()[None, None]
    return model(tokens, positions, attention_mask=causal).float()


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[sequences, RESPONSE]`` log-probabilities of the response tokens."""
    predicted = logits[:, PROMPT - 1:-1].log_softmax(-1)
    return predicted.gather(-1, tokens[:, PROMPT:, None]).squeeze(-1)


@torch.no_grad()
def sample(model, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """The rollout engine's responses, their log-probs, and each sequence's routes per layer (``RECORD``)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    tokens = torch.randint(0, VOCAB, (PROMPTS, PROMPT), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an inference engine's numerics, not the trainer's
        for _ in range(RESPONSE):
            next_token = torch.multinomial(forward(model, tokens)[:, -1].softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        routes = []
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        log_probs = []
        for sequence in tokens:
            log_probs.append(token_log_probs(forward(model, sequence[None]), sequence[None]))
            routes.append([recorded.clone() for recorded in RouterReplay.get_recorded_data()])
        RouterReplay.clear_global_router_replay_action()
    return tokens, torch.cat(log_probs), routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="random")
    parser.add_argument("--budget", type=lambda text: None if text == "none" else float(text), default=0.25,
                        help="the share of routes replayed; none for the policies none and full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from ablate.replay.megatron_core import partial_replay

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    on_the_cpu()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(args.seed)
    model = tiny_moe()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(args.seed)

    with partial_replay(policy=args.policy, budget=args.budget, seed=args.seed) as replay:
        for step in range(args.steps):
            tokens, rollout_log_probs, routes = sample(model, generator)
            rewards = (tokens[:, PROMPT:] == TARGET).float().mean(1)
            advantages = rewards - rewards.mean()
            optimizer.zero_grad()
            log_probs = []
            for sequence, sequence_routes, advantage in zip(tokens, routes, advantages):  # one micro-batch each
                RouterReplay.set_replay_data(sequence_routes)
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                if replay.needs_native_pass:  # mismatch selects on the trainer's own routes: one pass records them
                    with replay.native_pass(), torch.no_grad():
                        forward(model, sequence[None])
                sequence_log_probs = token_log_probs(forward(model, sequence[None]), sequence[None])
                (-(advantage * sequence_log_probs).sum() / PROMPTS).backward()
                log_probs.append(sequence_log_probs.detach())
                RouterReplay.clear_global_indices()
                RouterReplay.clear_global_router_replay_action()
            optimizer.step()
            metrics = replay.metrics(log_probs=torch.cat(log_probs), rollout_log_probs=rollout_log_probs)
            shown = " ".join(f"{key}={metrics[key]:.4g}" for key in PRINTED)
            print(f"step {step}: reward={float(rewards.mean()):.3f} {shown}", flush=True)
    with contextlib.suppress(AssertionError):
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
