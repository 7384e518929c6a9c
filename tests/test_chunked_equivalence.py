"""The chunked route kernels equal straightforward full-size references on random batches.

The cases shrink the chunk size so that batches of a few dozen tokens cross several chunk
boundaries, including a partial last chunk and chunks of a single token.
"""

import pytest
import torch

import ablate.routes
from ablate import Routes, RoutesError, get_policy, replay_count
from ablate.diagnostics import expert_load, route_diagnostics
from ablate.fisher import route_scores
from ablate.routes import group_chunks, overlap_count, token_chunks


def reference_overlap(a, b):
    return (a[..., :, None] == b[..., None, :]).any(-1).sum(-1, dtype=torch.int32)


def reference_load(routes, mask):
    load = torch.zeros(routes.num_layers, routes.num_experts, dtype=torch.long)
    for token in routes.valid.nonzero().squeeze(1).tolist():
        for layer in range(routes.num_layers):
            if routes.native is None:
                ids = routes.rollout[token, layer]
            elif mask is None or not mask[token, layer]:
                ids = routes.native[token, layer]
            else:
                ids = routes.rollout[token, layer]
            for expert in ids.tolist():
                load[layer, expert] += 1
    return load


def reference_scores(estimate, routes):
    """Score of each valid route; invalid tokens score 0 (their ids are never read)."""
    layers = torch.arange(routes.num_layers)[None, :, None]
    return estimate[layers, routes.rollout.long()].sum(-1) * routes.valid[:, None]


