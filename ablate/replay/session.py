"""One cell's replay over its training steps: the masks it chooses and what it counts of them.

A :class:`ReplaySession` is what every backend drives (docs/design.md section 5): the synthetic
backend once per step over its whole batch, verl's engines once per micro-batch through
:class:`~ablate.replay.calls.ReplayCalls`, a Megatron-core loop through
:func:`ablate.replay.megatron_core.partial_replay`. It owns the cell's policy, its Fisher estimate
and its probes, and it:

- chooses masks (:meth:`select`): the policy at the spec's budget, its random draws from the one
  seed scheme (:mod:`ablate.seeding`): per step over a whole batch, or per sequence, keyed by the
  sequence's content, where one step's passes batch the same sequences differently;
- counts what the mask did (:meth:`count`): the additive route counts behind the schema's
  ``replay/`` and ``routing/`` keys (:data:`ablate.diagnostics.metrics.ROUTE_COUNTS`), pooled over
  the step and, at :meth:`close_step`, summed over ranks by the caller's ``reduce`` (each route is
  counted on one rank only: the engine's seam says which);
- closes each step: the step's keys, and one step of the Fisher estimate from the per-token
  router-logit gradients given to :meth:`add_fisher` (or accumulated by the caller into
  :attr:`tracker` directly).

It applies nothing itself: where a mask goes (a torch loop, verl's routers, Megatron-core's
``RouterReplay``) is its caller's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from ablate.diagnostics.metrics import ROUTE_COUNTS, metrics_from_counts, route_counts
from ablate.fisher import FisherTracker
from ablate.policies import ReplayPolicy, replay_mask
from ablate.probes import Probe, is_probed, probe_generator, probe_record
from ablate.replay.spec import ReplaySpec
from ablate.routes import Routes
from ablate.seeding import stream

#: A sum over the ranks that each counted a disjoint part of the routes (identity on one process).
Reduce = Callable[[Tensor], Tensor]
#: Counts of one step: the shared route counts, the micro-batches whose policy fell back to random and
#: the replayed expert slots a score gate handed back (``threshold``).
STEP_COUNTS = (*ROUTE_COUNTS, "fisher_fallback", "replaced_slots")
#: Counts that every update epoch adds once more: reported per step, i.e. per epoch.
PER_EPOCH_COUNTS = ("valid_routes", "replayed_routes", "unrecorded_routes", "replaced_slots")


def _alone(values: Tensor) -> Tensor:
    return values


class ProbeRun(NamedTuple):
    """One probe of a probed step with its own policy object (a ``fisher`` probe reads the cell's estimate)."""

    probe: Probe
    policy: ReplayPolicy


class ReplaySession:
    """The replay of one cell (a :class:`~ablate.replay.ReplaySpec`) in a model of ``num_layers`` MoE
    layers of ``num_experts`` experts, each routing a token to ``topk`` of them."""

    def __init__(self, spec: ReplaySpec, num_layers: int, num_experts: int, topk: int) -> None:
        self.spec = spec
        self.budget = spec.budget
        self.policy, self.tracker = spec.policy.build(num_layers, num_experts)
        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        #: The session's training step: selection streams and probes are keyed by it.
        self.step = 0
        self._probe_runs: list[ProbeRun] | None = None
        self._reset_step()

    def _reset_step(self) -> None:
        self.counts = dict.fromkeys(STEP_COUNTS, 0.0)
        self._fisher: Tensor | None = None  # [3, layers, experts]: sums, counts, skipped
        self.probe_keys: dict[str, float] = {}

    # ------------------------------------------------------------------------ selection
    @property
    def needs_native(self) -> bool:
        """The cell's policy selects on native routes, which its caller records first."""
        return self.policy.needs_native_routes

    @property
    def probed(self) -> bool:
        """This step scores the cell's probes (steps 0, ``probe_every``, ...)."""
        return bool(self.spec.probes) and is_probed(self.step, self.spec.probe_every)

    def probes(self) -> list[ProbeRun]:
        """Each probe with its own policy object; a ``fisher`` probe reads the cell's estimate."""
        if self._probe_runs is None:
            self._probe_runs = [ProbeRun(probe, self.spec.probe_spec(probe).policy_reading(self.tracker))
                                for probe in self.spec.probes]
        return self._probe_runs

    def fisher_scores(self) -> Tensor | None:
        """The estimate this step's masks read (the previous steps'), None before there is one."""
        return self.tracker.scores() if self.tracker.has_estimate else None

    def select(self, routes: Routes, *, sequences: list[bytes] | None = None,
               probe: ProbeRun | None = None) -> Tensor:
        """The ``[tokens, layers]`` replay mask of ``routes``: the cell's, or ``probe``'s.

        Without ``sequences`` the budget is counted over the whole batch and the draws come from
        one stream per step. With ``sequences`` (a content key per sequence of ``routes.offsets``)
        every sequence gets its exact share of the budget and its own stream, keyed by its
        content: its mask is the same in any batch, so every pass of a step that batches it
        differently replays the same routes. A probe draws from streams of its own.
        """
        policy, budget = (self.policy, self.budget) if probe is None else (probe.policy, probe.probe.budget)
        if sequences is None:
            mask = replay_mask(policy, routes, budget, generator=self._stream(probe))
        else:
            generators = [self._stream(probe, key) for key in sequences]
            mask = replay_mask(policy, routes, budget, generator=generators, per_sequence=True)
        if probe is None:
            self.counts["fisher_fallback"] += policy.info.get("fisher_fallback", 0.0)
        return mask

    def _stream(self, probe: ProbeRun | None, *sequence: bytes) -> torch.Generator:
        """The draws of one selection: the cell's (per step, or per sequence by its content), or a probe's."""
        if probe is not None:
            return probe_generator(self.spec.seed, self.step, probe.probe.id, *sequence)
        return stream(self.spec.seed, "selection", *(sequence or (self.step,)))

    # ------------------------------------------------------------------------- counting
    def count(self, routes: Routes | None, mask: Tensor | None, *, unrecorded: int = 0,
              into: dict[str, float] | None = None, used: Tensor | None = None, replaced_slots: float = 0.0) -> None:
        """Add one batch's route counts to the step's (or to ``into``: a probe pass's own).

        ``routes`` are the valid routes the mask chose from, with the native routes the training
        router computed where known; None when the batch had no valid route. ``unrecorded``
        routes (the rollout never recorded them) are counted apart. A replay variant whose
        replayed routes are not the rollout's gives the routes the forward ``used`` and the slots
        its gate handed back (``replaced_slots``; :func:`ablate.diagnostics.route_counts`).
        """
        counts = self.counts if into is None else into
        if routes is not None:
            added = route_counts(routes, mask, fisher_scores=self.fisher_scores(), used=used)
            for key, value in added.items():
                counts[key] += value
        counts["unrecorded_routes"] += unrecorded
        if replaced_slots:
            counts["replaced_slots"] += replaced_slots

    def add_fisher(self, layer: int, logit_grads: Tensor, valid: Tensor) -> None:
        """Per-token squared router-logit gradients of one MoE layer's valid rows, for this step's estimate.

        A non-finite square is skipped and counted, as the Fisher tracker does with its own input.
        """
        squares = logit_grads.detach().reshape(-1, logit_grads.shape[-1])[valid.to(logit_grads.device)].double().square()
        finite = torch.isfinite(squares)
        if self._fisher is None:
            self._fisher = torch.zeros((3, *self.tracker.shape), dtype=torch.float64, device=squares.device)
        self._fisher[0, layer] += squares.masked_fill(~finite, 0.0).sum(0)
        self._fisher[1, layer] += finite.sum(0)
        self._fisher[2, layer] += (~finite).sum(0)

    def close_step(self, *, reduce: Reduce = _alone, update_epochs: int = 1) -> dict[str, float]:
        """The step's ``replay/`` and ``routing/`` keys (and its probes'); one step of the Fisher estimate.

        ``reduce`` sums the counts and the Fisher sums over the ranks of the run. Every update
        epoch replays each route of the step once, so the per-step counts are the sums divided
        by ``update_epochs``: ``replay/valid_routes`` is the number of valid routes in the step's
        batch. Ratios pool every pass.
        """
        names = sorted(self.counts)
        totals = dict(zip(names, reduce(torch.tensor([self.counts[k] for k in names], dtype=torch.float64)).tolist()))
        nonfinite = self._fold_fisher(reduce)
        for key in PER_EPOCH_COUNTS:
            totals[key] /= update_epochs
        metrics = metrics_from_counts(totals, self.budget, self.topk, fisher_fallback=totals["fisher_fallback"] > 0,
                                      fisher_nonfinite=nonfinite, replaced_slots=totals["replaced_slots"])
        metrics.update(self.probe_keys)
        self.step += 1
        self._reset_step()
        return metrics

    def add_probe(self, probe: Probe, counts: Mapping[str, float], mismatch: Mapping[str, float]) -> None:
        """One probe's keys of this step, from its (rank-summed) route counts and its ``mismatch/`` keys."""
        replay = metrics_from_counts(counts, probe.budget, self.topk, fisher_fallback=False, fisher_nonfinite=0)
        self.probe_keys.update(probe_record(probe.id, {**mismatch, **replay}))

    def _fold_fisher(self, reduce: Reduce) -> int:
        """This step's Fisher sums (summed over ranks) become one step of the estimate; returns the
        non-finite contributions skipped, here and by the tracker."""
        # Every rank takes part in the sum, with zeros where it saw no gradient.
        parts = self._fisher if self._fisher is not None else torch.zeros((3, *self.tracker.shape), dtype=torch.float64)
        sums, counts, skipped = reduce(parts).cpu()
        # accumulate() adds (mean * count): the mean weighted by its count adds the sums.
        self.tracker.accumulate((sums / counts.clamp(min=1))[None], counts[None])
        self.tracker.step()
        return int(skipped.sum()) + self.tracker.nonfinite_last_step


def new_counts() -> dict[str, float]:
    """Empty route counts: a probe pass counts into its own."""
    return dict.fromkeys(ROUTE_COUNTS, 0.0)
