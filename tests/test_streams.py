"""The one seed scheme: every random stream is a function of the cell seed, its purpose and its keys only,
recorded with the cell, and cells of two schemes are never paired."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

from ablate.seeding import STREAMS_VERSION, stream, stream_seed
from synthetic_configs import compose_config


def test_a_stream_depends_on_its_seed_purpose_and_keys_only():
    seeds = {stream_seed(seed, purpose, *keys) for seed, purpose, keys in [
        (0, "selection", ()), (1, "selection", ()), (0, "prompts", ()), (0, "selection", (0,)),
        (0, "selection", (1,)), (0, "selection", ("1",)), (0, "selection", (b"1",)), (0, "selection", (0, 1)),
        (0, "selection", (1, 0)), (0, "selection0", ())]}
    assert len(seeds) == 10  # no two inputs collide: types and boundaries are part of the key
    assert all(0 <= seed < 2**63 for seed in seeds)
    draw = torch.rand(3, generator=stream(7, "probe", 2, "random@0.5")).tolist()
    assert draw == torch.rand(3, generator=stream(7, "probe", 2, "random@0.5")).tolist()
    with pytest.raises(TypeError, match="stream key True"):
        stream_seed(0, "selection", True)


def test_another_process_derives_the_same_stream(tmp_path):
    code = "from ablate.seeding import stream_seed; print(stream_seed(3, 'selection', b'seq', 4))"
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                           env={"PYTHONHASHSEED": str(salt), "PATH": "/usr/bin:/bin"}, check=True).stdout.strip()
            for salt in (1, 2)}
    assert seen == {str(stream_seed(3, "selection", b"seq", 4))}


def test_cells_record_their_scheme_and_the_analysis_never_pairs_two_schemes(tmp_path):
    from ablate.analysis import load_runs
    from ablate.analysis.load import MixedSchemaWarning
    from ablate.analysis.tables import arm_keys
    from ablate.runner import run_cell

    store = tmp_path / "runs"
    for policy, seed in (("none", 0), ("full", 0), ("none", 1), ("full", 1)):
        run_cell(compose_config(f"policy={policy}", f"seed={seed}", "backend.steps=2", "tracking.mode=disabled",
                                "sweep=mixed", store=store))
    cells = sorted((store / "mixed").glob("*-*"))
    assert {json.loads((cell / "cell.json").read_text())["streams"] for cell in cells} == {STREAMS_VERSION}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "streams" not in arm_keys(load_runs(store / "mixed"))
    for cell in cells:  # seed 1's cells as an older ablate wrote them: before the scheme was recorded
        identity = json.loads((cell / "cell.json").read_text())
        if identity["seed"] == 1:
            del identity["streams"]
            (cell / "cell.json").write_text(json.dumps(identity))
    with pytest.warns(MixedSchemaWarning, match=r"seed schemes 1 \(2 cells\), 2 \(2 cells\) are mixed"):
        df = load_runs(store / "mixed")
    assert "streams" in arm_keys(df) and sorted(df["streams"]) == [1, 1, 2, 2]
