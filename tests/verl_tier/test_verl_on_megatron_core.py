"""``backend.engine=megatron`` where verl drives Megatron-core's own ``RouterReplay`` instead of its patch.

ablate reads which class verl's Megatron engine replays with from verl's sources (the import of
``RouterReplay`` in ``verl/utils/megatron/router_replay_utils.py``) and replaces that class's
names; the seam applies the mask with the replay code it shares with ``partial_replay``, so the
same routes are replayed with either class (``verl_core_replay_world.py``).
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402

import verl_core_replay_world as world  # noqa: E402
from ablate.backends.verl import entry_points as ep  # noqa: E402
from ablate.budget import count_for  # noqa: E402
from ablate.replay import megatron_routers  # noqa: E402

pytestmark = pytest.mark.verl

POLICIES = [("random", 0.4), ("fisher", 0.3), ("mismatch", 0.5), ("full", None), ("none", None)]


def test_verl_0_9_1_drives_its_own_patched_router_replay_and_the_seam_replaces_that():
    assert ep.router_replay_module() == "verl.utils.megatron.router_replay_patch"
    replaced = {point.where for point in ep.of_engine("megatron") if ".RouterReplay." in point.where}
    assert replaced == {"verl.utils.megatron.router_replay_patch.RouterReplay.set_target_indices",
                        "verl.utils.megatron.router_replay_patch.RouterReplay.get_replay_topk"}


def which_class(tmp_path, imports: str) -> str:
    """What ablate reads from a verl whose router_replay_utils has ``imports``, in a fresh process."""
    package = tmp_path / "verl" / "utils" / "megatron"
    package.mkdir(parents=True)
    for folder in (tmp_path / "verl", tmp_path / "verl" / "utils", package):
        (folder / "__init__.py").write_text("")
    (package / "router_replay_utils.py").write_text(textwrap.dedent(imports))
    probe = ("from ablate.backends.verl import entry_points as ep\n"
             "try:\n"
             "    print(ep.router_replay_module())\n"
             "    print(sorted(p.where for p in ep.of_engine('megatron') if '.RouterReplay.' in p.where))\n"
             "except ep.EntryPointMissing as error:\n"
             "    print(error)\n")
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_verl_that_drives_megatron_cores_router_replay_is_read_from_its_sources(tmp_path):
    found = which_class(tmp_path, """
        import torch
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    """)
    assert found.splitlines() == [
        megatron_routers.ROUTER_REPLAY,
        "['megatron.core.transformer.moe.router_replay.RouterReplay.get_replay_topk', "
        "'megatron.core.transformer.moe.router_replay.RouterReplay.set_target_indices']"]


def test_a_verl_without_router_replay_fails_in_one_line(tmp_path):
    found = which_class(tmp_path, "import torch\n")
    assert found.startswith("verl.utils.megatron.router_replay_utils imports no RouterReplay: ablate's Megatron seam")
    assert found.count("\n") == 1


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    import torch.multiprocessing as mp

    from worlds import free_port

    path = tmp_path_factory.mktemp("verl_on_megatron_core") / "run.pt"
    mp.spawn(world.run, args=(free_port(), POLICIES, str(path)), nprocs=1)
    return torch.load(path, weights_only=False)


def test_the_seam_replays_ablates_mask_through_megatron_cores_router_replay(replayed):
    assert replayed["seam_points"] == [megatron_routers.ROUTER_REPLAY] * 2
    recorded, native, valid = replayed["recorded"], replayed["native"], replayed["valid"]
    for policy, budget in POLICIES:
        outcome = replayed[policy]
        mask = outcome["mask"] & valid[:, None]
        expected = torch.where(mask[..., None], world_map(recorded), world_map(native))
        assert torch.equal(outcome["old"], expected), f"{policy}: old-log-prob pass"
        assert torch.equal(outcome["update"], expected), f"{policy}: update pass"
        bounds = replayed["offsets"].tolist()
        per_sequence = [int(valid[start:end].sum()) * world.NUM_LAYERS for start, end in zip(bounds[:-1], bounds[1:])]
        resolved = {"full": 1.0, "none": 0.0}.get(policy, budget)
        assert outcome["metrics"]["replay/replayed_routes"] == int(mask.sum()) == sum(
            count_for(resolved, routes) for routes in per_sequence), policy
        assert outcome["metrics"]["replay/valid_routes"] == sum(per_sequence), policy


def world_map(indices: torch.Tensor) -> torch.Tensor:
    """``[tokens, layers, experts]`` routing map of ``[tokens, layers, topk]`` expert ids."""
    return torch.zeros(*indices.shape[:-1], world.NUM_EXPERTS, dtype=torch.bool).scatter(-1, indices.long(), True)
