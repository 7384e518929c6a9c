import pytest
import torch
from handbatch import NATIVE, ROLLOUT, VALID, hand_routes

from ablate import Routes, RoutesError, layer_quotas
from ablate.routes import overlap_count


def test_properties_of_the_hand_batch():
    routes = hand_routes()
    assert (routes.num_tokens, routes.num_layers, routes.topk, routes.num_experts) == (4, 2, 2, 4)
    assert routes.num_valid_routes == 6
    # Padding t3 holds duplicate ids {0, 0} in native: ignored because it is invalid.
    assert overlap_count(ROLLOUT, NATIVE)[:3].tolist() == [[2, 1], [0, 2], [2, 2]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rollout=ROLLOUT[0], valid=VALID, num_experts=4), r"rollout has shape \(2, 2\): expected rank 3"),
        (dict(rollout=ROLLOUT.float(), valid=VALID, num_experts=4), "expected an integer dtype"),
        (dict(rollout=ROLLOUT, valid=VALID[:3], num_experts=4), r"valid has shape \(3,\)"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=3), r"expert id 3 at token 0, layer 1: expected ids in \[0, 3\)"),
        (dict(rollout=ROLLOUT - 1, valid=VALID, num_experts=4), r"expert id -1 at token 0, layer 0"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=1), r"topk=2 > num_experts=1"),
        (dict(rollout=ROLLOUT, valid=torch.zeros(4, dtype=torch.bool), num_experts=4), "no valid token"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, native=NATIVE[:, :1]), "native has shape"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, router_logits=torch.zeros(4, 2, 3)), "router_logits has shape"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=2.5), "num_experts=2.5: expected a positive integer"),
        (dict(rollout=ROLLOUT, valid=torch.tensor([0.3, 1.0, 1.0, 0.0]), num_experts=4), "valid has dtype torch.float32: expected bool or 0/1"),
        (dict(rollout=ROLLOUT, valid=torch.tensor([float("nan")] * 4), num_experts=4), "valid has dtype torch.float32"),
        (dict(rollout=ROLLOUT, valid=torch.tensor([1, 2, 1, 0]), num_experts=4), r"valid holds 2 at \[1\]: expected bool or 0/1 integers"),
        (dict(rollout=ROLLOUT, valid=[True, True, True, False], num_experts=4), "valid is a list: expected a torch.Tensor"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=[0, 4]), "offsets is a list: expected a torch.Tensor"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=torch.tensor([0.0, 4.0])), "offsets has dtype torch.float32"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=torch.tensor([4])), r"offsets has shape \(1,\)"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=torch.tensor([1, 4])), "offsets run from 1 to 4: expected cumulative boundaries from 0 to tokens=4"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=torch.tensor([0, 3])), "offsets run from 0 to 3"),
        (dict(rollout=ROLLOUT, valid=VALID, num_experts=4, offsets=torch.tensor([0, 3, 2, 4])),
         r"offsets decrease at sequence 1: offsets\[1\]=3 > offsets\[2\]=2"),
    ],
)
def test_invalid_routes_are_rejected_with_the_value_named(kwargs, message):
    with pytest.raises(RoutesError, match=message):
        Routes(**kwargs)


def test_integer_valid_masks_and_offsets_are_accepted():
    routes = Routes(rollout=ROLLOUT, valid=VALID.long(), num_experts=4, offsets=torch.tensor([0, 2, 2, 4], dtype=torch.int32))
    assert routes.valid.dtype == torch.bool and torch.equal(routes.valid, VALID)
    assert routes.offsets.dtype == torch.int64 and routes.num_sequences == 3  # an empty sequence is allowed
    assert routes.valid_offsets.tolist() == [0, 2, 2, 3]  # t0, t1 | - | t2 (t3 is padding)
    assert hand_routes().num_sequences is None and hand_routes().valid_offsets is None


def test_duplicate_expert_in_a_valid_route_is_rejected():
    dup = ROLLOUT.clone()
    dup[2, 1] = torch.tensor([3, 3])
    with pytest.raises(RoutesError, match="picks expert 3 twice at token 2, layer 1"):
        Routes(rollout=dup, valid=VALID, num_experts=4)


def test_ids_checked_skips_only_the_id_pass():
    """A caller that checked the ids (the verl hook) skips that pass; every other check still runs."""
    rollout = torch.tensor([[[0, 0]], [[1, 2]]])
    with pytest.raises(RoutesError, match="picks expert 0 twice"):
        Routes(rollout=rollout, valid=torch.tensor([True, True]), num_experts=4)
    assert Routes(rollout=rollout, valid=torch.tensor([True, True]), num_experts=4, ids_checked=True).num_valid_routes == 2
    with pytest.raises(RoutesError, match="no valid token"):
        Routes(rollout=rollout, valid=torch.tensor([False, False]), num_experts=4, ids_checked=True)


def test_verl_layout_round_trips_a_left_padded_batch():
    g = torch.Generator().manual_seed(0)
    batch, seq, layers, topk, experts = 3, 6, 3, 2, 8
    lengths = [6, 4, 1]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    routed = torch.zeros(batch, seq, layers, topk, dtype=torch.int16)
    for b, length in enumerate(lengths):  # left padding: the last `length` positions are real
        mask[b, seq - length :] = 1
        routed[b, seq - length :] = torch.rand(length, layers, experts, generator=g).argsort(-1)[..., :topk].short()
    routes = Routes.from_verl(routed, mask, num_experts=experts)
    assert routes.num_tokens == batch * seq and routes.num_valid_tokens == sum(lengths)
    assert torch.equal(routes.rollout[routes.valid], routed[mask.bool()])
    assert routes.offsets.tolist() == [0, 6, 12, 18]  # one sequence per row of the batch
    assert routes.valid_offsets.diff().tolist() == lengths
    back = routes.to_verl(batch, seq)
    assert back.dtype == torch.int16 and torch.equal(back, routed)
    inferred = Routes.from_verl(routed, mask)
    assert inferred.num_experts == int(routed[mask.bool()].max()) + 1
    with pytest.raises(RoutesError, match=r"mask has shape \(3, 5\)"):
        Routes.from_verl(routed, mask[:, :5])
    with pytest.raises(RoutesError, match="mask has dtype torch.float32: expected bool or 0/1"):
        Routes.from_verl(routed, mask * 0.5)


def test_layer_quotas_spread_the_remainder_evenly():
    assert layer_quotas(10, 4, 100).tolist() == [2, 3, 2, 3]  # remainder 2 -> layers floor((i + 0.5) * 4 / 2) = 1, 3
    assert layer_quotas(7, 7, 1).tolist() == [1] * 7
    assert layer_quotas(1, 3, 5).tolist() == [0, 1, 0]  # floor(0.5 * 3 / 1) = 1: the middle layer
    assert int(layer_quotas(123, 48, 10).sum()) == 123


def test_native_overlap_of_routes_sliced_from_a_wider_tensor():
    # One token, one layer, top-4 of 5 experts: a size-1 dim passes is_contiguous() whatever its
    # stride, and viewing the routes as int64 words must not trust it.
    ranked = torch.tensor([[[1, 2, 3, 4, 0]]], dtype=torch.int16)
    native = torch.tensor([[[4, 3, 2, 1, 0]]], dtype=torch.int16)
    routes = Routes(rollout=ranked[..., :4], valid=torch.ones(1, dtype=torch.bool), num_experts=5,
                    native=native[..., :4])
    assert routes.native_overlap.tolist() == [[4]]
