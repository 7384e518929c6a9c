"""Masks and route counts of fixed batches, pinned to the values the kernels gave before they were sped up.

The route kernels (the recorded-route check, the rollout-native overlap, the Fisher route
scores, the batched top-n) and the verl hook's selection and counters are rewritten for speed
now and then; every such rewrite must leave every mask bit and every count unchanged. Each
case below hashes what one policy selects, in the global and the per-sequence mode, and the
counts behind every ``replay/`` and ``routing/`` key, on batches built to reach every branch:
ragged sequences with a one-token sequence, padding, native routes that equal the rollout's,
permute it, share some experts or none, more than 128 experts and an odd top-k; for the hook,
R3's final-token mask, a multi-turn gap of zeros, a duplicated expert, ids out of range,
tokens without native routes. Fisher estimates are multiples of 1/8, so every float count is
exact whatever the summation order.

When a pin fails, the message shows the values now computed. A deliberate change of semantics
updates ``PINNED`` with ``python tests/test_pinned_results.py``, which prints the current
values; a speed-up never does.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch

from ablate import Routes, get_policy
from ablate.diagnostics import ROUTE_COUNTS, expert_load, route_counts
from ablate.fisher import route_scores
from ablate.policies import PolicySpec
from ablate.replay import ReplaySession, ReplaySpec
from ablate.replay.batch import counted_routes, select_micro_batch

POLICIES = {
    "random": ("random", {}),
    "random-per-layer": ("random", {"per_layer": True}),
    "uniform": ("uniform", {}),
    "fisher": ("fisher", {"scores": True}),
    "fisher-tau1": ("fisher", {"scores": True, "tau": 1.0}),
    "fisher-per-layer": ("fisher", {"scores": True, "per_layer": True}),
    "fisher-fallback": ("fisher", {}),
    "mismatch": ("mismatch", {}),
    "mismatch-per-layer": ("mismatch", {"per_layer": True}),
    "full": ("full", {}),
    "none": ("none", {}),
}


def digest(*parts) -> str:
    """A short hash of tensors (dtype, shape and bytes), numbers, strings and dicts of them."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().cpu().contiguous()
            h.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(part, dict):
            h.update(repr(sorted((key, float(value)) for key, value in part.items())).encode())
        else:
            h.update(repr(part).encode())
    return h.hexdigest()


def fisher_estimate(layers: int, experts: int, seed: int) -> torch.Tensor:
    """Multiples of 1/8 in [0, 8), about a tenth of them zero: ties, and exact sums."""
    generator = torch.Generator().manual_seed(seed)
    estimate = torch.randint(0, 64, (layers, experts), generator=generator).float() / 8
    estimate[torch.rand(layers, experts, generator=generator) < 0.1] = 0.0
    return estimate


