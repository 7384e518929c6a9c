"""Counterfactual replay probes: their settings, their keys, and what they do (and do not do) to training."""

import json
import math
import subprocess
import sys

import pandas as pd
import pytest
import torch
from synthetic_configs import compose_config
from omegaconf import OmegaConf

from ablate.backends.synthetic import run_cell_steps
from ablate.compose import cell_from_config
from ablate.config import ConfigError
from ablate.diagnostics import PROBE_KEYS, SCHEMA, check_record, probe_key, split_probe_key, to_json_schema, validate_record
from ablate.probes import parse_probes, probe_generator, probe_table
from ablate.runner import run_cell

SIX = "probes=[none,full,random@0.25,uniform@0.25,fisher@0.25,mismatch@0.25]"


def run(*overrides: str) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    records: list[dict[str, float]] = []

    def keep(step: int, record: dict[str, float]) -> None:
        validate_record(record)
        records.append(record)

    model = run_cell_steps(cell_from_config(compose_config(*overrides)), keep)
    return records, model.state_dict()


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


# --- settings and keys ---------------------------------------------------------------------


def test_probe_ids_and_table_round_trip():
    probes = parse_probes(["none", "full", "random@0.25", "fisher@0.1:tau=1.0:per_layer=true",
                           {"policy": "uniform", "budget": 0.5}, {"policy": "fisher", "budget": 0.25, "settings": {"tau": 2}}])
    assert [p.id for p in probes] == ["none", "full", "random@0.25", "fisher@0.1:per_layer=true:tau=1", "uniform@0.5",
                                      "fisher@0.25:tau=2"]
    assert [(p.policy, p.budget) for p in probes[:2]] == [("none", 0.0), ("full", 1.0)]
    assert probes[3].settings == {"tau": 1.0, "per_layer": True}
    assert parse_probes(probe_table(probes)) == probes


@pytest.mark.parametrize(("entries", "message"), [
    (["random"], "probes[0]=random: expected a budget, e.g. random@0.25"),
    (["none@0.3"], "probes[0]=none@0.3: budget=0.3 in policy=none"),
    (["random@1.5"], "probes[0]=random@1.5: budget=1.5"),
    (["bogus@0.1"], "probes[0]=bogus@0.1: policy 'bogus' is not one of"),
    (["fisher@0.2:tau=-1"], "probes[0]=fisher@0.2:tau=-1: tau=-1 in policy=fisher"),
    (["fisher@0.2:tau"], "setting 'tau' is not key=value"),
    (["random@0.2", {"policy": "random", "budget": 0.2}], "probes[1]=random@0.2: the same probe as probes[0]"),
    ("random@0.1", "expected a list of probes"),
])
def test_bad_probes_are_one_clear_error(entries, message):
    with pytest.raises(ConfigError, match=None) as error:
        parse_probes(entries)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_bad_probe_fails_from_the_command_line_before_any_work(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ablate", "policy=none", "probes=[random]", f"store_dir={tmp_path}",
                           "tracking.mode=disabled"], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "probes[0]=random: expected a budget" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "adhoc").exists()
    done = subprocess.run([sys.executable, "-m", "ablate", "policy=none", "probe_every=0", f"store_dir={tmp_path}",
                           "tracking.mode=disabled"], capture_output=True, text=True, timeout=600)
    assert "probe_every=0: expected an integer >= 1" in done.stderr and "Traceback" not in done.stderr


def test_a_backend_that_scores_no_probes_refuses_them():
    cfg = compose_config("backend=noop", "policy=none", "probes=[none,random@0.5]", tiny=False)
    with pytest.raises(ConfigError, match=r"probes=\['none', 'random@0.5'\] with backend=noop: expected no probes"):
        cell_from_config(cfg)
    assert cell_from_config(compose_config("backend=noop", "policy=none", tiny=False)).probes == ()


@pytest.mark.parametrize("backend", ["verl", "verl_cpu"])
def test_verl_backends_score_probes(backend):
    from ablate.backends import get_backend

    cell = cell_from_config(compose_config(f"backend={backend}", "policy=none", "probes=[none,random@0.5]", tiny=False))
    assert get_backend(cell.backend.name).scores_probes and [probe.id for probe in cell.probes] == ["none", "random@0.5"]


