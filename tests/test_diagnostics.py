"""Every diagnostic on the hand batch (tests/handbatch.py), the KL estimators, and the schema."""

import json
import math

import pytest
import torch
from handbatch import FISHER, hand_routes

from ablate.diagnostics import (
    SCHEMA,
    SchemaError,
    check_record,
    expert_load,
    keys_in,
    load_metrics,
    mismatch_metrics,
    replay_metrics,
    route_diagnostics,
    routing_metrics,
    to_json_schema,
    validate_record,
)
from ablate.diagnostics.schema import JSON_SCHEMA_PATH

# Replay (t0, l1) and (t1, l0): exactly the two mismatched routes.
MISMATCH_MASK = torch.tensor([[False, True], [True, False], [False, False], [False, False]])
# Replay (t0, l0), (t1, l0), (t0, l1): the fisher top-3.
FISHER_MASK = torch.tensor([[True, True], [True, False], [False, False], [False, False]])


def test_routing_metrics_by_hand():
    m = routing_metrics(hand_routes(), FISHER_MASK)
    assert m["routing/route_mismatch_rate"] == pytest.approx(2 / 6)
    assert m["routing/token_mismatch_rate"] == pytest.approx(2 / 3)  # t0 and t1
    assert m["routing/topk_overlap"] == pytest.approx((2 + 1 + 0 + 2 + 2 + 2) / 12)
    assert m["routing/mismatch_recall"] == 1.0  # both mismatched routes are in the fisher top-3
    assert m["routing/residual_mismatch_rate"] == 0.0
    none = routing_metrics(hand_routes(), torch.zeros(4, 2, dtype=torch.bool))
    assert none["routing/mismatch_recall"] == 0.0 and none["routing/residual_mismatch_rate"] == pytest.approx(2 / 6)
    assert all(math.isnan(v) for v in routing_metrics(hand_routes(native=False), FISHER_MASK).values())


def test_replay_metrics_by_hand():
    m = replay_metrics(hand_routes(), FISHER_MASK, 0.5, fisher_scores=FISHER)
    assert m["replay/valid_routes"] == 6 and m["replay/replayed_routes"] == 3
    assert m["replay/budget_realized"] == 0.5 and m["replay/budget_requested"] == 0.5
    assert m["replay/override_rate"] == pytest.approx(2 / 3)  # t0l0 matched; t1l0, t0l1 mismatched
    assert m["replay/fisher_mass"] == pytest.approx((5 + 3 + 4) / 15)
    assert m["replay/fisher_fallback"] == 0.0
    full = replay_metrics(hand_routes(), torch.ones(4, 2, dtype=torch.bool), 1.0)
    assert full["replay/replayed_routes"] == 6  # the padding token never counts
    assert full["replay/override_rate"] == pytest.approx(2 / 6)
    assert math.isnan(full["replay/fisher_mass"])
    nothing = replay_metrics(hand_routes(), torch.zeros(4, 2, dtype=torch.bool), 0.0)
    assert math.isnan(nothing["replay/override_rate"])  # undefined: no replayed route


def test_load_metrics_by_hand():
    # Training routes with MISMATCH_MASK: replayed routes use rollout, the others native.
    #   layer 0: t0 native {0,1}, t1 rollout {0,2}, t2 native {2,1} -> load [2, 2, 2, 0]
    #   layer 1: t0 rollout {2,3}, t1 native {3,1}, t2 native {0,3} -> load [1, 1, 1, 3]
    load = expert_load(hand_routes(), MISMATCH_MASK)
    assert load.tolist() == [[2, 2, 2, 0], [1, 1, 1, 3]]
    m = load_metrics(load)
    h0 = math.log(3) / math.log(4)  # uniform over 3 of 4 experts
    h1 = -(3 * (1 / 6) * math.log(1 / 6) + 0.5 * math.log(0.5)) / math.log(4)
    assert m["load/entropy_norm"] == pytest.approx((h0 + h1) / 2)
    assert m["load/entropy_norm_min"] == pytest.approx(h0)
    assert m["load/max_violation"] == pytest.approx((2 / 1.5 - 1 + 3 / 1.5 - 1) / 2)
    assert m["load/max_violation_max"] == pytest.approx(1.0)
    assert m["load/cv"] == pytest.approx(math.sqrt(0.75) / 1.5)  # both layers: population std sqrt(3/4), mean 1.5
    assert m["load/dead_expert_frac"] == pytest.approx(1 / 8)
    # Without a mask the training forward is all native (layer 0: {0,1}, {3,1}, {2,1};
    # layer 1: {2,0}, {3,1}, {0,3}); without native routes, all rollout.
    assert expert_load(hand_routes()).tolist() == [[1, 3, 1, 1], [2, 1, 1, 2]]
    assert expert_load(hand_routes(native=False)).tolist() == [[2, 2, 2, 0], [1, 1, 1, 3]]


