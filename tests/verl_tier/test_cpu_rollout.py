"""The CPU rollout server's requests: each one's samples and router noise are its own.

A cell on ``backend=verl_cpu`` repeats bit for bit only if a request's response does not depend
on which requests the server answered before it: verl's agent loop sends them concurrently, in
no fixed order. These tests run the real server class on the tiny model, outside Ray.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("transformers")

from ablate.backends.verl.cpu import ROUTER_NOISE_ENV, assets  # noqa: E402
from ablate.backends.verl.cpu.rollout import CpuRolloutServer, request_seed  # noqa: E402

PROMPTS = {"det-0": [5, 6, 7, 8], "det-1": [5, 6, 7, 8], "det-2": [9, 10, 11]}  # det-0 and det-1: one GRPO group
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "logprobs": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = assets.ensure(tmp_path_factory.mktemp("cpu-rollout-assets"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROUTER_NOISE_ENV, "0.5")
        config = SimpleNamespace(seed=3, response_length=8, enable_rollout_routing_replay=True)
        made = CpuRolloutServer(config, {"path": str(folder["model"])}, replica_rank=0)
    made.global_steps = 1
    return made


def answer(server, order):
    async def all_of_them():
        return {request: await server.generate(PROMPTS[request], dict(SAMPLING), request) for request in order}

    return asyncio.run(all_of_them())


def as_plain(output):
    return output.token_ids, output.log_probs, np.asarray(output.routed_experts).tolist()


def test_a_requests_response_does_not_depend_on_the_order_requests_arrive_in(server):
    forward = answer(server, ["det-0", "det-1", "det-2"])
    backward = answer(server, ["det-2", "det-1", "det-0"])
    assert {r: as_plain(o) for r, o in forward.items()} == {r: as_plain(o) for r, o in backward.items()}


def test_two_samples_of_one_prompt_differ_and_so_do_two_steps(server):
    first = answer(server, ["det-0", "det-1"])
    assert as_plain(first["det-0"]) != as_plain(first["det-1"])  # a GRPO group needs distinct samples
    server.global_steps = 2
    try:
        later = answer(server, ["det-0"])
    finally:
        server.global_steps = 1
    assert as_plain(later["det-0"]) != as_plain(first["det-0"])


def test_request_seed_is_stable_across_processes_and_separates_its_inputs():
    assert request_seed(3, 1, "det-0") == request_seed(3, 1, "det-0")
    assert len({request_seed(3, 1, "det-0"), request_seed(3, 2, "det-0"), request_seed(4, 1, "det-0"),
                request_seed(3, 1, "det-1"), request_seed(3, None, "det-0")}) == 5
    # hashlib, not hash(): the same value in processes whose string hashes are salted differently
    code = "from ablate.backends.verl.cpu.rollout import request_seed; print(request_seed(3, 1, 'det-0'))"
    seen = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": salt},
                           capture_output=True, text=True, check=True).stdout.strip() for salt in ("1", "2")}
    assert seen == {str(request_seed(3, 1, "det-0"))}


def test_each_agent_loop_task_names_its_requests_after_its_sample_whatever_the_order():
    """Stand-ins with verl's call shapes: the classic worker passes the trajectory by position, the
    TransferQueue worker by name with the sample's ``session_id``; the tasks finish in reverse."""
    from ablate.backends.verl.cpu.request_ids import name_requests

    class Client:
        def _vllm_request_id(self, request_id):
            return "uuid-of-the-caller"

        async def generate(self, delay):
            await asyncio.sleep(delay)
            return self._vllm_request_id("caller")

    class Worker:
        client = Client()

        async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
            return await self.client.generate(kwargs["delay"])

    name_requests(Worker, Client)
    name_requests(Worker, Client)  # a second install changes nothing
    worker = Worker()
    step = {"step": 3, "sample_index": 17, "rollout_n": 0, "validate": False}

    async def a_step():
        return await asyncio.gather(
            worker._run_agent_loop({}, step, agent_name="single_turn_agent", delay=0.03),
            worker._run_agent_loop({}, trajectory=step, agent_name="single_turn_agent", session_id=1, delay=0.0),
            worker._run_agent_loop({}, {**step, "rollout_n": 2, "validate": True}, agent_name="x", delay=0.01))

    assert asyncio.run(a_step()) == ["ablate-train-3-17-0", "ablate-train-3-17-1", "ablate-val-3-17-2"]
    assert Client()._vllm_request_id("caller") == "uuid-of-the-caller"  # outside an agent-loop task


def test_the_plugin_names_requests_in_verls_own_classes():
    import inspect

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient

    from ablate.backends.verl.cpu import request_ids

    request_ids.install()
    wrapped = AgentLoopWorker._run_agent_loop
    assert wrapped._ablate_sample_id
    assert list(inspect.signature(wrapped.__wrapped__).parameters)[:3] == ["self", "sampling_params", "trajectory"]
    assert LLMServerClient._vllm_request_id.__wrapped__.__name__ == "_vllm_request_id"
