"""Per-(token, layer) replay masks inside a training engine: the hook's state over calls and steps.

One training step of verl is an old-log-prob pass (one ``forward_backward_batch`` call with
``forward_only``; bypass mode skips it), then one update call per mini-batch and epoch. A call
runs micro-batches, and each micro-batch reaches the hook once per model chunk of a rank, in
micro-batch order. The hook knows no training engine: the engine's seam
(:class:`ablate.replay.seams.EngineSeam`) frames its calls, hands it each micro-batch's routes and
each router's native top-k, and applies its masks. The hook drives the cell's
:class:`~ablate.replay.ReplaySession`:

- selects a mask for each micro-batch through the session (:mod:`.batch`) and hands it to the seam,
  which sends it through the engine's own packing; the old-log-prob pass and every update pass
  replay the same mask, so the PPO ratio starts at 1 for every policy;
- writes the native routes its routers computed into one buffer per call, assembled over the
  ranks that split a micro-batch's routes at the end of the call (the seam's rank layout). ``mismatch`` selects on native
  routes: the step's old-log-prob call first runs one more forward that replays nothing (a
  *native pass*, whose output the engine's caller never sees), and keeps its native routes, per
  sequence, for the replayed old-log-prob pass and the update passes;
- counts each micro-batch on one rank of its model-parallel group into the session, which at the
  step's last update call sums the step's counts over the world and returns the step's
  ``replay/`` and ``routing/`` keys; the Fisher estimate closes its step there too;
- on a probed step (``probes``, ``probe_every``: docs/probes.md) runs one more forward-only pass
  per probe in the old-log-prob call, after the pass the engine's caller gets, with the probe's own mask;
  its counts and ``mismatch/`` keys join the step's keys as ``probe/<id>/...``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ablate.probes import is_probed
from ablate.replay import ranks
from ablate.replay.batch import (
    MicroBatchPlan,
    MicroBatchSelection,
    counted_routes,
    plan_micro_batch,
    select_micro_batch,
)
from ablate.replay.seams import MICRO_BATCHES_KEY, CallInfo, EngineSeam, augment_routes
from ablate.replay.session import ProbeRun, ReplaySession
from ablate.replay.spec import ReplaySpec
from ablate.routes import native_margin


@dataclass
class _Call:
    """One ``forward_backward_batch`` call: its micro-batches in the call's token order."""

    info: CallInfo
    #: ``[route layers, 1 + tokens, topk]`` native expert ids written by this rank's routers (-1: not
    #: here), layer-major: each router writes one contiguous block. Row ``1 + t`` is token ``t`` of the
    #: call; row 0 takes what routers write for rows the engine padded.
    native: Tensor
    #: a forward that replays nothing, run only to record native routes (``needs_native_routes``).
    native_pass: bool = False
    #: ``[route layers, 1 + tokens]`` native margins (``ablate.routes.native_margin``) written with ``native``.
    native_margin: Tensor | None = None
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    #: micro-batches seen so far by each model chunk (virtual pipeline rank) of this rank.
    seen: dict[int, int] = field(default_factory=dict)
    selections: dict[int, MicroBatchSelection] = field(default_factory=dict)
    #: micro-batches this rank counts (it holds the first MoE layer, TP and CP rank 0).
    counted: list[int] = field(default_factory=list)
    #: a forward that replays a probe's mask, scored and dropped (:mod:`.probe_passes`).
    probe: ProbeRun | None = None

    def micro_batch(self, vp_rank: int, rows: int) -> int:
        """Index of the micro-batch a model chunk is given next; places it in the token order."""
        index = self.seen.get(vp_rank, 0)
        self.seen[vp_rank] = index + 1
        if index == len(self.starts):
            start = self.starts[-1] + self.rows[-1] if self.starts else 0
            if start + rows > self.info.num_tokens:
                raise RuntimeError(
                    f"micro-batch {index} ends at token {start + rows}, past the call's {self.info.num_tokens} tokens: "
                    "the micro-batches do not partition verl's batch"
                )
            self.starts.append(start)
            self.rows.append(rows)
        elif self.rows[index] != rows:
            raise RuntimeError(f"micro-batch {index} has {rows} rows on model chunk {vp_rank} but {self.rows[index]} before")
        return index

    def rows_of(self, index: int) -> slice:
        return slice(self.starts[index], self.starts[index] + self.rows[index])

    def part(self, buffer: Tensor, index: int) -> Tensor:
        """Micro-batch ``index``'s MoE columns of a layer-major buffer, copied token-major, ``[rows, MoE layers, ...]``.

        One copy: counting compares it with the rollout's routes slot by slot, which costs more on a
        transposed view than the copy, and the routers' writes stay contiguous.
        """
        rows = self.rows_of(index)
        part = buffer[:, rows.start + 1:rows.stop + 1]
        columns = self.info.moe_columns
        if len(columns) != buffer.shape[0]:
            part = part.index_select(0, torch.tensor(columns, device=part.device))
        return part.transpose(0, 1).clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class _KeptNative:
    """One micro-batch's native routes from a native pass, kept whole: sequences refer to their rows."""

    #: ``[tokens, MoE layers, topk]`` native ids, -1 where no router reported one.
    routes: Tensor
    #: ``[tokens, MoE layers]`` native margins.
    margins: Tensor
    #: ``[tokens]`` every route of the token was reported.
    known: Tensor

    @classmethod
    def of(cls, routes: Tensor, margins: Tensor) -> _KeptNative:
        return cls(routes, margins, routes.reshape(routes.shape[0], -1).amin(1) >= 0)

    @staticmethod
    def whole(found: list[tuple[_KeptNative, int, int] | None], bounds: list[int]) -> _KeptNative | None:
        """The one kept micro-batch whose rows are these sequences at these bounds, if there is one.

        verl replays a step's micro-batches as the native pass made them (same sequences, same
        order) unless dynamic batching regroups them: then the micro-batch is stitched together.
        """
        if not found or found[0] is None:
            return None
        kept = found[0][0]
        for entry, start, end in zip(found, bounds[:-1], bounds[1:]):
            if entry is None or entry[0] is not kept or entry[1] != start or entry[2] != end:
                return None
        return kept


