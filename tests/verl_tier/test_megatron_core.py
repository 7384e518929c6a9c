"""``partial_replay`` through Megatron-core 0.16.1's own ``RouterReplay``, route by route, on CPU.

Each layout runs in its own gloo world (``megatron_core_world.py``): one rank, TP=2 with sequence
parallelism, EP=2. For every policy (and ``random`` and ``fisher`` handed router by router), two
training steps of two micro-batches, each replayed forward and then recomputed with gradients:

- every (row, layer) is routed on exactly one rank, to the rollout's experts where the mask the
  policy chooses (computed here apart, from a fresh session) replays it and to the router's own
  top-k elsewhere, in the forward and, identically, in the recompute;
- the step's counts are the budget's, every route counted once: the same keys in every layout;
- the Fisher estimate is the router-logit gradients' (per-token squares of the valid rows);
- a GPT-MoE model from Megatron's own classes, run as the issue's snippet with full activation
  recompute, routes every token of both MoE layers so.
"""

import math

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402

import megatron_core_world as world  # noqa: E402
from ablate.budget import count_for  # noqa: E402
from ablate.diagnostics.schema import check_record  # noqa: E402
from ablate.policies import PolicySpec, available_policies  # noqa: E402
from ablate.replay import ReplaySession, ReplaySpec  # noqa: E402
from ablate.replay.batch import select_micro_batch  # noqa: E402
from ablate.routes import native_margin  # noqa: E402
from worlds import merged, run_layout  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.slow]

#: (policy, budget, settings, handed router by router). The example policy package runs where installed.
POLICIES = [("none", None, {}, False), ("full", None, {}, False), ("random", 0.4, {}, False),
            ("uniform", 0.5, {}, False), ("fisher", 0.3, {}, False), ("mismatch", 0.5, {}, False),
            ("random", 0.4, {}, True), ("fisher", 0.3, {}, True),
            *([("margin", 0.4, {}, False)] if "margin" in available_policies() else [])]
COUNTS = ("replay/valid_routes", "replay/replayed_routes", "replay/unrecorded_routes")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return {name: run_layout(world, name, POLICIES, tmp_path_factory.mktemp(name)) for name in world.LAYOUTS}


def bits(experts: torch.Tensor) -> int:
    return int(sum(1 << int(expert) for expert in experts))


def expected_masks(policy, budget, settings, per_router, step, fisher_before) -> list[torch.Tensor]:
    """Each micro-batch's ``[tokens, layers]`` mask, chosen apart by a fresh session with the run's settings.

    A ``fisher`` session reads the estimate the run had before ``step`` (rebuilt from the run's
    gradients); a policy that needs native routes gets them from the step's logits.
    """
    spec = ReplaySpec(PolicySpec(policy, settings), budget, seed=5)
    session = ReplaySession(spec, world.NUM_LAYERS, world.NUM_EXPERTS, world.TOPK)
    for sums in fisher_before:
        session.tracker.accumulate((sums[0] / sums[1].clamp(min=1))[None], sums[1][None])
        session.tracker.step()
    masks = []
    for index, lengths in enumerate(world.MICRO_BATCHES):
        tokens = sum(lengths)
        routes = world.rollout_routes(index, tokens, world.NUM_LAYERS)
        logits = world.router_logits(index, step)
        native = logits.topk(world.TOPK, dim=-1).indices.permute(1, 0, 2)
        margins = torch.stack([native_margin(logits[layer], native[:, layer]) for layer in range(world.NUM_LAYERS)], 1)
        columns = [[layer] for layer in range(world.NUM_LAYERS)] if per_router else [list(range(world.NUM_LAYERS))]
        parts = []
        for column in columns:
            extra = {}
            if session.needs_native:
                extra = dict(native=native[:, column], has_native=torch.ones(tokens, dtype=torch.bool),
                             native_margin=margins[:, column])
            parts.append(select_micro_batch(session, routes[:, column], torch.ones(tokens, dtype=torch.bool),
                                            world.offsets_of(index), world.NUM_EXPERTS,
                                            layer=column[0] if per_router else None, **extra).mask)
        masks.append(torch.cat(parts, dim=1))
    return masks


