"""Cost of the synthetic backend: one training step against one plain forward + backward.

The baseline is one forward and backward of the same model on the same batch (every sequence
of a step, native routing, a plain log-likelihood loss), timed in the same run. Against it the
script prints the cost of the pieces of a step (the KV-cache rollout, the old-log-prob pass, the
PPO updates) and of a whole step measured inside a real cell; then the CPU and wall time of a
whole default cell (the backend alone: the app adds about 0.3 s of store and W&B work). CPU
time is reported beside wall time: on a machine shared with other jobs, wall time is not a
measurement.

    python bench/bench_synthetic.py [--repeats 20] [--cell-steps 200] [overrides ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from hydra import compose, initialize_config_module

from ablate.backends.synthetic import (
    MoEPolicy,
    Replay,
    RolloutEngine,
    mini_batches,
    ppo_loss,
    run_cell_steps,
    sample_prompts,
    token_log_probs,
)
from ablate.backends.synthetic_config import BACKEND
from ablate.compose import cell_from_config


def timed(function: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Mean (CPU, wall) seconds of one call, after one warm-up call."""
    function()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.process_time() - cpu) / repeats, (time.perf_counter() - wall) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cell-steps", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. backend=synthetic_offpolicy policy=mismatch budget=0.25")
    args = parser.parse_args()
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cell, short = [cell_from_config(compose("config", overrides=["policy=full", *args.overrides, f"backend.steps={steps}"]))
                       for steps in (args.cell_steps, args.repeats + 1)]
    cfg = BACKEND.config_of(cell)
    torch.set_num_threads(cfg.threads)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # imports torch's compiler stack once, outside every timing

    prompt_len = 1 + cfg.digits
    seq_len = prompt_len + cfg.response_length - 1
    model = MoEPolicy(cfg, seq_len)
    engine = RolloutEngine(model, cfg, torch.Generator().manual_seed(0))
    prompts = sample_prompts(cfg, torch.Generator().manual_seed(1)).prompts
    rollout = engine.generate(prompts, cfg.response_length, torch.Generator().manual_seed(2))
    inputs, targets = rollout.sequences[:, :-1], rollout.sequences[:, 1:]
    routes = rollout.routes.reshape(-1, cfg.layers, cfg.topk)
    replay = Replay(routes, torch.ones(routes.shape[:2], dtype=torch.bool))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, foreach=True)
    advantages = torch.randn(inputs.shape[0], 1)

    def forward_backward() -> None:
        logits, _, _ = model(inputs)
        model.zero_grad(set_to_none=True)
        (-token_log_probs(logits, targets).mean()).backward()

    def old_log_prob_pass() -> None:
        with torch.no_grad():
            model(inputs, replay=replay)

    def updates() -> None:
        reference = rollout.log_probs
        for rows in mini_batches(cfg):
            tokens = slice(rows.start * seq_len, rows.stop * seq_len)
            logits, _, _ = model(inputs[rows], replay=Replay(routes[tokens], replay.mask[tokens]))
            logp = token_log_probs(logits, targets[rows])[:, prompt_len - 1 :]
            loss, _, _ = ppo_loss(logp, reference[rows], advantages[rows], None, cfg.clip_ratio, cfg.clip_ratio_c)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    baseline_cpu, baseline_wall = timed(forward_backward, args.repeats)
    pieces = {
        "rollout (KV cache)": timed(lambda: engine.generate(prompts, cfg.response_length, torch.Generator()), args.repeats),
        "old-log-prob pass": timed(old_log_prob_pass, args.repeats),
        f"PPO updates ({len(mini_batches(cfg))})": timed(updates, args.repeats),
    }
    step_times: list[tuple[float, float]] = []
    clock = [time.process_time(), time.perf_counter()]

    def lap(step: int, record: dict[str, float]) -> None:
        now = [time.process_time(), time.perf_counter()]
        step_times.append((now[0] - clock[0], now[1] - clock[1]))
        clock[:] = now

    clock[:] = [time.process_time(), time.perf_counter()]
    run_cell_steps(short, lap)
    later = step_times[1:]
    pieces[f"whole step, policy={cell.policy}"] = (sum(c for c, _ in later) / len(later), sum(w for _, w in later) / len(later))

    print(f"baseline: forward + backward of {inputs.shape[0]} sequences x {seq_len} tokens: "
          f"{baseline_cpu * 1e3:.1f} ms CPU ({baseline_wall * 1e3:.1f} ms wall)")
    print(f"{'piece':<28}{'CPU ms':>9}{'x baseline':>12}")
    for name, (cpu, _) in pieces.items():
        print(f"{name:<28}{cpu * 1e3:>9.1f}{cpu / baseline_cpu:>12.2f}")

    cpu, wall = time.process_time(), time.perf_counter()
    run_cell_steps(cell, lambda step, record: None)
    print(f"cell of {args.cell_steps} steps (policy={cell.policy}): {time.process_time() - cpu:.1f} s CPU, "
          f"{time.perf_counter() - wall:.1f} s wall")


if __name__ == "__main__":
    main()