def mixed_native(rollout: torch.Tensor, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Native routes that equal the rollout's (half), permute it, replace some experts, or all of them."""
    tokens, layers, topk = rollout.shape
    fresh = torch.rand(tokens, layers, experts, generator=generator).argsort(-1)[..., :topk].to(rollout.dtype)
    permuted = rollout[..., torch.randperm(topk, generator=generator)]
    # Replace the last j experts with fresh ones that the rollout route does not hold.
    partial = rollout.clone()
    unused = torch.rand(tokens, layers, experts, generator=generator)
    unused.scatter_(-1, rollout.long(), 2.0)  # the rollout's own experts sort last
    outside = unused.argsort(-1)[..., :topk].to(rollout.dtype)
    replaced = torch.randint(1, topk + 1, (tokens, layers, 1), generator=generator)
    slot = torch.arange(topk)
    partial = torch.where(slot >= topk - replaced, outside, partial)
    kind = torch.rand(tokens, layers, 1, generator=generator)
    native = torch.where(kind < 0.5, rollout, permuted)
    native = torch.where((kind >= 0.7) & (kind < 0.9), partial, native)
    return torch.where(kind >= 0.9, fresh, native)


def routes_batch(lengths, layers, experts, topk, seed) -> Routes:
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    rollout = torch.rand(tokens, layers, experts, generator=generator).argsort(-1)[..., :topk].to(torch.int16)
    native = mixed_native(rollout, experts, generator)
    valid = torch.rand(tokens, generator=generator) >= 0.15
    rollout[~valid], native[~valid] = 0, 0
    return Routes(rollout=rollout, valid=valid, num_experts=experts, native=native,
                  offsets=torch.tensor([0, *lengths]).cumsum(0))


BATCHES = {
    "wide": lambda: routes_batch([37, 64, 1, 23, 50], layers=6, experts=160, topk=8, seed=1),
    "odd-topk": lambda: routes_batch([5, 9, 16, 1], layers=4, experts=12, topk=3, seed=2),
}


def policy_for(label: str, routes: Routes):
    name, settings = POLICIES[label]
    if settings.get("scores"):
        settings = {**settings, "scores": fisher_estimate(routes.num_layers, routes.num_experts, seed=3)}
    return get_policy(name, **settings)


def budget_for(label: str) -> float:
    return {"full": 1.0, "none": 0.0}.get(label, 0.3)


def summary(mask: torch.Tensor, counts: dict[str, float]) -> str:
    """What a failing pin shows: the mask's size and the counts now computed."""
    return f"{int(mask.sum())} of {mask.numel()} routes replayed; counts {counts}"


def routes_results() -> dict[str, tuple[str, str]]:
    """Per batch: overlap, Fisher scores, load; per policy and mode: the mask and its route counts."""
    results = {}
    for batch_name, build in BATCHES.items():
        routes = build()
        estimate = fisher_estimate(routes.num_layers, routes.num_experts, seed=3)
        overlap, scores = routes.native_overlap, route_scores(estimate, routes)
        results[f"{batch_name}/overlap"] = digest(overlap), f"overlap {overlap.tolist()}"
        results[f"{batch_name}/scores"] = digest(scores), f"scores {scores.tolist()}"
        loads = expert_load(routes), expert_load(Routes(rollout=routes.rollout, valid=routes.valid,
                                                        num_experts=routes.num_experts))
        results[f"{batch_name}/load"] = digest(*loads), f"loads {[load.tolist() for load in loads]}"
        for label in POLICIES:
            for mode in ("global", "per-sequence"):
                policy = policy_for(label, routes)
                if mode == "global":
                    mask = policy.select(routes, budget_for(label), generator=torch.Generator().manual_seed(11))
                else:
                    generators = [torch.Generator().manual_seed(100 + s) for s in range(routes.num_sequences)]
                    mask = policy.select(routes, budget_for(label), generator=generators, per_sequence=True)
                counts = route_counts(routes, mask, fisher_scores=estimate)
                results[f"{batch_name}/{label}/{mode}"] = digest(mask, counts, dict(policy.info)), summary(mask, counts)
    return results


def hook_batch(seed: int = 4):
    """A verl micro-batch as the hook receives it, with everything R3 accepts and the rollout did not record."""
    lengths, layers, experts, topk = [9, 30, 1, 17, 24], 5, 160, 8
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    rollout = torch.rand(tokens, layers, experts, generator=generator).argsort(-1)[..., :topk].to(torch.int16)
    native = mixed_native(rollout, experts, generator)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    rollout[offsets[1:] - 1] = 0  # verl's placeholder for each final token
    rollout[12:15] = 0  # a multi-turn gap
    rollout[20, 2, 3] = rollout[20, 2, 5]  # an expert twice
    rollout[31, 4, 0] = experts  # out of range
    rollout[44, 0, 7] = -1
    r3_mask = torch.ones(tokens, dtype=torch.bool)
    r3_mask[offsets[1:] - 1] = False
    r3_mask[60:64] = False  # a sequence without a response
    return rollout, native, r3_mask, offsets, experts


def hook_results() -> dict[str, tuple[str, str]]:
    """Per hooked policy: the micro-batch's selection and counts, with native routes from every router or not."""
    rollout, native, r3_mask, offsets, experts = hook_batch()
    tokens, layers, _ = rollout.shape
    estimate = fisher_estimate(layers, experts, seed=5)
    known = torch.ones(tokens, dtype=torch.bool)
    known[40:47] = False  # sequences the old-log-prob pass did not see
    observed = native + 1
    partly_observed = observed.clone()
    partly_observed[25] = 0  # a valid token no router reported
    results = {}
    for label in ("random", "random-per-layer", "uniform", "fisher", "fisher-tau1", "fisher-fallback", "mismatch",
                  "mismatch-per-layer", "full", "none"):
        name, settings = POLICIES[label]
        if settings.get("scores"):
            settings = {**settings, "scores": estimate}
        session = ReplaySession(ReplaySpec(PolicySpec(name), budget_for(label), seed=9), layers, experts, 8)
        session.policy = get_policy(name, **settings)  # a fixed estimate, where it has one
        session.fisher_scores = lambda: estimate  # every policy's Fisher mass against the same estimate
        extra = {"native": native, "has_native": known} if name == "mismatch" else {}
        selection = select_micro_batch(session, rollout, r3_mask, offsets, experts, **extra)
        fallback = session.counts is not None and session.read_counts(session.counts)["fisher_fallback"] > 0
        parts = [selection.mask, selection.valid, int(selection.unrecorded), fallback, selection.keys]
        for buffer_name, buffer in (("observed", observed), ("partly-observed", partly_observed)):
            into = session.new_counts()
            routes, unobserved = counted_routes(selection, buffer - 1, experts)  # native ids, -1: none reported
            session.count(routes, selection.mask, unrecorded=selection.unrecorded, unobserved=unobserved, into=into)
            counts = {key: value for key, value in session.read_counts(into).items() if key in ROUTE_COUNTS}
            results[f"hook/{label}/{buffer_name}"] = (
                digest(*parts, counts), f"{selection.unrecorded} unrecorded; {summary(selection.mask, counts)}")
    return results


#: Computed by the kernels before the speed-ups (``python tests/test_pinned_results.py``); the hook cases re-pinned
#: once when the per-sequence streams moved to the one seed scheme (ablate/seeding.py).
PINNED: dict[str, str] = {
    'wide/overlap': '043eb161e90c765a',
    'wide/scores': '419c10e83ee91a5c',
    'wide/load': '65ce60756ce04deb',
    'wide/random/global': '6428ae0b83e1bfdd',
    'wide/random/per-sequence': '583e493fc178944b',
    'wide/random-per-layer/global': '20f2c1903ae10d3f',
    'wide/random-per-layer/per-sequence': '9ae9492bafab2ebf',
    'wide/uniform/global': '8d312a0803e45a89',
    'wide/uniform/per-sequence': 'f96dd91073ded209',
    'wide/fisher/global': '67e7b1553be1623e',
    'wide/fisher/per-sequence': '7b46f27b1a513d63',
    'wide/fisher-tau1/global': 'a3b4e4fe775ba27b',
    'wide/fisher-tau1/per-sequence': 'a2434e2413d5407a',
    'wide/fisher-per-layer/global': 'd31eca3f9fe8e387',
    'wide/fisher-per-layer/per-sequence': 'c6ee39cc0022be91',
    'wide/fisher-fallback/global': 'a496fe795642e7c0',
    'wide/fisher-fallback/per-sequence': '8284b22ac3678786',
    'wide/mismatch/global': '38c225d05260a6c3',
    'wide/mismatch/per-sequence': 'fae20e86afb89ee5',
    'wide/mismatch-per-layer/global': 'e8066e16178a877d',
    'wide/mismatch-per-layer/per-sequence': 'ac63e94df51b4c11',
    'wide/full/global': '485640a0adfa9953',
    'wide/full/per-sequence': '485640a0adfa9953',
    'wide/none/global': '4f25ca319af4780b',
    'wide/none/per-sequence': '4f25ca319af4780b',
    'odd-topk/overlap': '8de7d34f971f56ed',
    'odd-topk/scores': '9d49d21534b956f2',
    'odd-topk/load': 'be090ae5e947ce65',
    'odd-topk/random/global': 'f008465f6fdb5159',
    'odd-topk/random/per-sequence': '8b1217f591066512',
    'odd-topk/random-per-layer/global': '52bb91a9b9c57161',
    'odd-topk/random-per-layer/per-sequence': 'af41b6d7a9d2273a',
    'odd-topk/uniform/global': 'da5ce6c5074148c5',
    'odd-topk/uniform/per-sequence': 'd766d382cc49c75a',
    'odd-topk/fisher/global': 'badd7e3d75850f05',
    'odd-topk/fisher/per-sequence': '853d7f741ec5bce5',
    'odd-topk/fisher-tau1/global': '157db61168d87b8d',
    'odd-topk/fisher-tau1/per-sequence': 'a075b418d3c633bc',
    'odd-topk/fisher-per-layer/global': 'd9ec1e9caaae3275',
    'odd-topk/fisher-per-layer/per-sequence': 'e3fcc2d6238af41c',
    'odd-topk/fisher-fallback/global': 'a2532abd79a44dcd',
    'odd-topk/fisher-fallback/per-sequence': '95c5d257231ea165',
    'odd-topk/mismatch/global': '02fad8b66c098ff5',
    'odd-topk/mismatch/per-sequence': 'bbc2708c9b8c64ef',
    'odd-topk/mismatch-per-layer/global': '02fad8b66c098ff5',
    'odd-topk/mismatch-per-layer/per-sequence': 'e56a6080033b192e',
    'odd-topk/full/global': '99fb2a150097fa75',
    'odd-topk/full/per-sequence': '99fb2a150097fa75',
    'odd-topk/none/global': 'd658c12e795e14e3',
    'odd-topk/none/per-sequence': 'd658c12e795e14e3',
    'hook/random/observed': 'c4c2be67ff641b01',
    'hook/random/partly-observed': 'fabad359367762d4',
    'hook/random-per-layer/observed': 'ed06aedf9d8b4d62',
    'hook/random-per-layer/partly-observed': '6de5bf8bb6a8d84f',
    'hook/uniform/observed': '4fbf5c017957c13a',
    'hook/uniform/partly-observed': 'c2c34d5825f75004',
    'hook/fisher/observed': '9b479053d94579db',
    'hook/fisher/partly-observed': 'faa28c447929d1be',
    'hook/fisher-tau1/observed': 'd2df7ce8065f3b50',
    'hook/fisher-tau1/partly-observed': '59d9902c32204736',
    'hook/fisher-fallback/observed': 'b1da5393389552bb',
    'hook/fisher-fallback/partly-observed': '24c89efb5bcd1da7',
    'hook/mismatch/observed': '6437e78ee24bfc36',
    'hook/mismatch/partly-observed': '82cf4b21e1865006',
    'hook/mismatch-per-layer/observed': '914c4269e05add75',
    'hook/mismatch-per-layer/partly-observed': '759a7ca31992b374',
    'hook/full/observed': 'ebed1816d19dc18a',
    'hook/full/partly-observed': 'aeb7cdd40034efd0',
    'hook/none/observed': 'a9cf4df72015586f',
    'hook/none/partly-observed': '3a3a8feb54777363',
}


@pytest.fixture(scope="module")
def current() -> dict[str, tuple[str, str]]:
    return {**routes_results(), **hook_results()}


def test_every_case_is_pinned(current):
    assert sorted(current) == sorted(PINNED)


@pytest.mark.parametrize("case", sorted(PINNED))
def test_results_equal_their_pins(current, case):
    value, now = current[case]
    assert value == PINNED[case], f"{case}: the mask or a count changed (see the module docstring); now: {now}"


if __name__ == "__main__":
    sys.stdout.write("PINNED: dict[str, str] = {\n")
    for case, (value, _) in {**routes_results(), **hook_results()}.items():
        sys.stdout.write(f"    {case!r}: {value!r},\n")
    sys.stdout.write("}\n")
