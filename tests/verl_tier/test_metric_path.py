"""The metric path through verl's own code, from the hook to the run store and W&B.

The hook runs inside verl's real update loop: ``RayPPOTrainer._update_actor`` hands the batch to
``TrainingWorker.train_mini_batch`` (mini-batches, ``update_lr_scheduler`` flag),
``TrainingWorker.train_batch`` and ``BaseEngine.train_batch``, whose ``forward_backward_batch``
is the hook's wrapper around real router replay; verl's ``postprocess_batch_func``,
``_postprocess_output`` (data-parallel gather), the ``actor/`` prefix and ``reduce_metrics``
follow. The reduced metrics then go through verl's file logger in a child process that the
cell runner follows, ``split_metrics``, the run store and an offline W&B run, both read back.

Only the Megatron engine's internals are stood in for (its model forward is the router replay of
``replay_routers.py``); every verl function on the metric path is the real one.
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

pytestmark = pytest.mark.verl
routers = pytest.fixture(scope="module")(router_model)
hooked = pytest.fixture()(hook_installer)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"
SEQUENCES, SEQ_LEN, RESPONSE = 4, 12, 5


def stand_in_engine(hook, model, config):
    """A Megatron engine whose forward_backward_batch is the hook's wrapper around router replay."""
    from verl.utils.metric.utils import Metric
    from verl.workers.engine.base import BaseEngine
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

    from ablate.backends.verl import patch

    def micro_batches(engine, data, loss_function, forward_only=False):
        """The engine's micro-batch loop: verl's own micro-batching and output post-processing."""
        batches, indices = prepare_micro_batches(data)  # one data-parallel rank: nothing to balance
        outputs = []
        for index, micro in enumerate(batches):
            tokens = int(micro["input_ids"].offsets()[-1])
            logits = torch.randn(NUM_LAYERS, tokens, NUM_EXPERTS, generator=torch.Generator().manual_seed(index))
            replay(model, config, micro["routed_experts"], micro["input_ids"], micro["response_mask"], logits)
            outputs.append({"loss": 0.5, "metrics": {"actor/pg_loss": Metric("mean", 0.5)}})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    class Engine:
        tf_config = config
        train_batch = BaseEngine.train_batch

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            return patch.hooked_call(hook, micro_batches, self, data, loss_function, forward_only)

        def train_mode(self, **kwargs):
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

    return Engine()


def actor_worker(engine):
    """verl's ActorRolloutRefWorker and TrainingWorker around the stand-in engine, with no model."""
    from verl.utils.profiler import DistProfiler, ProfilerConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    worker = TrainingWorker.__new__(TrainingWorker)
    worker.engine = engine
    worker.loss_fn = lambda **kwargs: None  # the stand-in engine computes no loss
    worker.engine_config = SimpleNamespace(forward_only=False, use_dynamic_bsz=True, max_token_len_per_gpu=2 * SEQ_LEN,
                                           micro_batch_size_per_gpu=1, use_fused_kernels=False)
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


def update_step_metrics(hook, model, config) -> dict:
    """One actor update of verl's trainer on a padded batch: its reduced metrics, as fit() logs them.

    The trainer calls the actor worker group directly, as it would call the Ray worker group.
    """
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.metric import reduce_metrics

    from ablate.backends.verl.launch import compose

    generator = torch.Generator().manual_seed(3)
    routed, attention_mask = left_padded([12, 9, 7, 11], SEQ_LEN, generator)
    batch = DataProto.from_dict(tensors={
        "input_ids": torch.randint(0, 100, (SEQUENCES, SEQ_LEN), generator=generator),
        "attention_mask": attention_mask,
        "response_mask": attention_mask[:, -RESPONSE:].clone(),
        "position_ids": torch.arange(SEQ_LEN).expand(SEQUENCES, SEQ_LEN).clone(),
        "routed_experts": routed,
    })
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = compose(EXAMPLES, "ablate_ppo", [
        "actor_rollout_ref.model.path=/tmp/unused", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=1",
    ])
    trainer.actor_rollout_wg = actor_worker(stand_in_engine(hook, model, config))
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
    logged = update_step_metrics(hook, model, config)
    hook_keys = keys_in("replay") + keys_in("routing")
    assert {f"actor/{key}" for key in hook_keys} <= set(logged)  # verl's prefix on every actor metric
    # Two mini-batches of two sequences, pooled into one step: R3 replays every token but the last.
    assert logged["actor/replay/valid_routes"] == (12 + 9 + 7 + 11 - SEQUENCES) * NUM_LAYERS
    assert logged["actor/replay/unrecorded_routes"] == 0
    assert logged["actor/replay/budget_realized"] == pytest.approx(0.5, abs=0.02)

    def build_command(cell, metrics_file):
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
