"""The metric and log-prob paths through verl's own code, from the hook to the run store and W&B.

The hook runs inside verl's real update loop: ``RayPPOTrainer._update_actor`` hands the batch to
``TrainingWorker.train_mini_batch`` (mini-batches, ``update_lr_scheduler`` flag),
``TrainingWorker.train_batch`` and ``BaseEngine.train_batch``, whose ``forward_backward_batch``
is the hook's wrapper around real router replay; verl's ``postprocess_batch_func``,
``_postprocess_output`` (data-parallel gather), the ``actor/`` prefix and ``reduce_metrics``
follow. The reduced metrics then go through verl's file logger in a child process that the
cell runner follows, ``split_metrics``, the run store and an offline W&B run, both read back.

The old log-probs come the same way: ``RayPPOTrainer._compute_old_log_prob``,
``ActorRolloutRefWorker.compute_log_prob``, ``TrainingWorker.infer_batch`` and
``BaseEngine.infer_batch``, whose forward-only ``forward_backward_batch`` is the hook's wrapper.
The update loop then gets them in its micro-batches, where the PPO ratio is checked.

Only the Megatron engine's internals are stood in for: its model forward is the router replay of
``replay_routers.py``, and its log-prob of a token a function of the experts its routers used.
Every verl function on both paths is the real one.
"""

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl.protocol", reason="verl 0.9.1 is not installed here: build it with .ci/verl-env.sh")
pytest.importorskip("megatron.core", reason="megatron-core is not installed here: build it with .ci/verl-env.sh")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ablate.diagnostics import SCHEMA, keys_in  # noqa: E402
from replay_routers import NUM_EXPERTS, NUM_LAYERS, hook_installer, left_padded, replay, router_model  # noqa: E402
from verl.workers.engine.base import BaseEngine  # noqa: E402

pytestmark = pytest.mark.verl
routers = pytest.fixture(scope="module")(router_model)
hooked = pytest.fixture()(hook_installer)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"
SEQUENCES, SEQ_LEN, RESPONSE = 4, 12, 5


