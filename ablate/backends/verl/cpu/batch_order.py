"""A step's batch in the order of its prompts, whatever order its samples finish in.

verl's TransferQueue trainer names each prompt with a fresh ``uuid4`` (``TrainerBase.
_fetch_one_gen_batch``) and its replay buffer hands the trainer a step's samples in the order
they were put (``ReplayBuffer._materialize_batch``), which is the order their rollouts finished.
Two runs of one cell then train on the same samples in another order: every batch mean adds the
same float32 values in another order, and micro-batches hold other samples, so the runs drift
apart in the last bits.

:func:`install` makes the order a function of the data: prompt uids count up in the order the
dataloader yields the prompts (still unique within a run, still in ``uuid`` form), and a batch's
keys, ``<uid>_<sample>_<output>``, are sorted by prompt, then sample, then output. A run is then
the same bit for bit whenever its samples are, which is what lets a probed run be compared with
an unprobed one exactly. :mod:`.plugin` installs it in every verl process; it takes effect
only in the trainer's, the one process that imports the trainer's module.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from ablate.backends.verl import entry_points as ep
from ablate.backends.verl.import_hooks import when_imported

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


class CountingUuids:
    """Stands in for the ``uuid`` module in one verl module: ``uuid4()`` counts up from 1.

    ``str(uuid.UUID(int=n))`` is zero-padded hexadecimal, so the uids sort in the order they were made.
    """

    def __init__(self) -> None:
        self._numbers: Iterator[int] = itertools.count(1)
        self._lock = threading.Lock()

    def uuid4(self) -> uuid.UUID:
        with self._lock:
            return uuid.UUID(int=next(self._numbers))

    def __getattr__(self, name: str) -> Any:  # everything else is the real module's
        return getattr(uuid, name)


def key_order(key: str) -> tuple[str, int, int] | tuple[str]:
    """``"<uid>_<sample>_<output>"`` as (uid, sample, output); any other key sorts by its text."""
    parts = key.split("_")
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return parts[0], int(parts[1]), int(parts[2])
    return (key,)


def sorted_batch(batch: Any) -> Any:
    """The same ``KVBatchMeta``, its keys (and their tags) sorted by :func:`key_order`."""
    order = sorted(range(len(batch.keys)), key=lambda i: key_order(batch.keys[i]))
    if order == list(range(len(batch.keys))):
        return batch
    return dataclasses.replace(batch, keys=[batch.keys[i] for i in order], tags=[batch.tags[i] for i in order])


def install() -> None:
    """Counting prompt uids in verl's TransferQueue trainer and sorted batches from its replay buffer.

    Once that trainer's module is imported: only the trainer's process imports it.
    """
    def order(trainer_base: Any) -> None:
        from verl.trainer.ppo.v1 import replay_buffer  # imported by trainer_base already

        ep.verify(ep.cpu_point(TRAINER_MODULE, "uuid"), ep.cpu_point(replay_buffer.__name__, "ReplayBuffer._materialize_batch"))
        order_batches(trainer_base, replay_buffer.ReplayBuffer)

    when_imported(TRAINER_MODULE, order)


def order_batches(trainer_module: Any, buffer_class: type) -> None:
    """Give ``trainer_module`` counting uuids and wrap ``buffer_class._materialize_batch``."""
    if getattr(buffer_class._materialize_batch, "_ablate_sorted", False):
        return
    trainer_module.uuid = CountingUuids()
    materialize = buffer_class._materialize_batch

    @functools.wraps(materialize)
    def materialize_sorted(self, *args, **kwargs):
        return sorted_batch(materialize(self, *args, **kwargs))

    materialize_sorted._ablate_sorted = True
    buffer_class._materialize_batch = materialize_sorted
