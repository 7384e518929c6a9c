"""The seam between a replay hook and a training engine: what crosses it, typed.

The hook (:class:`ablate.replay.hook.ReplayMaskHook`) chooses per-(token, layer) masks through the
session and counts routes; it knows no engine. An engine's seam (:class:`EngineSeam`) gives it what
only the engine knows, and nothing else:

- where a training call starts and ends, and what it holds (:meth:`EngineSeam.call_info`:
  forward-only or update, the step's last update, route layers, top-k, experts, each decoder
  layer's column in the route tensor);
- each micro-batch's rollout routes, handed to :meth:`HookSide.augmented_routes`, whose mask the
  seam sends through the engine's own packing as one extra route column (:func:`augment_routes`,
  :func:`split_augmented`, :func:`split_layers`), so that every router receives its layer's mask
  and row ids aligned with its rows without the seam repeating the engine's packing;
- each router's native top-k and the mask applied to it (``torch.where(mask, replayed, native)``),
  reported with :meth:`HookSide.observe` and, where gradients flow, router-logit gradients with
  :meth:`HookSide.add_fisher`;
- the rank layout: which rank counts a micro-batch (:meth:`EngineSeam.counting_rank`), and
  :meth:`EngineSeam.assemble`, the sum over the ranks that split one micro-batch's routes (each
  route counted once).

State that travels between these points lives in the seam object (dicts keyed by the ``id`` of
the engine's own objects, holding a reference so the id stays theirs), never as attributes added
to tensors or to the engine's objects.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

#: the column appended to each route: ``4 * (row id + 1) + 2 * replayed + valid`` (0 marks padding).
EXTRA_COLUMNS = 1
#: Outside the schema: R3 micro-batches the hook selected a mask for in the step, reported at
#: every step's last update call once the hook is installed (0 when verl gave it none), so that
#: a replay that silently does nothing is seen (:mod:`ablate.backends.verl.liveness`).
MICRO_BATCHES_KEY = "hook/micro_batches"


@dataclass(frozen=True)
class CallInfo:
    """What the hook needs to know about one training call that replays routes (verl's
    ``forward_backward_batch`` with R3).

    Every rank of the call knows all of it, including ranks whose model chunks hold no MoE
    layer: they take part in the hook's collectives too.
    """

    forward_only: bool
    #: the last update call of the training step (verl's ``update_lr_scheduler`` flag).
    last_update: bool
    num_tokens: int
    route_layers: int
    topk: int
    num_experts: int
    #: each decoder layer's column in the route tensor, None for dense layers.
    layer_columns: tuple[int | None, ...]

    @property
    def moe_columns(self) -> list[int]:
        """Columns of the route tensor that hold MoE routes, in MoE-layer order."""
        return [column for column in self.layer_columns if column is not None]

    def moe_layer(self, column: int) -> int:
        """The MoE-layer index (0-based, the Fisher estimate's row) of a route column."""
        return self.moe_columns.index(column)


class HookSide(Protocol):
    """What a seam calls of the hook, from inside the engine."""

    def current_call(self) -> CallInfo | None:
        """The call the hook is framing (None outside one): a seam replays only inside it."""

    def augmented_routes(self, chunk: int, rollout: Tensor, r3_mask: Tensor, offsets: Tensor, *,
                         counted: bool, zero_native: bool = False) -> Tensor:
        """One micro-batch's rollout routes with its replay mask, validity and row ids as an extra column
        (:func:`augment_routes`; ``zero_native``: the routes the mask leaves native all zeros)."""

    #: The call's rows of the micro-batch :meth:`augmented_routes` handled last: a seam whose router gets
    #: exactly that many rows (the engine neither padded nor split them) knows they are these.
    last_rows: slice

    def observe(self, column: int, rows: Tensor | slice, native: Tensor, scores: Tensor | None = None) -> None:
        """A router's native top-k of its rows, and its scores."""

    def add_fisher(self, layer: int, logit_grads: Tensor, valid: Tensor) -> None:
        """Per-token router-logit gradients of one MoE layer's valid rows."""


class EngineSeam(abc.ABC):
    """What the replay hook needs from one training engine, and nothing else."""

    #: the engine's name (``backend.engine``'s value).
    name: ClassVar[str]

    def __init__(self, hook: HookSide) -> None:
        #: the hook this seam hands micro-batches and routers to.
        self.hook = hook

    @abc.abstractmethod
    def call_info(self, engine: Any, data: Any, forward_only: bool) -> CallInfo | None:
        """The replaying call ``engine.forward_backward_batch(data, ...)`` is about to run, or None."""

    @abc.abstractmethod
    def counting_rank(self, info: CallInfo, layers: Sequence[int]) -> bool:
        """True on the one rank (and model chunk) of a model-parallel group that counts a micro-batch.

        ``layers`` are the global numbers (1-based) of the decoder layers whose routers this rank's
        model chunk holds.
        """

    @abc.abstractmethod
    def assemble(self, parts: Tensor) -> Tensor:
        """Sum over the ranks that split one micro-batch's routes, each entry written by one of them."""

    @abc.abstractmethod
    def install(self) -> None:
        """Replace the engine's entry points so that they reach the hook."""

    @abc.abstractmethod
    def uninstall(self) -> None:
        """Put back every name :meth:`install` replaced."""

    def end_pass(self) -> None:
        """Forget what one run of the engine's forward-backward left in the seam."""


# --------------------------------------------------------------------- the active hook
_ACTIVE: list[Any] = []


def active_hook() -> Any:
    return _ACTIVE[0] if _ACTIVE else None


def install(hook: Any) -> Any:
    """Route the engine's replay through ``hook`` (its ``seam``). :func:`uninstall` restores the engine."""
    uninstall()
    hook.seam.install()
    _ACTIVE.append(hook)
    return hook


def uninstall() -> None:
    """Restore every name the active hook's seam replaced."""
    while _ACTIVE:
        _ACTIVE.pop().seam.uninstall()


# -------------------------------------------------------------------- routes with the mask
def augment_routes(rollout: Tensor, mask: Tensor, valid: Tensor, first_row: int, *, zero_native: bool = False) -> Tensor:
    """``[rows, layers, topk + 1]`` int32: routes, then one column packing the replay mask, the valid
    flag and the row id: ``4 * (row id + 1) + 2 * mask + valid``.

    Row ids count from ``first_row``, the micro-batch's first row in the call's token order.
    An engine pads and splits this tensor exactly as it does the routes, so every router gets
    its own rows' mask, validity and ids; padding the engine adds is zeros (row id -1). One
    column, not three: the engine packs and copies the routes once per router, and so the column.
    ``zero_native``: a route the mask leaves native is all zeros, which an engine that replays no
    route with a repeated expert (VeOmni's R3) routes natively itself: the mask is applied here,
    once for the micro-batch, rather than at each router.
    """
    rows, layers, topk = rollout.shape
    row_ids = torch.arange(4 * (first_row + 1), 4 * (first_row + rows + 1), 4, dtype=torch.int32, device=rollout.device)
    augmented = torch.empty(rows, layers, topk + 1, dtype=torch.int32, device=rollout.device)
    if zero_native:  # converted while multiplied
        torch.mul(rollout, mask[..., None], out=augmented[..., :topk])
    else:  # converted while copied: no int32 copy of the routes in between
        augmented[..., :topk] = rollout
    torch.add((row_ids + valid.to(torch.int32))[:, None], mask, alpha=2, out=augmented[..., topk])
    return augmented


class LayerTargets:
    """One router's share of augmented routes, split apart again: what it replays and for which rows.

    The mask, validity and row ids are decoded from the packed column when first read (a router's
    forward reads the mask and row ids, its backward the validity), a few device ops and no read
    of the device. ``rows`` is the one slice of the call's rows these are, where the host knows
    it (the engine neither padded nor split the micro-batch), else the rows' ids decoded.
    """

    def __init__(self, routes: Tensor, packed: Tensor, *, rows: slice | None = None) -> None:
        self.routes, self._packed = routes, packed
        self._mask: Tensor | None = None
        self._valid: Tensor | None = None
        self._rows: Tensor | slice | None = rows

    @property
    def mask(self) -> Tensor:
        """``[rows]`` True where ablate replays the rollout's route."""
        if self._mask is None:
            self._mask = (self._packed & 2) != 0
        return self._mask

    @property
    def valid(self) -> Tensor:
        """``[rows]`` True on the valid tokens (their router-logit gradients feed the Fisher estimate)."""
        if self._valid is None:
            self._valid = (self._packed & 1) != 0
        return self._valid

    @property
    def rows(self) -> Tensor | slice:
        """The call's rows these are: one slice of them, or ``[rows]`` int64 ids + 1 (0: padding the engine added)."""
        if self._rows is None:
            self._rows = self._packed >> 2
        return self._rows


def split_augmented(targets: Tensor, topk: int, rows: slice | None = None) -> LayerTargets:
    """A router's ``[rows, topk + 1]`` augmented targets as :class:`LayerTargets` (``rows``: their one
    slice of the call's rows, where the host knows it)."""
    _check_columns(targets, topk)
    return LayerTargets(targets[:, :topk], targets[:, topk], rows=rows)


def split_layers(targets: list[Tensor], topk: int, rows: slice | None = None) -> list[LayerTargets]:
    """Every router's ``[rows, topk + 1]`` augmented targets of one micro-batch (VeOmni hands them at once).

    The routes stay views of the engine's own tensor; the layers share their rows, decoded once.
    Each layer's packed column is decoded only if read (the validity, in the router's backward).
    """
    for target in targets[:1]:
        _check_columns(target, topk)
    if rows is None and targets:
        rows = (targets[0][:, topk] >> 2)
    return [LayerTargets(target[:, :topk], target[:, topk], rows=rows) for target in targets]


def _check_columns(targets: Tensor, topk: int) -> None:
    if targets.shape[-1] != topk + EXTRA_COLUMNS:
        raise RuntimeError(
            f"router replay targets have {targets.shape[-1]} columns: expected topk + {EXTRA_COLUMNS} = "
            f"{topk + EXTRA_COLUMNS} from ablate's augmented routes"
        )