def random_batch(tokens, layers, experts, topk, seed, *, all_valid=False, dtype=torch.int16):
    """Distinct ids per route on valid tokens; invalid tokens hold verl's zero padding."""
    g = torch.Generator().manual_seed(seed)
    rollout = torch.rand(tokens, layers, experts, generator=g).argsort(-1)[..., :topk]
    native = rollout.clone()
    swapped = torch.rand(tokens, layers, experts, generator=g).argsort(-1)[..., :topk]
    keep = torch.rand(tokens, layers, 1, generator=g) < 0.5
    native = torch.where(keep, native.flip(-1), swapped)  # same set reordered, or a fresh route
    valid = torch.ones(tokens, dtype=torch.bool) if all_valid else torch.rand(tokens, generator=g) < 0.7
    valid[tokens // 2] = True
    rollout[~valid] = 0
    native[~valid] = 0
    return Routes(rollout=rollout.to(dtype), valid=valid, num_experts=experts, native=native.to(dtype))


SHAPES = [  # tokens, layers, experts, topk
    (37, 3, 100, 8),  # the packed top-8 path; experts not a multiple of 64
    (41, 2, 130, 3),
    (29, 4, 5, 1),
    (23, 1, 64, 2),
    (50, 3, 8, 8),  # topk == experts
]


#: Tokens per chunk: single tokens, chunks that leave a partial last one, and one chunk for all.
CHUNK_TOKENS = pytest.mark.parametrize("chunk_tokens", [1, 5, 10**6], ids=["1-token", "5-tokens", "one-chunk"])


def use_chunks(monkeypatch, routes, chunk_tokens):
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", chunk_tokens * routes.num_layers * routes.topk)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("all_valid", [False, True], ids=["padded", "all-valid"])
@CHUNK_TOKENS
def test_kernels_equal_references(shape, all_valid, chunk_tokens, monkeypatch):
    routes = random_batch(*shape, seed=sum(shape), all_valid=all_valid)
    use_chunks(monkeypatch, routes, chunk_tokens)
    # Overlap is defined on every token, padding with duplicate ids included.
    assert torch.equal(overlap_count(routes.rollout, routes.native), reference_overlap(routes.rollout, routes.native))
    mask = torch.rand(routes.num_tokens, routes.num_layers, generator=torch.Generator().manual_seed(3)) < 0.4
    for m in (None, mask):
        assert torch.equal(expert_load(routes, m), reference_load(routes, m))
    estimate = torch.rand(routes.num_layers, routes.num_experts, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(route_scores(estimate, routes), reference_scores(estimate, routes))


@CHUNK_TOKENS
def test_load_without_native_counts_rollout(chunk_tokens, monkeypatch):
    full = random_batch(31, 2, 70, 4, seed=9)
    routes = Routes(rollout=full.rollout, valid=full.valid, num_experts=70)
    use_chunks(monkeypatch, routes, chunk_tokens)
    assert torch.equal(expert_load(routes), reference_load(routes, None))


@CHUNK_TOKENS
def test_overlap_of_mixed_dtypes_and_strided_inputs(chunk_tokens, monkeypatch):
    routes = random_batch(33, 3, 90, 8, seed=2)
    use_chunks(monkeypatch, routes, chunk_tokens)
    a = routes.rollout.long().transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous layout
    assert torch.equal(overlap_count(a, routes.native.int()), reference_overlap(routes.rollout, routes.native))


@pytest.mark.parametrize("name, settings", [
    ("random", {}), ("random", {"per_layer": True}), ("uniform", {}), ("mismatch", {}),
    ("fisher", {"scores": torch.rand(3, 100, generator=torch.Generator().manual_seed(0))}),
])
@pytest.mark.parametrize("all_valid", [False, True], ids=["padded", "all-valid"])
def test_masks_and_diagnostics_do_not_depend_on_chunking(name, settings, all_valid, monkeypatch):
    routes = random_batch(45, 3, 100, 8, seed=11, all_valid=all_valid)
    policy = get_policy(name, **settings)

    def run():
        mask = policy.select(routes, 0.3, generator=torch.Generator().manual_seed(5))
        return mask, route_diagnostics(routes, mask, 0.3, fisher_scores=settings.get("scores"))

    whole_mask, whole = run()
    use_chunks(monkeypatch, routes, 7)
    chunked_mask, chunked = run()
    assert torch.equal(whole_mask, chunked_mask)
    assert not (whole_mask & ~routes.valid[:, None]).any()
    assert int(whole_mask.sum()) == replay_count(0.3, routes, per_layer=policy.per_layer)
    assert chunked.keys() == whole.keys()
    for key, value in whole.items():
        assert chunked[key] == pytest.approx(value, nan_ok=True, rel=1e-6), key


@pytest.mark.parametrize("name, settings", [
    ("random", {}), ("random", {"per_layer": True}), ("uniform", {}), ("mismatch", {"per_layer": True}),
    ("fisher", {"scores": torch.rand(3, 100, generator=torch.Generator().manual_seed(0)).round(decimals=1)}),
])
@pytest.mark.parametrize("chunk_ids", [1, 8 * 60, 10**9], ids=["1-group", "some-groups", "one-chunk"])
def test_per_sequence_masks_do_not_depend_on_chunking(name, settings, chunk_ids, monkeypatch):
    full = random_batch(45, 3, 100, 8, seed=12)
    # Ragged sequences, one of them empty: 7 + 12 + 0 + 1 + 25 = 45 tokens.
    routes = Routes(rollout=full.rollout, valid=full.valid, num_experts=100, native=full.native,
                    offsets=torch.tensor([0, 7, 19, 19, 20, 45]))
    policy = get_policy(name, **settings)

    def run():
        generators = [torch.Generator().manual_seed(s) for s in range(5)]
        return policy.select(routes, 0.3, generator=generators, per_sequence=True)

    whole = run()
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", chunk_ids)
    assert len(group_chunks(routes.valid_offsets.diff().tolist())) > 1 or chunk_ids == 10**9
    assert torch.equal(whole, run())
    assert int(whole.sum()) == replay_count(0.3, routes, per_sequence=True)


def test_group_chunks_pair_groups_of_similar_size(monkeypatch):
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", 8 * 12)  # rows of at most 12 entries a chunk
    assert group_chunks([3, 6, 5, 1, 2, 40]) == [[5], [1, 2], [0, 4], [3]]  # 40 alone; 6, 5; 3, 2; 1
    assert group_chunks([4, 4, 4, 4]) == [[0, 1, 2], [3]]
    assert group_chunks([0, 0]) == [[0, 1]]


def test_token_chunks_cover_the_valid_tokens_in_order(monkeypatch):
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", 12)
    assert token_chunks(10, 4) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    valid = torch.tensor([True, False, True, True, False, True, True])
    assert [c.tolist() for c in token_chunks(valid, 4)] == [[0, 2, 3], [5, 6]]
    assert token_chunks(torch.ones(4, dtype=torch.bool), 4) == [slice(0, 3), slice(3, 4)]


@pytest.mark.parametrize("chunk_ids", [1, 2 * 3 * 4, 10**9])
def test_id_checks_find_the_first_bad_route_in_any_chunk(chunk_ids, monkeypatch):
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", chunk_ids)
    routes = random_batch(20, 3, 50, 4, seed=1)
    valid_tokens = routes.valid.nonzero().squeeze(1).tolist()
    token = valid_tokens[-2]
    twice = routes.rollout.clone()
    twice[token, 2, 3] = twice[token, 2, 0]
    with pytest.raises(RoutesError, match=f"picks expert {int(twice[token, 2, 0])} twice at token {token}, layer 2"):
        Routes(rollout=twice, valid=routes.valid, num_experts=50)
    out_of_range = routes.rollout.clone()
    out_of_range[token, 1, 2] = 50
    with pytest.raises(RoutesError, match=f"expert id 50 at token {token}, layer 1"):
        Routes(rollout=out_of_range, valid=routes.valid, num_experts=50)
    invalid = (~routes.valid).nonzero()[0].item()
    ignored = routes.rollout.clone()
    ignored[invalid] = -7  # never read: the token is invalid
    Routes(rollout=ignored, valid=routes.valid, num_experts=50)


def mostly_agreeing_batch(tokens, layers, experts, topk, seed):
    """Native routes as a router beside the rollout gives them: mostly equal slot for slot."""
    routes = random_batch(tokens, layers, experts, topk, seed, all_valid=True)
    g = torch.Generator().manual_seed(seed + 1)
    kind = torch.randint(0, 10, (tokens, layers, 1), generator=g)
    native = torch.where(kind < 8, routes.rollout, routes.native)  # 80% equal; the rest reordered or fresh
    return routes.rollout, native


@pytest.mark.parametrize("topk, experts", [(8, 128), (4, 300), (3, 40), (1, 9)])
@CHUNK_TOKENS
def test_overlap_of_mostly_agreeing_routes_equals_the_reference(topk, experts, chunk_tokens, monkeypatch):
    """Routes equal in order take the positional shortcut; reordered or different ones the full comparison."""
    a, b = mostly_agreeing_batch(41, 5, experts, topk, seed=topk)
    monkeypatch.setattr(ablate.routes, "_CHUNK_IDS", chunk_tokens * 5 * topk)
    assert torch.equal(overlap_count(a, b), reference_overlap(a, b))
    # Views whose storage does not start on an 8-byte boundary cannot be read as int64 words.
    shifted_a = torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view(a.shape)
    shifted_b = torch.cat([b.new_zeros(3), b.reshape(-1)])[3:].view(b.shape)
    assert torch.equal(overlap_count(shifted_a, shifted_b), reference_overlap(a, b))
    assert torch.equal(overlap_count(a, b.int()), reference_overlap(a, b))


@pytest.mark.parametrize("valid_share", [0.9, 0.2], ids=["mostly-valid", "mostly-padding"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_route_scores_never_read_padding_ids(valid_share, dtype):
    """Padding may hold any id, in range or not; it scores 0 and the routes are left untouched."""
    routes = random_batch(60, 3, 50, 4, seed=5, all_valid=True, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    valid = torch.rand(60, generator=g) < valid_share
    rollout = routes.rollout.clone()
    rollout[~valid] = torch.randint(-30000, 30000, (int((~valid).sum()), 3, 4), generator=g, dtype=dtype)
    padded = Routes(rollout=rollout, valid=valid, num_experts=50, ids_checked=True)
    before = rollout.clone()
    estimate = torch.rand(3, 50, generator=g)
    torch.testing.assert_close(route_scores(estimate, padded), reference_scores(estimate, routes) * valid[:, None])
    assert torch.equal(rollout, before)


@pytest.mark.parametrize("experts", [12, 128, 300])
@pytest.mark.parametrize("topk", range(1, 10))
def test_recorded_routes_agree_with_a_set_per_route(experts, topk):
    """Distinct and in-range ids, against Python's sets, with ids that collide modulo 256."""
    from ablate.replay.batch import recorded_routes

    g = torch.Generator().manual_seed(experts + topk)
    ids = torch.randint(-1, experts + 1, (3000, 3, topk), generator=g, dtype=torch.int16)
    ids[:200, :, :2] = torch.tensor([3, 259], dtype=torch.int16)[:topk]  # distinct, equal as bytes
    expected = [[len(set(route)) == topk and all(0 <= e < experts for e in route) for route in token] for token in ids.tolist()]
    assert recorded_routes(ids, experts).tolist() == expected
