"""What the replay hook makes the host wait for: its deliberate reads, and every aten op that would sync a GPU.

On a GPU, any op whose result the host must read (``.item()``, ``bool(t)``, ``nonzero``, a boolean
index, ``torch.equal``) drains the device's queue of kernels. The hook reads the device on purpose
only through :func:`to_host` (one transfer for a micro-batch's plan, one for a step's counts), and
:class:`OpCounter` counts both those reads and, with a ``TorchDispatchMode``, every aten op and
every op of :data:`SYNCING_OPS` the code runs, on any device: a CPU run counts what a GPU run
would wait for. ``torch.cuda.set_sync_debug_mode`` checks the same on a GPU.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result the host must read before it can go on (a GPU waits for every kernel before them).
SYNCING_OPS = frozenset({
    "_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "unique_dim_consecutive",
})

_COUNTERS: list[OpCounter] = []


def to_host(tensor: Tensor) -> Tensor:
    """``tensor`` on the CPU, as the one deliberate read of the device it is (counted as a sync)."""
    for counter in _COUNTERS:
        counter.syncs["to_host"] += 1
    return tensor.to("cpu", copy=True)


@dataclass
class OpCounter:
    """aten ops and syncs seen inside :meth:`counting` (nested counts stack)."""

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    @contextmanager
    def counting(self):
        mode = _Mode(self)
        _COUNTERS.append(self)
        try:
            with mode:
                yield self
        finally:
            _COUNTERS.remove(self)


class _Mode(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        self.counter.ops[name] += 1
        if name in SYNCING_OPS or _boolean_index(name, args) or (
                name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4):
            self.counter.syncs[name] += 1
        return func(*args, **kwargs)


def _boolean_index(name: str, args: tuple) -> bool:
    """``t[mask]`` and ``t[mask] = v``: a boolean index is a ``nonzero`` inside the kernel."""
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_") or len(args) < 2:
        return False
    return any(isinstance(index, Tensor) and index.dtype == torch.bool for index in args[1] or ())
