"""Every name ablate replaces in verl, Megatron-core or VeOmni is where the table says, checked twice.

At launch the installed sources are read without importing them; when the hook installs, the live
objects are inspected. A verl whose function moved fails the launch in one line naming it.
"""

import inspect
import textwrap

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("veomni", reason="VeOmni is not installed here: build the environment with .ci/verl-env.sh")

from ablate.backends.verl import entry_points as ep  # noqa: E402

pytestmark = pytest.mark.verl


def test_every_entry_point_is_in_the_installed_sources_and_the_live_objects_agree():
    ep.check_sources("megatron", cpu=True)
    ep.check_sources("veomni", cpu=True)
    assert {point.engine for point in ep.ENTRY_POINTS} == {"megatron", "veomni", "trainer", "megatron_core"}
    for point in ep.ENTRY_POINTS:  # imports each module, as the hook's install does
        owner, attribute, current = ep.lookup(point)
        # as stored: a staticmethod (RouterReplay.set_replay_data) is put back as the staticmethod it was
        assert inspect.getattr_static(owner, attribute) is current, point.where


@pytest.fixture()
def moved_verl(tmp_path, monkeypatch):
    """An installed package like verl 0.9.1's Megatron engine, whose forward_backward_batch moved away."""
    package = tmp_path / "movedverl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(textwrap.dedent('''
        from movedverl.replay import set_router_replay_data

        class MegatronEngine:
            def forward_step(self, data, loss_function, forward_only=False):
                pass
    '''))
    (package / "replay.py").write_text("def set_router_replay_data(routes, tf_config):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "movedverl.engine"


def test_a_moved_function_fails_the_check_in_one_line_naming_it(moved_verl, monkeypatch):
    moved = ep.EntryPoint("megatron", moved_verl, "MegatronEngine.forward_backward_batch",
                          ("self", "data", "loss_function", "forward_only"), "engines.base.hooked_call")
    reordered = ep.EntryPoint("megatron", moved_verl, "set_router_replay_data",
                              ("layers_topk_idx", "attention_mask", "tf_config", "vp_rank"), "a seam method")
    with pytest.raises(ep.EntryPointMissing) as raised:
        ep.check_params(moved, ep.source_params(moved))
    message = str(raised.value)
    assert message.startswith("movedverl.engine.MegatronEngine.forward_backward_batch is not there: movedverl.engine "
                              "defines no MegatronEngine.forward_backward_batch: ablate's hook replaces it with")
    assert "\n" not in message and "verl 0.9.1" in message
    # followed through the module's own import, and checked against what the hook passes on
    with pytest.raises(ep.EntryPointMissing, match=r"set_router_replay_data takes \(routes, tf_config\), not "
                                                   r"\(layers_topk_idx, attention_mask, tf_config, vp_rank, \.\.\.\)"):
        ep.check_params(reordered, ep.source_params(reordered))
    with pytest.raises(ep.EntryPointMissing, match="is not there: movedverl.engine.MegatronEngine has no forward_backward_batch"):
        ep.replace(moved, lambda *args: None)  # the live check refuses to wrap it too

    from ablate.backends.verl.launch import VerlLaunchError, check_engine

    monkeypatch.setattr(ep, "ENTRY_POINTS", (*ep.ENTRY_POINTS, moved))
    with pytest.raises(VerlLaunchError, match=r"^movedverl.engine.MegatronEngine.forward_backward_batch is not there"):
        check_engine("megatron")
    check_engine("veomni")  # the moved point is the Megatron engine's only


def test_the_cpu_stand_ins_names_are_rows_checked_for_a_cpu_run_only(moved_verl, monkeypatch):
    cpu_rows = [point for point in ep.ENTRY_POINTS if point.cpu]
    assert {point.where for point in cpu_rows} >= {
        "verl.workers.rollout.base._ROLLOUT_REGISTRY", "verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._materialize_batch",
        "verl.workers.rollout.llm_server.LLMServerClient._vllm_request_id",
        "verl.experimental.agent_loop.agent_loop.AgentLoopWorker._run_agent_loop",
        "verl.utils.distributed.initialize_global_process_group_ray"}
    assert not set(cpu_rows) & set(ep.of_engine("megatron")) and set(cpu_rows) <= {
        *ep.of_engine("megatron", cpu=True), *ep.of_engine("veomni", cpu=True)}
    # A registry the CPU rollout writes into, renamed: a CPU launch fails in one line naming it, a GPU one does not care.
    gone = ep.EntryPoint("trainer", moved_verl, "_ROLLOUT_REGISTRY", None, "cpu.plugin: a test", cpu=True)
    monkeypatch.setattr(ep, "ENTRY_POINTS", (*ep.ENTRY_POINTS, gone))
    from ablate.backends.verl.launch import VerlLaunchError, check_engine

    with pytest.raises(VerlLaunchError, match=r"^movedverl.engine._ROLLOUT_REGISTRY is not there: movedverl.engine "
                                              r"defines no _ROLLOUT_REGISTRY: ablate's hook replaces it with cpu.plugin"):
        check_engine("veomni", cpu=True)
    check_engine("veomni")
    with pytest.raises(ep.EntryPointMissing, match="movedverl.engine has no _ROLLOUT_REGISTRY"):
        ep.verify(gone)  # the live check, where a stand-in wraps a name in place


def test_a_module_that_is_not_installed_is_named(monkeypatch):
    gone = ep.EntryPoint("veomni", "verl.workers.engine.nothing_here", "Engine.run", ("self",), "a seam method")
    monkeypatch.setattr(ep, "ENTRY_POINTS", (*ep.ENTRY_POINTS, gone))
    with pytest.raises(ep.EntryPointMissing, match="verl.workers.engine.nothing_here.Engine.run is not there: module "
                                                   "verl.workers.engine.nothing_here is not installed"):
        ep.check_sources("veomni")


def test_replace_and_restore_keep_the_original(moved_verl):
    import importlib

    point = ep.EntryPoint("megatron", moved_verl, "MegatronEngine.forward_step",
                          ("self", "data", "loss_function", "forward_only"), "a test")
    module = importlib.import_module(moved_verl)
    original = module.MegatronEngine.forward_step
    assert ep.replace(point, lambda *args: "replaced") is original
    assert module.MegatronEngine().forward_step(None, None) == "replaced"
    assert ep.original(point) is original and ep.replaced(point)
    ep.restore(point)
    assert module.MegatronEngine.forward_step is original and not ep.replaced(point)