def log_probs_of(maps: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A stand-in log-prob per token: a function of the experts each router used, and its logits."""
    return -(maps * logits.permute(1, 0, 2)).sum((1, 2)) / 16


class StandInEngine:
    """A Megatron engine whose forward_backward_batch is the hook's wrapper around router replay.

    A token's router logits follow from its input id, so every pass over a token routes it alike
    whatever micro-batch it is in. ``forward_only_passes`` keeps the log-probs of every forward-
    only pass the hook ran; ``ratios`` the largest ``|log p - old log p|`` of each update micro-batch
    whose batch holds old log-probs.
    """

    train_batch = BaseEngine.train_batch
    infer_batch = BaseEngine.infer_batch

    def __init__(self, hook, model, config):
        self.hook, self.model, self.tf_config = hook, model, config
        self.router_logits = torch.randn(100, NUM_LAYERS, NUM_EXPERTS, generator=torch.Generator().manual_seed(8))
        self.forward_only_passes: list[torch.Tensor] = []
        self.ratios: list[float] = []

    def micro_batches(self, engine, data, loss_function, forward_only=False):
        """The engine's micro-batch loop: verl's own micro-batching and output post-processing."""
        from verl.utils.metric.utils import Metric
        from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
        from verl.workers.utils.padding import no_padding_2_padding

        batches, indices = prepare_micro_batches(data)  # one data-parallel rank: nothing to balance
        outputs = []
        for micro in batches:
            input_ids = micro["input_ids"]
            logits = self.router_logits[input_ids.values()].permute(1, 0, 2)
            maps, _ = replay(self.model, self.tf_config, micro["routed_experts"], input_ids, micro["response_mask"],
                             logits)
            log_probs = log_probs_of(maps, logits)
            nested = torch.nested.nested_tensor_from_jagged(log_probs, offsets=input_ids.offsets())
            if forward_only:
                outputs.append({"loss": 1.0, "metrics": {}, "model_output": {"log_probs": nested, "entropy": nested}})
                continue
            if "old_log_probs" in micro.keys():
                ratio = no_padding_2_padding(nested, micro) - micro["old_log_probs"]
                self.ratios.append(float(ratio[micro["response_mask"].bool()].abs().max()))
            outputs.append({"loss": 0.5, "metrics": {"actor/pg_loss": Metric("mean", 0.5)}})
        output = postprocess_batch_func(output_lst=outputs, indices=indices, data=data)
        if forward_only:
            self.forward_only_passes.append(output["model_output"]["log_probs"])
        return output

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from ablate.backends.verl import engines

        return engines.hooked_call(self.hook, self.micro_batches, self, data, loss_function, forward_only)

    def train_mode(self, **kwargs):
        return contextlib.nullcontext()

    def eval_mode(self, **kwargs):
        return contextlib.nullcontext()

    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def is_mp_src_rank_with_outputs(self):
        return True

    def optimizer_zero_grad(self):
        pass

    def optimizer_step(self):
        return 1.0

    def lr_scheduler_step(self):
        return 1e-6


def actor_worker(engine):
    """verl's ActorRolloutRefWorker and TrainingWorker around the stand-in engine, with no model."""
    from verl.utils.profiler import DistProfiler, ProfilerConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    worker = TrainingWorker.__new__(TrainingWorker)
    worker.engine = engine
    worker.loss_fn = lambda **kwargs: None  # the stand-in engine computes no loss
    worker.engine_config = SimpleNamespace(forward_only=False, use_dynamic_bsz=True, max_token_len_per_gpu=2 * SEQ_LEN,
                                           micro_batch_size_per_gpu=1, use_fused_kernels=False,
                                           infer_max_token_len_per_gpu=3 * SEQ_LEN, infer_micro_batch_size_per_gpu=1)
    worker.model_config = {"use_remove_padding": True}
    worker.profiler = DistProfiler(rank=0, config=ProfilerConfig())  # profiling off
    worker.flops_counter = SimpleNamespace(estimate_flops=lambda tokens, seconds, images_seqlens=None: (1.0, 4.0))
    worker.device_name = "cpu"
    actor = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    actor.actor = worker
    actor.enable_routing_replay = True  # what the worker sets from router_replay.mode=R3
    actor.profiler = worker.profiler
    return actor


@contextlib.contextmanager
def gloo_average():
    """gloo has no ReduceOp.AVG, which verl's _postprocess_output uses on its loss: average by hand."""
    all_reduce = dist.all_reduce

    def reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.AVG:
            result = all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            tensor /= dist.get_world_size(group)
            return result
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = reduce
    try:
        yield
    finally:
        dist.all_reduce = all_reduce


def padded_batch():
    """verl's padded batch of 4 left-padded sequences with recorded routes, as the trainer holds it."""
    from verl import DataProto

    generator = torch.Generator().manual_seed(3)
    routed, attention_mask = left_padded([12, 9, 7, 11], SEQ_LEN, generator)
    input_ids = torch.randint(0, 100, (SEQUENCES, SEQ_LEN), generator=generator)
    batch = DataProto.from_dict(tensors={
        "input_ids": input_ids,
        "prompts": input_ids[:, :-RESPONSE].clone(),
        "responses": input_ids[:, -RESPONSE:].clone(),
        "attention_mask": attention_mask,
        "response_mask": attention_mask[:, -RESPONSE:].clone(),
        "position_ids": torch.arange(SEQ_LEN).expand(SEQUENCES, SEQ_LEN).clone(),
        "routed_experts": routed,
    })
    batch.meta_info["global_token_num"] = attention_mask.sum(-1).tolist()  # as RayPPOTrainer.fit sets it
    return batch


def trainer_with(engine):
    """verl's RayPPOTrainer with its actor worker group around ``engine``; it calls the group directly."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from ablate.backends.verl.launch import compose

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = compose(EXAMPLES, "ablate_ppo", [
        "actor_rollout_ref.model.path=/tmp/unused", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=1",
    ])
    trainer.actor_rollout_wg = actor_worker(engine)
    return trainer


def update_step_metrics(trainer, batch) -> dict:
    """One actor update of verl's trainer (two mini-batches): its reduced metrics, as fit() logs them."""
    from verl.utils.metric import reduce_metrics

    with gloo_average():
        output = trainer._update_actor(batch)
    return reduce_metrics(output.meta_info["metrics"])


def test_hook_keys_reach_the_run_store_and_wandb_through_verls_metric_path(routers, hooked, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    from ablate.backends.verl import backend
    from ablate.runner import run_cell
    from ablate.store import read_records
    from ablate.tracking import find_offline_runs, read_offline_run

    model, config = routers
    hook = hooked("random", 0.5, seed=2)
    logged = update_step_metrics(trainer_with(StandInEngine(hook, model, config)), padded_batch())
    hook_keys = keys_in("replay") + keys_in("routing")
    assert {f"actor/{key}" for key in hook_keys} <= set(logged)  # verl's prefix on every actor metric
    # Two mini-batches of two sequences, pooled into one step: R3 replays every token but the last.
    assert logged["actor/replay/valid_routes"] == (12 + 9 + 7 + 11 - SEQUENCES) * NUM_LAYERS
    assert logged["actor/replay/unrecorded_routes"] == 0
    assert logged["actor/replay/budget_realized"] == pytest.approx(0.5, abs=0.02)

    def build_command(cell, metrics_file, *, launch=True):
        """main_ppo stands aside: a child process logs the step with verl's own file logger."""
        script = ("import json, sys\nfrom verl.utils.tracking import Tracking\n"
                  "Tracking('ablate', 'cell', default_backend=['file']).log(data=json.loads(sys.argv[1]), step=1)\n")
        data = json.dumps({key: float(value) for key, value in logged.items()})
        return [sys.executable, "-c", script, data], {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_file)}

    monkeypatch.setattr(backend, "build_command", build_command)
    with initialize_config_module(config_module="ablate.conf", version_base="1.3"):
        cfg = compose("config", overrides=["backend=verl", "policy=random", "budget=0.5", f"store_dir={tmp_path}"])
    run_cell(cfg)
    (cell,) = [path for path in (tmp_path / "adhoc").iterdir() if not path.name.startswith("_")]
    (record,) = read_records(cell).to_dict("records")
    (run_dir,) = find_offline_runs(cell / "wandb")
    run = read_offline_run(run_dir)
    assert run.complete
    (history,) = run.history
    for key in hook_keys:
        assert key in SCHEMA
        expected = float(logged[f"actor/{key}"])
        for where, value in (("run store", record[key]), ("W&B history", history[key])):
            assert (math.isnan(value) and math.isnan(expected)) or value == pytest.approx(expected), f"{where}: {key}"
    assert record["replay/valid_routes"] == logged["actor/replay/valid_routes"]
    assert not any(key.startswith("actor/replay") or key.startswith("actor/routing") for key in record)


@pytest.mark.parametrize("policy", ["random", "mismatch"])
def test_old_log_probs_come_from_a_replayed_forward_and_the_ratio_starts_at_one(routers, hooked, policy):
    """Through verl's old-log-prob and update paths, the first update's PPO ratio is exactly 1.

    ``mismatch`` selects on native routes: its old-log-prob call runs a native pass first, whose
    log-probs verl never sees (they differ from the replayed ones).
    """
    from verl import DataProto
    from verl.utils.metric import reduce_metrics

    model, config = routers
    engine = StandInEngine(hooked(policy, 0.5, seed=2), model, config)
    trainer = trainer_with(engine)
    batch = padded_batch()
    with gloo_average():
        old_log_probs, mfu = trainer._compute_old_log_prob(batch)
    assert mfu > 0
    assert len(engine.forward_only_passes) == (2 if policy == "mismatch" else 1)
    replayed = engine.forward_only_passes[-1]
    assert torch.equal(old_log_probs.batch["old_log_probs"], no_padding(replayed, batch))
    if policy == "mismatch":
        assert not torch.equal(engine.forward_only_passes[0].values(), replayed.values())

    batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": old_log_probs.batch["old_log_probs"]}))
    with gloo_average():
        metrics = reduce_metrics(trainer._update_actor(batch).meta_info["metrics"])
    assert len(engine.ratios) == 2 and engine.ratios == [0.0, 0.0]  # two mini-batches, both at ratio 1
    assert metrics["actor/replay/replayed_routes"] > 0


def no_padding(log_probs, batch):
    """verl's response-aligned padded layout of per-token log-probs, as _compute_old_log_prob makes it."""
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    return no_padding_2_padding(log_probs, left_right_2_no_padding(batch.to_tensordict())).float()