class ReplayMaskHook:
    """Chooses per-(token, layer) replay masks inside a training engine and measures what replay changed.

    ``seam`` builds the engine's seam for this hook; ``update_epochs`` is how many update passes
    the engine makes over each sequence of a step (verl's ``ppo_epochs``): each counts every route once.
    """

    def __init__(self, spec: ReplaySpec, seam: Callable[[ReplayMaskHook], EngineSeam], *, update_epochs: int = 1) -> None:
        self.spec, self.update_epochs = spec, update_epochs
        #: what the hook needs from the training engine.
        self.seam = seam(self)
        self.needs_native = spec.policy_class.needs_native_routes
        self._probes_need_native = any(spec.probe_spec(probe).policy_class.needs_native_routes for probe in spec.probes)
        #: the cell's session, built at the first call, once the model's layers and experts are known.
        self.session: ReplaySession | None = None
        self.last_rows = slice(0, 0)
        self._call: _Call | None = None
        #: each sequence's native routes of the step's native pass: its micro-batch's, and its rows there.
        self._native_routes: dict[bytes, tuple[_KeptNative, int, int]] = {}
        #: each sequence's selection of the step: its micro-batch's, and its rows there. A sequence's
        #: mask is the same in every pass of a step (its own stream, the step's estimate): the first
        #: pass that meets it selects it, the others take it.
        self._chosen: dict[bytes, tuple[MicroBatchSelection, int, int]] = {}
        self._reset_step()

    @property
    def tracker(self):
        """The session's Fisher tracker (None before the first call)."""
        return None if self.session is None else self.session.tracker

    @property
    def step(self) -> int:
        """The hook's own count of training steps: the one ``probe_every`` reads."""
        return 0 if self.session is None else self.session.step

    def _reset_step(self) -> None:
        self.step_micro_batches = 0
        self._native_routes.clear()
        self._chosen.clear()
        self._native_pass_done = False
        self._old_log_prob_seen = False

    # ------------------------------------------------------------------------------ calls
    def needs_native_pass(self, info: CallInfo) -> bool:
        """Whether ``mismatch`` (the cell's, or a probe's on a probed step) needs native routes first.

        The step's first forward-only call is its old-log-prob pass. A later one in the same step
        (verl computes the reference log-probs in the actor when it trains a LoRA adapter) replays
        the masks already chosen. The flag is the same on every rank, so every rank runs the same
        passes and collectives.
        """
        if not info.forward_only or self._native_pass_done:
            return False
        return self.needs_native or (self._probes_need_native and self._probing(info))

    def _probing(self, info: CallInfo) -> bool:
        """Whether this call is a probed step's old-log-prob call (its first forward-only call)."""
        return (bool(self.spec.probes) and info.forward_only and not self._old_log_prob_seen
                and is_probed(self.step, self.spec.probe_every))

    def probe_runs(self, info: CallInfo) -> list[ProbeRun]:
        """The probe passes to run after this call's pass: one per probe on a probed step's old-log-prob call.

        Called once per verl call, after the pass verl gets; the same on every rank.
        """
        probing = self._probing(info)
        if info.forward_only:
            self._old_log_prob_seen = True
        if not probing:
            return []
        return self.session.probes()

    def add_probe(self, run: ProbeRun, counts: Mapping[str, float], mismatch: Mapping[str, float]) -> None:
        """One probe's keys of this step, from its world-summed route counts and its ``mismatch/`` keys."""
        self.session.add_probe(run.probe, counts, mismatch)

    def begin_call(self, info: CallInfo, *, native_pass: bool = False, probe: ProbeRun | None = None) -> None:
        if self.session is None:
            self.session = ReplaySession(self.spec, len(info.moe_columns), info.num_experts, info.topk)
        native = torch.full((info.route_layers, 1 + info.num_tokens, info.topk), -1, dtype=torch.int16,
                            device=ranks.collective_device())
        margin = (torch.zeros(info.route_layers, 1 + info.num_tokens, device=ranks.collective_device())
                  if native_pass else None)
        self._call = _Call(info=info, native=native, native_pass=native_pass, native_margin=margin, probe=probe)

    def abort_call(self) -> None:
        self._call = None

    def end_call(self) -> dict[str, float] | None:
        """Assemble the call's native routes; at the step's last update call, the step's metrics."""
        call, self._call = self._call, None
        if call is None:
            return None
        if call.native_pass:
            assert call.native_margin is not None
            self._keep_native_routes(call, self.seam.assemble(call.native),
                                     self.seam.assemble(call.native_margin))
            self._native_pass_done = True
            return None
        if call.info.forward_only and call.probe is None:
            return None
        native = self.seam.assemble(call.native)
        session = self.session
        counts = session.new_counts(native.device) if call.probe is not None else None
        for index in call.counted:
            selection = call.selections[index]
            routes, unobserved = counted_routes(selection, call.part(native, index), session.num_experts)
            session.count(routes, selection.mask, unrecorded=selection.unrecorded, unobserved=unobserved, into=counts)
        if counts is not None:  # a probe pass: its counts, summed over the world, for add_probe
            return session.read_counts(counts, ranks.sum_over_world)
        return self._close_step() if call.info.last_update else None

    def _close_step(self) -> dict[str, float]:
        metrics = self.session.close_step(reduce=ranks.sum_over_world, update_epochs=self.update_epochs)
        metrics[MICRO_BATCHES_KEY] = float(self.step_micro_batches)
        self._reset_step()
        return metrics

    # ------------------------------------------------------------------ engine-facing methods
    def current_call(self) -> CallInfo | None:
        """The call the hook is framing (None outside one): a seam replays only inside it."""
        return self._call.info if self._call is not None else None

    def augmented_routes(self, chunk: int, rollout: Tensor, r3_mask: Tensor, offsets: Tensor, *,
                         counted: bool, zero_native: bool = False) -> Tensor:
        """One micro-batch's rollout routes with its replay mask, validity and row ids as extra columns.

        ``rollout`` is ``[tokens, route layers, topk]`` in the engine's packed order, ``offsets``
        its sequence boundaries, ``r3_mask`` the tokens the engine's own R3 replays. ``chunk``
        tells apart the model chunks of a rank (Megatron's virtual pipeline stages), which all see
        the micro-batch; ``counted``: this rank and chunk counts it for its model-parallel group.
        The seam sends the result through the engine's own packing (:func:`ablate.replay.seams.augment_routes`;
        ``zero_native``: the routes the mask leaves native are all zeros, for an engine that routes those natively).
        """
        call = self._call
        index = call.micro_batch(chunk, rollout.shape[0])
        self.last_rows = call.rows_of(index)
        selection = call.selections.get(index)
        if selection is None:
            selection = call.selections[index] = self._select(call, rollout, r3_mask, offsets)
        if counted:
            call.counted.append(index)
        mask = selection.mask
        if mask.shape[1] != rollout.shape[1]:  # dense layers' columns replay nothing
            mask = torch.zeros(rollout.shape[:2], dtype=torch.bool, device=rollout.device)
            mask[:, call.info.moe_columns] = selection.mask
        return augment_routes(rollout, mask, selection.valid, call.starts[index], zero_native=zero_native)

    def observe(self, column: int, rows: Tensor | slice, native: Tensor, scores: Tensor | None = None) -> None:
        """A router's native top-k of its rows (``[rows, topk]``, on its device), and its scores.

        ``rows`` is the one slice of the call's rows they are, or their ids + 1 (0: padding the
        engine added: written to the buffer's spare row), from the packed column
        (:attr:`ablate.replay.seams.LayerTargets.rows`). A few device ops, and no read of the device.
        """
        call = self._call
        if call is None:
            return
        self._write(call.native, column, rows, native)
        if call.native_margin is not None and scores is not None:
            self._write(call.native_margin, column, rows, native_margin(scores.detach().float(), native))

    @staticmethod
    def _write(buffer: Tensor, column: int, rows: Tensor | slice, values: Tensor) -> None:
        if isinstance(rows, slice):  # converted while copied
            buffer[column, rows.start + 1:rows.stop + 1].copy_(values)
        else:
            buffer[column].index_copy_(0, rows.to(buffer.device), values.to(buffer.device, buffer.dtype))

    def add_fisher(self, layer: int, logit_grads: Tensor, valid: Tensor) -> None:
        """Per-token squared router-logit gradients of one MoE layer's valid rows (:meth:`ReplaySession.add_fisher`)."""
        self.session.add_fisher(layer, logit_grads, valid)

    # -------------------------------------------------------------------------- internals
    def _select(self, call: _Call, rollout: Tensor, r3_mask: Tensor, offsets: Tensor) -> MicroBatchSelection:
        """The micro-batch's selection; a native pass selects nothing but still keys its sequences."""
        info = call.info
        columns = info.moe_columns
        routes = rollout if len(columns) == rollout.shape[1] else rollout[:, columns]
        plan = plan_micro_batch(routes, r3_mask, offsets, info.num_experts)
        if call.native_pass:  # a pass that replays nothing still keys its sequences
            return select_micro_batch(None, routes, r3_mask, offsets, info.num_experts, plan=plan)
        policy = self.session.policy if call.probe is None else call.probe.policy
        if call.probe is None:
            self.step_micro_batches += 1
            kept = self._kept_selection(routes, plan)
            if kept is not None:
                return kept
        native = has_native = margin = None
        if policy.needs_native_routes:
            native, has_native, margin = self._stitch_native_routes(routes, list(plan.host.offsets), plan.keys)
        selection = select_micro_batch(self.session, routes, r3_mask, offsets, info.num_experts, plan=plan,
                                       native=native, has_native=has_native, native_margin=margin, probe=call.probe)
        if call.probe is None:
            bounds = plan.host.offsets
            for key, start, end in zip(plan.keys, bounds[:-1], bounds[1:]):
                self._chosen[key] = (selection, start, end)
        return selection

    def _kept_selection(self, routes: Tensor, plan: MicroBatchPlan) -> MicroBatchSelection | None:
        """The step's selection of these sequences, where an earlier pass made it for every one of them:
        taken whole for the same micro-batch, stitched sequence by sequence for another grouping."""
        found = [self._chosen.get(key) for key in plan.keys]
        if not found or any(entry is None for entry in found):
            return None
        bounds = plan.host.offsets
        first = found[0][0]
        if all(entry[0] is first and entry[1] == start and entry[2] == end
               for entry, start, end in zip(found, bounds[:-1], bounds[1:])) and first.mask.shape[0] == routes.shape[0]:
            return first  # the same sequences at the same rows: the same routes, valid tokens and mask
        mask = torch.cat([entry[0].mask[entry[1]:entry[2]] for entry in found])
        return MicroBatchSelection(routes, plan, mask)

    def _keep_native_routes(self, call: _Call, native: Tensor, margin: Tensor) -> None:
        """Keep each sequence's native routes (and margins) of the native pass for the step's replayed passes."""
        for index, selection in call.selections.items():
            kept = _KeptNative.of(call.part(native, index).clone(), call.part(margin, index).clone())
            bounds = selection.plan.host.offsets
            for key, start, end in zip(selection.keys, bounds[:-1], bounds[1:]):
                self._native_routes[key] = (kept, start, end)

    def _stitch_native_routes(self, routes: Tensor, bounds: list[int], keys: list[bytes]) -> tuple[Tensor, Tensor, Tensor]:
        """Native routes and margins of a micro-batch from the step's native pass, and which tokens have them."""
        found = [self._native_routes.get(key) for key in keys]
        same = _KeptNative.whole(found, bounds)
        if same is not None and same.routes.shape == routes.shape:  # the native pass's micro-batch again
            return (same.routes.to(routes.device), same.known.to(routes.device), same.margins.to(routes.device))
        native = torch.zeros(routes.shape, dtype=torch.int16, device=routes.device)
        margin = torch.zeros(routes.shape[:2], device=routes.device)
        known = torch.zeros(routes.shape[0], dtype=torch.bool, device=routes.device)
        for entry, start, end in zip(found, bounds[:-1], bounds[1:]):
            if entry is None:
                continue
            kept, first, last = entry
            if kept.routes[first:last].shape == native[start:end].shape:
                native[start:end] = kept.routes[first:last].to(routes.device)
                margin[start:end] = kept.margins[first:last].to(routes.device)
                known[start:end] = kept.known[first:last].to(routes.device)
        return native, known, margin
