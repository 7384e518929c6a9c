"""Request ids that name a sample, so that the CPU rollout can seed each request from its id.

verl's agent loop sends a step's requests to the rollout server concurrently and names each one
with a fresh ``uuid4`` (``LLMServerClient._vllm_request_id``); the order they arrive in is not
fixed either. A rollout that drew its samples from one stream per server would then give a
request whatever the requests before it left of that stream, and two runs of one cell would
differ from their first step. verl's own ``rollout.full_determinism`` does not help here: in
its TransferQueue trainer every request of a step gets the id ``det-0``.

:func:`install` gives each request the id of the sample it generates, ``ablate-<split>-<step>-
<dataset index>-<sample>``: the agent loop's trajectory (``get_trajectory_info``: step, the
prompt's dataset index, validation or not) and the sample's number within its prompt's group
(``session_id`` in the TransferQueue worker, ``rollout_n`` in the classic one). The
server (:mod:`.rollout`) seeds the request's sampling and router noise from it. Applied in every
verl process by :mod:`.plugin`; in processes without an agent loop it changes nothing.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Mapping
from typing import Any

#: The id of the sample the current agent-loop task generates; each task has its own context.
SAMPLE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("ablate_sample_id", default=None)
PREFIX = "ablate-"


def sample_id(trajectory: Mapping[str, Any], session: Any = None) -> str:
    """``ablate-train-3-17-1``: split, step, dataset index, sample within the prompt's group."""
    number = trajectory.get("rollout_n", 0) if session is None else session
    split = "val" if trajectory.get("validate") else "train"
    return f"{PREFIX}{split}-{trajectory.get('step')}-{trajectory.get('sample_index')}-{number}"


def install() -> None:
    """Name verl's requests after their samples in this process (once)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient

    from ablate.backends.verl import entry_points as ep

    ep.verify(ep.cpu_point(AgentLoopWorker.__module__, "AgentLoopWorker._run_agent_loop"),
              ep.cpu_point(LLMServerClient.__module__, "LLMServerClient._vllm_request_id"))
    name_requests(AgentLoopWorker, LLMServerClient)


def name_requests(worker_class: type, client_class: type) -> None:
    """Wrap ``worker_class._run_agent_loop`` (one task per sample) and ``client_class._vllm_request_id``."""
    if getattr(worker_class._run_agent_loop, "_ablate_sample_id", False):
        return
    run_agent_loop, request_id = worker_class._run_agent_loop, client_class._vllm_request_id

    @functools.wraps(run_agent_loop)
    async def run_with_sample_id(self, sampling_params, trajectory=None, *args, **kwargs):
        # the classic worker passes the trajectory by position, the TransferQueue one by name
        token = SAMPLE_ID.set(sample_id(trajectory or {}, kwargs.get("session_id")))
        try:
            return await run_agent_loop(self, sampling_params, trajectory, *args, **kwargs)
        finally:
            SAMPLE_ID.reset(token)

    @functools.wraps(request_id)
    def sample_request_id(self, request_id_of_caller: str) -> str:
        named = SAMPLE_ID.get()
        return named if named is not None else request_id(self, request_id_of_caller)

    run_with_sample_id._ablate_sample_id = True
    worker_class._run_agent_loop = run_with_sample_id
    client_class._vllm_request_id = sample_request_id
