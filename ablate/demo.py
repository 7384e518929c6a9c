"""``python -m ablate.demo``: every policy's replay mask and diagnostics on a generated routing batch.

A stand-in main job until the synthetic backend lands: it builds a Qwen3-like routing batch
(rollout routes, native routes that disagree near router ties, a Fisher estimate), asks each
policy for a mask at the same budget, and prints one row of diagnostics per policy.
"""

from __future__ import annotations

import torch

from ablate import Routes, get_policy
from ablate.diagnostics import route_diagnostics, validate_record


def generated_batch(tokens: int = 2048, layers: int = 8, experts: int = 32, topk: int = 4, seed: int = 0) -> Routes:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, layers, experts, generator=g)
    noisy = logits + 0.05 * torch.randn(tokens, layers, experts, generator=g)  # the inference engine's numerics
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[: tokens // 8] = False  # left padding
    return Routes(
        rollout=noisy.topk(topk, -1).indices.to(torch.int16),
        valid=valid,
        num_experts=experts,
        native=logits.topk(topk, -1).indices.to(torch.int16),
        router_logits=logits,
    )


def main(budget: float = 0.25) -> None:
    routes = generated_batch()
    fisher = torch.rand(routes.num_layers, routes.num_experts, generator=torch.Generator().manual_seed(1)) ** 4
    columns = ["replay/replayed_routes", "replay/override_rate", "routing/mismatch_recall",
               "routing/residual_mismatch_rate", "replay/fisher_mass", "load/entropy_norm"]
    print(f"{routes.num_valid_tokens} valid tokens x {routes.num_layers} layers, {routes.num_experts} experts, "
          f"top-{routes.topk}; budget {budget} for the budgeted policies")
    print(f"{'policy':<10}" + "".join(f"{c.split('/')[1]:>24}" for c in columns))
    for name in ("none", "full", "random", "uniform", "fisher", "mismatch"):
        policy = get_policy(name, scores=fisher) if name == "fisher" else get_policy(name)
        b = {"none": 0.0, "full": 1.0}.get(name, budget)
        mask = policy.select(routes, b, generator=torch.Generator().manual_seed(0))
        record = route_diagnostics(routes, mask, b, fisher_scores=fisher)
        validate_record(record)
        print(f"{name:<10}" + "".join(f"{record[c]:>24.4g}" for c in columns))


if __name__ == "__main__":
    main()
