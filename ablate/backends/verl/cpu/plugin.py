"""Imported by verl in every one of its processes (``VERL_USE_EXTERNAL_MODULES``), at ``import verl``.

It registers the CPU platform (selected by ``VERL_PLATFORM=cpu``), applies the CPU patches of the
cell's engine (``ABLATE_VERL_CPU_ENGINE``),
names each rollout request after its sample (:mod:`.request_ids`), orders each step's batch
by prompt and sample (:mod:`.batch_order`) and registers the CPU rollout
by name. verl imports it from inside its own ``__init__``, and in a
Ray actor of the CPU rollout from inside :mod:`.rollout` itself (unpickling the actor class
imports its module, which imports verl), so nothing here imports :mod:`.rollout`: the registries
take a loader and a dotted path.
"""

import importlib
import os

from verl.workers.rollout.replica import RolloutReplicaRegistry

from ablate.backends.verl import entry_points as ep
from ablate.backends.verl.cpu import ENGINE_ENV, ROLLOUT_NAME, platform  # noqa: F401  (platform registers itself)
from ablate.backends.verl.cpu import batch_order, request_ids
from ablate.backends.verl.cpu.patches import apply_all

ROLLOUT_MODULE = "ablate.backends.verl.cpu.rollout"

apply_all(os.environ.get(ENGINE_ENV, "megatron"))
request_ids.install()
batch_order.install()
RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: importlib.import_module(ROLLOUT_MODULE).CpuReplica)
ep.original(ep.cpu_point("verl.workers.rollout.base", "_ROLLOUT_REGISTRY"))[(ROLLOUT_NAME, "async")] = (
    f"{ROLLOUT_MODULE}.CpuServerAdapter")