def test_every_route_is_the_rollouts_where_the_mask_says_and_the_routers_own_elsewhere(layouts):
    for name, result in layouts.items():
        for (policy, budget, settings, per_router) in POLICIES:
            steps = result["routers"][(policy, per_router)]["steps"]
            for step, outcome in enumerate(steps):
                where = f"{name}, {policy}{' per router' if per_router else ''}, step {step}"
                masks = expected_masks(policy, budget, settings, per_router, step,
                                       [earlier["grad_squares"] for earlier in steps[:step]])
                forward, twice = merged(outcome["passes"]["forward"]["used"])
                native, _ = merged(outcome["passes"]["forward"]["native"])
                recompute, _ = merged(outcome["passes"]["recompute"]["used"])
                assert twice == 0, f"{where}: a (row, layer) routed on two ranks"
                assert recompute == forward, f"{where}: the recompute routed otherwise than the forward"
                for index, mask in enumerate(masks):
                    routes = world.rollout_routes(index, mask.shape[0], world.NUM_LAYERS)
                    for token in range(mask.shape[0]):
                        row = world.first_row(index) + token
                        for layer in range(world.NUM_LAYERS):
                            key = (row, layer + 1)
                            expected = bits(routes[token, layer]) if mask[token, layer] else native[key]
                            assert forward[key] == expected, f"{where}: row {row} layer {layer + 1}"
                replayed = sum(int(mask.sum()) for mask in masks)
                assert outcome["metrics"]["replay/replayed_routes"] == replayed, where
                assert check_record(outcome["metrics"]) == [], where


def budget_count(policy: str, budget, per_router: bool) -> int:
    """floor(b * N + 0.5) of each sequence's valid routes, handed together (every layer) or router by router."""
    resolved = ReplaySpec(PolicySpec(policy), budget).budget
    total = 0
    for index, lengths in enumerate(world.MICRO_BATCHES):
        start = 0
        for length in lengths:
            tokens = sum(1 for token in range(start, start + length)
                         if index != 0 or not world.GAP[0] <= token < world.GAP[1])
            parts = [1] * world.NUM_LAYERS if per_router else [world.NUM_LAYERS]
            total += sum(count_for(resolved, tokens * layers) for layers in parts)
            start += length
    return total


def test_the_count_is_the_budgets_each_route_counted_once_in_every_layout(layouts):
    gap_routes = (world.GAP[1] - world.GAP[0]) * world.NUM_LAYERS
    valid = sum(sum(lengths) for lengths in world.MICRO_BATCHES) * world.NUM_LAYERS - gap_routes
    for (policy, budget, _, per_router) in POLICIES:
        reference = layouts["single"]["routers"][(policy, per_router)]["steps"]
        for step in reference:
            metrics = step["metrics"]
            assert metrics["replay/valid_routes"] == valid and metrics["replay/unrecorded_routes"] == gap_routes
            assert metrics["replay/replayed_routes"] == budget_count(policy, budget, per_router), policy
        for name in ("tp2_sp", "ep2"):
            for step, other in zip(reference, layouts[name]["routers"][(policy, per_router)]["steps"]):
                for key, value in step["metrics"].items():
                    same = (math.isnan(value) and math.isnan(other["metrics"][key])) or math.isclose(
                        value, other["metrics"][key], rel_tol=1e-9, abs_tol=1e-12)
                    assert same, f"{name}, {policy}: {key} {other['metrics'][key]} != {value} on one rank"


def test_the_fisher_estimate_is_the_router_logit_gradients_in_every_layout(layouts):
    for name, result in layouts.items():
        for (policy, _, _, per_router) in POLICIES:
            first = result["routers"][(policy, per_router)]["steps"][0]
            sums = first["grad_squares"]
            assert float(sums[0].sum()) > 0, f"{name}, {policy}: no gradient reached the routers"
            # the tracker keeps float32
            assert torch.allclose(first["fisher"].double(), sums[0] / sums[1], rtol=1e-6, atol=0), f"{name}, {policy}"
            reference = layouts["single"]["routers"][(policy, per_router)]["steps"][0]["fisher"]
            assert torch.allclose(first["fisher"], reference, rtol=1e-6, atol=0), f"{name}, {policy}"