def test_kl_estimators_match_the_exact_kl_of_two_categoricals():
    # Rollout p and train q over 4 tokens. A batch holding each token in proportion to p makes
    # the sample mean an exact expectation under p.
    p = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    tokens = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])
    logp_rollout, logp_train = p.log()[tokens], q.log()[tokens]
    m = mismatch_metrics(logp_train, logp_rollout, torch.ones(8, dtype=torch.bool))
    kl = float((p * (p / q).log()).sum())  # KL(p || q), computed directly: 0.25 ln 2
    assert kl == pytest.approx(0.25 * math.log(2))
    assert m["mismatch/kl_k1"] == pytest.approx(kl)
    assert m["mismatch/kl_k3"] == pytest.approx(kl)
    assert m["mismatch/kl_k2"] == pytest.approx(float((p * ((q / p).log() ** 2) / 2).sum()))
    # |l| = ln 2 on tokens 0, 2, 3 and 0 on token 1: max(r, 1/r) = 2 is not > 2.
    assert m["mismatch/extreme_token_frac"] == 0.0
    assert m["mismatch/abs_logratio_mean"] == pytest.approx(6 / 8 * math.log(2))
    assert m["mismatch/abs_logratio_max"] == pytest.approx(math.log(2))
    strict = mismatch_metrics(logp_train, logp_rollout, torch.ones(8, dtype=torch.bool), extreme_threshold=1.5)
    assert strict["mismatch/extreme_token_frac"] == pytest.approx(6 / 8)
    # Invalid tokens are ignored entirely.
    valid = torch.tensor([True] * 8 + [False])
    padded = mismatch_metrics(torch.cat([logp_train, torch.tensor([50.0])]), torch.cat([logp_rollout, torch.tensor([0.0])]), valid)
    assert padded == m


def test_full_record_conforms_to_the_schema():
    record = route_diagnostics(
        hand_routes(), FISHER_MASK, 0.5, logp_train=torch.zeros(4), logp_rollout=torch.full((4,), -0.1),
        fisher_scores=FISHER,
    )
    assert set(record) == set(keys_in("replay") + keys_in("routing") + keys_in("load") + keys_in("mismatch"))
    validate_record(record, require=("replay", "routing", "mismatch", "load"))


def test_validator_names_bad_keys_and_values():
    with pytest.raises(SchemaError, match="unknown diagnostics key 'routing/mismatch_rat'"):
        validate_record({"routing/mismatch_rat": 0.1})
    with pytest.raises(SchemaError, match=r"replay/budget_realized=1.2: expected a fraction in \[0.0, 1.0\]"):
        validate_record({"replay/budget_realized": 1.2})
    with pytest.raises(SchemaError, match="mismatch/kl_k3=nan: this key is always defined"):
        validate_record({"mismatch/kl_k3": float("nan")})
    with pytest.raises(SchemaError, match="replay/valid_routes=2.5: expected a whole number"):
        validate_record({"replay/valid_routes": 2.5})
    with pytest.raises(SchemaError, match="expected a number"):
        validate_record({"train/reward": "high"})
    assert check_record({"routing/mismatch_recall": float("nan")}) == []  # nullable
    assert check_record({"train/reward": 1.0}, require=("drift",))[0].startswith("section drift/ is missing")
    assert validate_record({"bogus": 1}, strict=False) == ["unknown diagnostics key 'bogus' (schema 1.1)"]


def test_json_schema_file_is_in_sync():
    assert json.loads(JSON_SCHEMA_PATH.read_text()) == to_json_schema()
    assert set(to_json_schema()["properties"]) == set(SCHEMA)
