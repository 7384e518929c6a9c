"""A step's batch in the order of its prompts, on verl's real TransferQueue trainer classes.

verl's replay buffer hands the trainer a step's samples in the order their rollouts finished;
:mod:`ablate.backends.verl.cpu.batch_order` sorts them by prompt (uids that count up in the
dataloader's order), then sample, then output, so that a run repeats bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from transfer_queue import KVBatchMeta  # noqa: E402

from ablate.backends.verl.cpu import PLUGIN_MODULE  # noqa: E402
from ablate.backends.verl.cpu.batch_order import CountingUuids, key_order, order_batches  # noqa: E402

FINISHED = ["u2_1_0", "u10_0_0", "u1_1_0", "u2_0_0", "u1_0_0", "u10_1_0"]  # the order rollouts finished in


def test_uuids_count_up_and_sort_in_the_order_they_were_made():
    uuids = CountingUuids()
    made = [str(uuids.uuid4()) for _ in range(300)]
    assert made == sorted(made) and len(set(made)) == 300
    assert made[0] == "00000000-0000-0000-0000-000000000001" and "_" not in "".join(made)  # verl splits keys at "_"
    assert uuids.UUID is __import__("uuid").UUID  # the rest of the module is the real one


def test_keys_sort_by_prompt_then_sample_then_output_as_numbers():
    assert sorted(["a_10_0", "a_2_1", "a_2_0", "b_0_0"], key=key_order) == ["a_2_0", "a_2_1", "a_10_0", "b_0_0"]
    assert sorted(["z", "a_1_0"], key=key_order) == ["a_1_0", "z"]  # a key of another form sorts by its text


def test_verls_replay_buffer_hands_out_the_batch_sorted_with_each_tag_beside_its_key(monkeypatch):
    from verl.trainer.ppo.v1 import replay_buffer

    class Buffer(replay_buffer.ReplayBuffer):  # verl's own method, wrapped on a subclass of verl's class
        pass

    trainer = SimpleNamespace()
    order_batches(trainer, Buffer)
    cleared = []
    monkeypatch.setattr(replay_buffer.tq, "kv_clear", lambda partition_id, keys: cleared.append((partition_id, keys)))
    snapshot = {key: {"status": "success", "key": key} for key in FINISHED}
    batch = Buffer._materialize_batch(SimpleNamespace(), "train", ["u10", "u1", "u2"], snapshot)
    assert isinstance(batch, KVBatchMeta) and batch.partition_id == "train"
    assert batch.keys == ["u1_0_0", "u1_1_0", "u10_0_0", "u10_1_0", "u2_0_0", "u2_1_0"]
    assert [tag["key"] for tag in batch.tags] == batch.keys
    assert cleared == [("train", ["u10", "u1", "u2"])]
    assert isinstance(trainer.uuid, CountingUuids)
    order_batches(trainer, Buffer)  # a second install wraps nothing twice
    assert Buffer._materialize_batch(SimpleNamespace(), "train", ["u1"], snapshot).keys == ["u1_0_0", "u1_1_0"]


def test_the_plugin_orders_the_trainer_only_once_the_trainer_imports_it():
    """``import verl`` with the plugin leaves the trainer's module unimported (seconds of every process's start)."""
    script = (
        "import sys, verl\n"
        "assert 'verl.trainer.ppo.v1.trainer_base' not in sys.modules\n"
        "from verl.trainer.ppo.v1 import replay_buffer, trainer_base\n"
        "print(type(trainer_base.uuid).__name__, str(trainer_base.uuid.uuid4()),\n"
        "      replay_buffer.ReplayBuffer._materialize_batch._ablate_sorted,\n"
        "      replay_buffer.ReplayBufferAsync._materialize_batch is replay_buffer.ReplayBuffer._materialize_batch)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE})
    assert done.returncode == 0, done.stderr[-3000:]
    # the last line: importing verl's trainer imports its engines, and VeOmni logs to stdout when imported
    assert done.stdout.splitlines()[-1].split() == ["CountingUuids", "00000000-0000-0000-0000-000000000001", "True",
                                                    "True"]
