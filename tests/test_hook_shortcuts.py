"""The verl hook's shortcuts give what the long way gives: each is checked against it on one micro-batch.

- a router's mask, validity and rows decoded from the column packed into its augmented routes are
  the hook's selection for those rows, and rows known on the host (a whole micro-batch) are the
  same rows;
- the native routes of a native pass, taken whole for the same micro-batch, equal the ones
  stitched sequence by sequence for a regrouped micro-batch;
- the Fisher route scores are kept on their routes for their estimate only.
"""

import torch

from ablate import Routes
from ablate.backends.verl.hook_settings import HookSettings
from ablate.fisher import route_scores
from ablate.policies import PolicySpec
from ablate.replay import ReplaySpec
from ablate.replay.seams import CallInfo, split_layers

LAYERS, TOPK, EXPERTS = 4, 3, 12


def routes_of(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, LAYERS, EXPERTS, generator=generator).argsort(-1)[..., :TOPK].to(torch.int16)


def call_info(tokens: int, forward_only: bool = False) -> CallInfo:
    return CallInfo(forward_only=forward_only, last_update=False, num_tokens=tokens, route_layers=LAYERS, topk=TOPK,
                    num_experts=EXPERTS, layer_columns=tuple(range(LAYERS)))


def test_a_routers_mask_and_rows_known_on_the_host_are_those_packed_for_it():
    hook = HookSettings(ReplaySpec(PolicySpec("random"), 0.4, seed=3), engine="veomni").make_hook()
    lengths = [(0, 7, 19), (0, 11)]  # two micro-batches of a call, as offsets
    hook.begin_call(call_info(30))
    for bounds in lengths:
        rows = bounds[-1]
        routes = routes_of(rows, seed=rows)
        r3_mask = torch.arange(rows) % 5 > 0  # tokens outside R3: not valid
        augmented = hook.augmented_routes(0, routes, r3_mask, torch.tensor(bounds), counted=True)
        targets = list(augmented.to(torch.int64).unbind(1))
        block = hook.last_rows  # the rows of the micro-batch just augmented, known on the host
        assert block.stop - block.start == rows
        decoded, known = split_layers(targets, TOPK), split_layers(targets, TOPK, block)
        selection = hook._call.selections[len(hook._call.selections) - 1]
        for column, (layer, shortcut) in enumerate(zip(decoded, known)):
            ids = layer.rows  # row id + 1, decoded from the packed column
            assert torch.equal(ids, torch.arange(block.start + 1, block.stop + 1)) and shortcut.rows == block
            assert torch.equal(layer.mask.reshape(-1), selection.mask[:, column]) and torch.equal(layer.valid, selection.valid)
            part = layer.rows[2:-1]  # a sequence-parallel rank's share of the rows: their ids
            assert torch.equal(part - 1, torch.arange(block.start + 2, block.stop - 1))
    assert int(torch.stack([selection.mask[:, c] for c in range(LAYERS)]).sum()) > 0


def test_native_routes_taken_whole_equal_those_stitched_sequence_by_sequence():
    hook = HookSettings(ReplaySpec(PolicySpec("mismatch"), 0.3, seed=5), engine="megatron").make_hook()
    tokens, bounds = 20, [0, 6, 13, 20]
    rollout = routes_of(tokens, seed=1)
    hook.begin_call(call_info(tokens, forward_only=True), native_pass=True)
    hook.augmented_routes(0, rollout, torch.ones(tokens, dtype=torch.bool), torch.tensor(bounds), counted=True)
    native = routes_of(tokens, seed=2)
    scores = torch.rand(tokens, EXPERTS, generator=torch.Generator().manual_seed(3))
    for column in range(LAYERS):
        reported = slice(0, tokens) if column != 2 else slice(0, 9)  # tokens 9.. of layer 2 unreported
        hook.observe(column, reported, native[reported, column].long(), scores[reported])
    hook.end_call()
    sequence_keys = [key for key, _ in sorted(hook._native_routes.items(), key=lambda item: item[1][1])]
    whole = hook._stitch_native_routes(rollout, torch.tensor(bounds), sequence_keys)
    # The same sequences regrouped (third, then first): stitched from their rows.
    order = [sequence_keys[2], sequence_keys[0]]
    regrouped = torch.cat([rollout[13:20], rollout[0:6]])
    stitched = hook._stitch_native_routes(regrouped, torch.tensor([0, 7, 13]), order)
    for part_whole, part_stitched in zip(whole, stitched):
        assert torch.equal(torch.cat([part_whole[13:20], part_whole[0:6]]), part_stitched)
    routes, known, _ = whole
    assert torch.equal(routes[:, [0, 1, 3]], native[:, [0, 1, 3]].long().to(torch.int16))
    assert known.tolist() == [True] * 9 + [False] * 11


def test_route_scores_are_kept_for_their_estimate_only():
    rollout = routes_of(10, seed=4)
    routes = Routes(rollout=rollout, valid=torch.arange(10) % 3 > 0, num_experts=EXPERTS)
    estimate = torch.rand(LAYERS, EXPERTS, generator=torch.Generator().manual_seed(6))
    first = route_scores(estimate, routes)
    assert route_scores(estimate.clone(), routes) is first  # the same values: the same scores
    other = route_scores(estimate * 2, routes)
    assert torch.allclose(other, 2 * first)
    native = routes.with_native(rollout.flip(-1))
    assert route_scores(estimate * 2, native) is other  # kept with the rollout, whatever the native routes
    expected = estimate[torch.arange(LAYERS)[:, None], rollout.long()].sum(-1) * routes.valid[:, None]
    assert torch.allclose(first, expected)
