"""A rollout on the CPU for verl 0.9.1's agent loop that returns R3's ``routed_experts``.

:class:`CpuReplica` (a verl ``RolloutReplica``) starts one Ray actor per replica,
:class:`CpuRolloutServer`: transformers' Qwen3-MoE on float32, sampling token by token. It records
the experts its own forward chose in every MoE layer, and adds Gaussian noise to its router
logits (standard deviation from ``ABLATE_VERL_CPU_ROUTER_NOISE``, in logit units) before the
top-k, as the routers of a real inference engine differ from the trainer's in kernels and
precision: its routes then disagree with the trainer's and replay has something to fix.
Each request draws its samples and its router noise from generators seeded by the rollout seed,
the training step and the request id (:func:`request_seed`), never from a stream shared by the
requests: the ids name the samples (:mod:`.request_ids`), so a cell repeats bit for bit whatever
order the agent loop's requests arrive in.
:class:`CpuServerAdapter` (a verl ``BaseRollout``) lives in the hybrid training worker and sends
the trainer's weights to that actor at every weight sync. Both are registered in verl's two
rollout registries by :mod:`.plugin`; the only verl code wrapped for the rollout is the agent
loop's request id (:mod:`.request_ids`).
"""

from __future__ import annotations

import asyncio
import os
import re

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from ablate.backends.verl.cpu import ROUTER_NOISE_ENV
from ablate.seeding import stream_seed

_EXPERT_WEIGHT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def server_name(replica_rank: int) -> str:
    return f"ablate_cpu_rollout_{replica_rank}"


def request_seed(seed: int, global_steps, request_id: str) -> int:
    """A request's own seed, the stream of the rollout seed, the step (None before the first) and the request id."""
    return stream_seed(int(seed), "rollout-request", str(global_steps), request_id)


class NoisyRouters:
    """Noise on the router logits of every MoE layer of a transformers Qwen3-MoE, and their choices.

    A forward hook on each router replaces its top-k by the top-k of the noisy logits (the
    experts then run on those), and keeps the chosen ids of the latest forward per layer.
    """

    def __init__(self, model, noise: float) -> None:
        self.noise = noise
        #: set for each request before its forwards (:meth:`CpuRolloutServer._generate`).
        self.generator: torch.Generator | None = None
        self.chosen: list[torch.Tensor] = []
        self.routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
        if not self.routers:
            raise RuntimeError(f"{type(model).__name__} has no MoE routers (modules named '*.mlp.gate')")
        for router in self.routers:
            router.register_forward_hook(self._route)

    def _route(self, router, inputs, output):
        logits = output[0]
        if self.noise > 0:
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.generator, dtype=logits.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.chosen.append(ids)
        return output[0], weights.to(output[1].dtype), ids

    def last_forward(self) -> torch.Tensor:
        """``[tokens, MoE layers, topk]`` expert ids of the latest forward."""
        routes = torch.stack(self.chosen[-len(self.routers):], dim=1)
        self.chosen.clear()
        return routes


class CpuRolloutServer:
    def __init__(self, config, model_config, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        self.config, self.replica_rank = config, replica_rank
        torch.set_num_threads(1)
        path = model_config.get("local_path", None) or model_config.get("path")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id
        self.routers = NoisyRouters(self.model, float(os.environ.get(ROUTER_NOISE_ENV, "0")))
        self.global_steps = None
        self.weight_updates = 0
        self.lock = asyncio.Lock()

    @torch.no_grad()
    def _generate(self, prompt_ids, sampling_params, request_id):
        """Sample a response, then one forward over every token fed forward gives routes and log-probs.

        The routes and log-probs come from the same forward (the same router noise), so the
        rollout log-probs are those of the routes it records. The request's samples and noise
        come from its own generators (:func:`request_seed`).
        """
        seed = request_seed(self.config.seed, self.global_steps, str(request_id))
        sampler = torch.Generator().manual_seed(seed)
        self.routers.generator = torch.Generator().manual_seed(seed ^ 1)
        params = dict(sampling_params)
        limit = int(params.get("max_tokens", params.get("max_new_tokens", self.config.response_length)))
        limit = max(1, min(limit, self.config.response_length))
        temperature = float(params.get("temperature", 1.0))
        sequence, response = list(prompt_ids), []
        for _ in range(limit):
            logits = self.model(torch.tensor([sequence])).logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=sampler))
            response.append(token)
            sequence.append(token)
            if token == self.eos:
                break
        self.routers.chosen.clear()
        logits = self.model(torch.tensor([sequence[:-1]])).logits[0].float()
        routes = self.routers.last_forward().to(torch.int32).numpy()  # [len(prompt) + len(response) - 1, layers, k]
        scale = max(temperature, 1e-6)
        logprobs = torch.log_softmax(logits[len(prompt_ids) - 1:] / scale, -1)
        chosen = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
        return response, (chosen if params.get("logprobs") else None), routes

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None, **kwargs):
        async with self.lock:
            response, logprobs, routes = await asyncio.to_thread(self._generate, prompt_ids, sampling_params, request_id)
        return TokenOutput(token_ids=response, log_probs=logprobs,
                           routed_experts=routes if self.config.enable_rollout_routing_replay else None,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})

    async def load_weights(self, named, global_steps=None):
        """The trainer's HF-named weights; per-expert tensors fused again (transformers 5 keeps experts fused)."""
        state, experts = {}, {}
        for name, tensor in named:
            match = _EXPERT_WEIGHT.match(name)
            if match:
                experts.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = tensor
            else:
                state[name] = tensor
        for prefix, per_expert in experts.items():
            ids = sorted(per_expert)
            state[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([per_expert[i]["gate_proj"], per_expert[i]["up_proj"]], 0) for i in ids])
            state[f"{prefix}.down_proj"] = torch.stack([per_expert[i]["down_proj"] for i in ids])
        async with self.lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"CPU rollout weight sync: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        self.global_steps = global_steps
        self.weight_updates += 1
        return len(state)

    async def set_global_steps(self, global_steps):
        self.global_steps = global_steps

    async def wake_up(self, tags=None):
        pass

    async def sleep(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def abort_all_requests(self, reset_prefix_cache=True, reject_request=False):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class CpuReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        server = ray.remote(CpuRolloutServer).options(
            name=server_name(self.replica_rank), num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(self.config, self.model_config, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"ablate-cpu-replica-{self.replica_rank}:0"


class CpuServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank, self.is_leader = rank // world, rank % world == 0

    async def resume(self, tags):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
        named = [(name, tensor.detach().to("cpu", torch.float32).clone()) for name, tensor in weights]  # every rank drains
        if self.is_leader:
            server = ray.get_actor(server_name(self.replica_rank))
            await server.load_weights.remote(named, kwargs.get("global_steps"))