def test_probe_keys_are_validated_like_schema_keys():
    assert split_probe_key("probe/fisher@0.25:tau=1/mismatch/kl_k3") == ("fisher@0.25:tau=1", "mismatch/kl_k3")
    assert split_probe_key("mismatch/kl_k3") is None
    good = {probe_key("random@0.25", key): 0.5 for key in PROBE_KEYS}
    assert check_record(good) == []
    assert check_record({probe_key("none", "replay/override_rate"): math.nan}) == []  # nothing replayed
    assert check_record({"probe/random@0.25/mismatch/kl_k3": -1.0}) == [
        "probe/random@0.25/mismatch/kl_k3=-1.0: expected a nonnegative in [0.0, inf] (nats)"]
    assert "unknown diagnostics key 'probe/random@0.25/train/reward'" in check_record({"probe/random@0.25/train/reward": 1})[0]
    assert "unknown diagnostics key 'probe/random/0.25/mismatch/kl_k3'" in check_record({"probe/random/0.25/mismatch/kl_k3": 1})[0]
    assert "unknown diagnostics key 'probe/mismatch/kl_k3'" in check_record({"probe/mismatch/kl_k3": 1})[0]


def test_json_schema_describes_probe_keys():
    jsonschema = pytest.importorskip("jsonschema")
    schema = to_json_schema()
    record = {name: 0 for name in SCHEMA}
    record[probe_key("fisher@0.25:tau=1", "mismatch/kl_k3")] = 0.01
    jsonschema.validate(record, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**record, probe_key("fisher@0.25", "mismatch/kl_k3"): -1.0}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**record, "probe/fisher@0.25/train/reward": 0.0}, schema)


def test_probe_generators_depend_on_seed_step_and_probe_only():
    def draw(*args):
        return torch.rand(4, generator=probe_generator(*args)).tolist()

    assert draw(3, 7, "random@0.25") == draw(3, 7, "random@0.25")
    assert len({tuple(draw(*args)) for args in [(3, 7, "random@0.25"), (4, 7, "random@0.25"), (3, 8, "random@0.25"),
                                                 (3, 7, "random@0.5")]}) == 4


# --- what probes do to training: nothing ---------------------------------------------------


@pytest.mark.parametrize("cell", [("policy=mismatch", "budget=0.25"), ("policy=fisher", "budget=0.25")])
def test_probed_training_is_bit_for_bit_the_unprobed_one(cell):
    plain, plain_weights = run(*cell, "backend.steps=4")
    probed, probed_weights = run(*cell, "backend.steps=4", SIX, "probe_every=1")
    for before, after in zip(plain, probed, strict=True):
        assert set(after) - set(before) == {key for key in after if key.startswith("probe/")}
        assert all(same(before[key], after[key]) for key in before)
    assert plain_weights.keys() == probed_weights.keys()
    assert all(torch.equal(plain_weights[name], probed_weights[name]) for name in plain_weights)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_probe_with_the_cells_mask_reproduces_the_cells_keys(policy):
    records, _ = run(f"policy={policy}", "backend.steps=3", SIX, "probe_every=1")
    for record in records:
        for key in [*(k for k in SCHEMA if k.startswith("mismatch/")), "replay/budget_realized",
                    "replay/override_rate", "replay/effective_budget"]:
            assert same(record[probe_key(policy, key)], record[key]), key


def test_adding_a_probe_changes_no_other_probe():
    fewer, _ = run("policy=random", "budget=0.1", "backend.steps=2", "probes=[random@0.25,mismatch@0.25]", "probe_every=1")
    more, _ = run("policy=random", "budget=0.1", "backend.steps=2",
                  "probes=[uniform@0.5,random@0.25,fisher@0.1,mismatch@0.25]", "probe_every=1")
    for a, b in zip(fewer, more, strict=True):
        assert all(same(a[key], b[key]) for key in a)
    # a random probe draws another mask than the cell's own random stream would at the same budget
    assert more[0][probe_key("random@0.25", "mismatch/kl_k3")] != more[0][probe_key("uniform@0.5", "mismatch/kl_k3")]


def test_probes_run_on_every_nth_step_only(tmp_path):
    cfg = compose_config("policy=none", "backend.steps=5", "probes=[random@0.5,{policy:fisher,budget:0.5}]",
                         "probe_every=2", "tracking.mode=disabled", store=tmp_path)
    run_cell(cfg)
    (cell,) = [p for p in (tmp_path / "adhoc").iterdir() if not p.name.startswith("_")]
    records = pd.read_parquet(cell / "records.parquet")
    probed = records[probe_key("fisher@0.5", "mismatch/kl_k3")].notna().tolist()
    assert probed == [True, False, True, False, True]
    assert records[probe_key("random@0.5", "replay/budget_realized")].dropna().eq(0.5).all()
    config = OmegaConf.load(cell / "config.yaml")
    assert OmegaConf.to_container(config.probes) == [
        {"id": "random@0.5", "policy": "random", "budget": 0.5, "settings": {}},
        {"id": "fisher@0.5", "policy": "fisher", "budget": 0.5, "settings": {}},
    ]
    assert config.probe_every == 2
    assert json.loads((cell / "status.json").read_text())["warnings"] == []