def test_a_gpt_moe_model_replays_the_snippets_budget_through_forward_and_recompute(layouts):
    for name, result in layouts.items():
        gpt = result["gpt"]
        forward, twice = merged(gpt["forward"])
        recompute, _ = merged(gpt["recompute"])
        assert twice == 0, f"{name}: a (row, layer) routed on two ranks"
        assert {key: used for key, (used, _) in recompute.items()} == {key: used for key, (used, _) in forward.items()}
        routes_of, _ = merged(gpt["routes"])
        spec = ReplaySpec.of("random", 0.25, seed=0)
        replayed = 0
        for micro_batch, routes in routes_of.items():
            session = ReplaySession(spec, world.GPT_LAYERS, world.NUM_EXPERTS, world.TOPK)
            everything = torch.ones(world.GPT_TOKENS, dtype=torch.bool)
            mask = select_micro_batch(session, routes, everything, torch.tensor([0, world.GPT_TOKENS]),
                                      world.NUM_EXPERTS).mask
            assert int(mask.sum()) == count_for(0.25, world.GPT_TOKENS * world.GPT_LAYERS)
            replayed += int(mask.sum())
            for token in range(world.GPT_TOKENS):
                for layer in range(world.GPT_LAYERS):
                    used, own = forward[(1 + world.GPT_TOKENS * micro_batch + token, layer + 1)]
                    assert used == (bits(routes[token, layer]) if mask[token, layer] else own), f"{name}: {token}, {layer}"
        assert len(forward) == len(routes_of) * world.GPT_TOKENS * world.GPT_LAYERS
        assert gpt["metrics"]["replay/replayed_routes"] == replayed, name
        assert gpt["metrics"]["replay/budget_realized"] == 0.25 and check_record(gpt["metrics"]) == [], name


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    import torch.multiprocessing as mp

    from worlds import free_port

    path = tmp_path_factory.mktemp("edges") / "edges.pt"
    mp.spawn(world.edges, args=(free_port(), str(path)), nprocs=1)
    return torch.load(path, weights_only=False)


def test_record_and_routers_outside_the_context_are_megatrons_and_every_name_is_restored(edges):
    assert edges["record"] == "no error"  # RECORD passes alone are no replay that failed
    assert all(torch.equal(recorded, native) for recorded, native in zip(edges["recorded"], edges["natives"]))
    assert len(edges["inside"]) == 4 and not any(edges["inside"].values())  # replaced inside the context
    for moment in ("after_record", "after_refusal", "after_crash"):
        assert len(edges[moment]) == 4 and all(edges[moment].values()), moment
    assert edges["crash"] == "\"the loop's own error\""  # the loop's error, not one of ablate's
    for routing_map, routes in zip(edges["full_outside"], edges["routes"]):  # Megatron-core's own full replay
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(-1, routes, True))


def test_a_context_that_replays_nothing_fails_in_one_line_naming_the_policy(edges):
    for case in ("native_routing", "handed_outside"):
        message = edges[case]
        assert message.startswith("NothingReplayed: partial_replay(policy=random, budget=0.4) replayed no route: "
                                  f"{world.NUM_LAYERS} router calls in the context and none was given ablate's "
                                  "targets"), case
        assert "\n" not in message
    assert edges["none_policy"] == "no error"  # none replays nothing by definition
    assert edges["mismatch_without_native_pass"].startswith(
        "NativeRoutesMissing: partial_replay(policy=mismatch) selects on native routes")
    assert edges["bad_budget"].startswith("BudgetError: budget=1.5 in policy=random: expected a fraction in [0, 1]")
    assert edges["float_routes"] == ("ReplayDataError: replay data of torch.float32 (16, 2) for a router: expected "
                                     "integer expert ids [rows, topk]")
    assert edges["bad_boundaries"] == ("ReplayDataError: replay.sequences([0, 9, 4]): expected non-decreasing integer "
                                       "row offsets [0, ..., rows], one more than the sequences")
    assert edges["boundaries_elsewhere"] == ("ReplayDataError: replay.sequences(...) ends at row 9, and the replay "
                                             "data hold 16 rows: expected boundaries over the whole micro-batch")


def test_a_router_call_waits_for_the_host_no_more_than_megatrons_own_replay(edges):
    assert edges["syncs"]["known"] == ["index.Tensor", "_local_scalar_dense.default"]
    assert edges["syncs"]["ablate"] == edges["syncs"]["megatron"]
