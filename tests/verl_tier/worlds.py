"""What the multi-rank tests share: a gloo world per layout, and reading back what its ranks routed."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_layout(world, name: str, policies: list, directory) -> dict:
    """``world.run`` on every rank of ``world.LAYOUTS[name]``; what rank 0 saved."""
    layout = world.LAYOUTS[name]
    path = directory / f"{name}.pt"
    mp.spawn(world.run, args=(layout, free_port(), policies, str(path)), nprocs=layout.world)
    return torch.load(path, weights_only=False)


def merged(per_rank: list[dict]) -> tuple[dict, int]:
    """One map over ranks (of a pass: routes used, outputs per token), and how many entries two ranks hold."""
    merged_map, twice = {}, 0
    for rank_map in per_rank:
        twice += sum(1 for key in rank_map if key in merged_map)
        merged_map.update(rank_map)
    return merged_map, twice


def training_steps(run_call, mine: list[dict], steps: int = 2) -> list[dict]:
    """``steps`` training steps as verl runs them: an old-log-prob call over the rank's micro-batches,
    then one update call per micro-batch, the last one closing the step.

    ``run_call(batches, forward_only=..., last_update=...)`` returns (passes, the pass verl got, metrics).
    """
    results = []
    for _ in range(steps):
        calls = [("log_prob", mine, True, False)]
        calls += [("update", [batch], False, index == len(mine) - 1) for index, batch in enumerate(mine)]
        step = {"calls": [], "metrics": None}
        for name, batches, forward_only, last in calls:
            passes, returned, metrics = run_call(batches, forward_only=forward_only, last_update=last)
            step["calls"].append({"name": name, "passes": passes, "returned": returned})
            step["metrics"] = metrics or step["metrics"]
        results.append(step)
    return results


def gather_ranks(mine: dict) -> list[dict]:
    """Every rank's dict (routes used, outputs per token), one per rank, on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered
