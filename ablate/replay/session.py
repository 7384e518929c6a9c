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

import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from ablate.diagnostics.metrics import ROUTE_COUNTS, metrics_from_counts, route_count_tensor
from ablate.fisher import FisherTracker
from ablate.policies import ReplayPolicy, replay_mask
from ablate.policies.base import MaskCheck
from ablate.replay.host_reads import to_host
from ablate.probes import Probe, is_probed, probe_generator, probe_record
from ablate.replay.spec import ReplaySpec
from ablate.routes import Routes
from ablate.seeding import stream

log = logging.getLogger(__name__)

#: A sum over the ranks that each counted a disjoint part of the routes (identity on one process).
Reduce = Callable[[Tensor], Tensor]
#: Counts of one step: the shared route counts, the selections whose policy fell back to random, the
#: valid routes no router reported a native route for (their batches' routing counts are left out), and
#: the replayed expert slots a score gate handed back (``threshold``).
STEP_COUNTS = (*ROUTE_COUNTS, "fisher_fallback", "unobserved_routes", "replaced_slots")
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
        self._layer_policies: dict[int, ReplayPolicy] = {}
        self._layer_fishers: dict[int, _LayerFisher] = {}
        self._reset_step()

    def _reset_step(self) -> None:
        #: The step's :data:`STEP_COUNTS`, summed on the device of the routes and read at :meth:`close_step`.
        self.counts: Tensor | None = None
        #: The budget checks of the step's masks whose routes the host knew (read at :meth:`close_step`).
        self._checks: list[MaskCheck] = []
        self._fisher: Tensor | None = None  # [3, layers, experts]: sums, counts, skipped
        self.probe_keys: dict[str, float] = {}

    def new_counts(self, device: torch.device | str = "cpu") -> Tensor:
        """Empty route counts (:data:`STEP_COUNTS`) on ``device``: a probe pass counts into its own."""
        return torch.zeros(len(STEP_COUNTS), dtype=torch.float64, device=device)

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
               probe: ProbeRun | None = None, layer: int | None = None) -> Tensor:
        """The ``[tokens, layers]`` replay mask of ``routes``: the cell's, or ``probe``'s.

        Without ``sequences`` the budget is counted over the whole batch and the draws come from
        one stream per step. With ``sequences`` (a content key per sequence of ``routes.offsets``)
        every sequence gets its exact share of the budget and its own stream, keyed by its
        content: its mask is the same in any batch, so every pass of a step that batches it
        differently replays the same routes. A probe draws from streams of its own. ``layer``:
        ``routes`` hold that one MoE layer (``[tokens, 1, topk]``), and the policy reads that
        layer's row of the Fisher estimate.

        Where the host knows the routes' layout (``routes.host``), nothing here reads the device:
        the mask's budget check is kept and read with the step's counts (:meth:`close_step`).
        """
        policy, budget = (self.policy, self.budget) if probe is None else (probe.policy, probe.probe.budget)
        if layer is not None and probe is None:
            policy = self._layer_policy(layer)
        checks = self._checks if routes.host is not None else None
        if sequences is None:
            mask = replay_mask(policy, routes, budget, generator=self._stream(probe), checks=checks)
        else:
            generators = [self._stream(probe, key) for key in sequences]
            mask = replay_mask(policy, routes, budget, generator=generators, per_sequence=True, checks=checks)
        if probe is None and policy.info.get("fisher_fallback", 0.0):
            self._counts_on(mask.device)[STEP_COUNTS.index("fisher_fallback")] += 1.0
        return mask

    def _layer_policy(self, layer: int) -> ReplayPolicy:
        """The cell's policy for routes of one MoE layer: a ``fisher`` policy reads that layer's row."""
        if layer not in self._layer_policies:
            self._layer_policies[layer] = self.spec.policy.policy_reading(self._layer_fisher(layer))
        return self._layer_policies[layer]

    def _layer_fisher(self, layer: int) -> _LayerFisher:
        if layer not in self._layer_fishers:
            self._layer_fishers[layer] = _LayerFisher(self.tracker, layer)
        return self._layer_fishers[layer]

    def _stream(self, probe: ProbeRun | None, *sequence: bytes) -> torch.Generator:
        """The draws of one selection: the cell's (per step, or per sequence by its content), or a probe's."""
        if probe is not None:
            return probe_generator(self.spec.seed, self.step, probe.probe.id, *sequence)
        return stream(self.spec.seed, "selection", *(sequence or (self.step,)))

    # ------------------------------------------------------------------------- counting
    def count(self, routes: Routes | None, mask: Tensor | None, *, unrecorded: Tensor | int = 0,
              unobserved: Tensor | None = None, into: Tensor | None = None, layer: int | None = None,
              used: Tensor | None = None, replaced_slots: Tensor | float = 0.0) -> None:
        """Add one batch's route counts to the step's (or to ``into``, from :meth:`new_counts`: a probe pass's own).

        ``routes`` are the valid routes the mask chose from, with the native routes the training
        router computed where known; None when the batch had no valid route. ``unrecorded``
        routes (the rollout never recorded them) are counted apart. ``unobserved``: how many valid
        routes no router reported a native route for; where some are, the batch's ``routing/``
        counts are left out. ``layer``: ``routes`` hold that one MoE layer (as in :meth:`select`).
        A replay variant whose replayed routes are not the rollout's gives the routes the forward
        ``used`` and the slots its gate handed back (``replaced_slots``;
        :func:`ablate.diagnostics.route_counts`). Everything stays on the device.
        """
        if routes is None:
            if not isinstance(unrecorded, int) or unrecorded:
                device = unrecorded.device if isinstance(unrecorded, Tensor) else "cpu"
                counts = self._counts_on(device) if into is None else into
                counts[STEP_COUNTS.index("unrecorded_routes")] += unrecorded
            return
        counts = self._counts_on(routes.device) if into is None else into
        observed = None if unobserved is None else unobserved == 0
        scores = self.fisher_scores() if layer is None else self._layer_fisher(layer).scores_or_none()
        counts[:len(ROUTE_COUNTS)] += route_count_tensor(routes, mask, fisher_scores=scores, observed=observed,
                                                         used=used)
        counts[STEP_COUNTS.index("unrecorded_routes")] += unrecorded
        if unobserved is not None:
            counts[STEP_COUNTS.index("unobserved_routes")] += unobserved
        if not isinstance(replaced_slots, float) or replaced_slots:
            counts[STEP_COUNTS.index("replaced_slots")] += replaced_slots

    def _counts_on(self, device: torch.device | str) -> Tensor:
        if self.counts is None:
            self.counts = self.new_counts(device)
        return self.counts

    def read_counts(self, counts: Tensor, reduce: Reduce = _alone) -> dict[str, float]:
        """Counts summed over the ranks by ``reduce``, read from the device once."""
        return dict(zip(STEP_COUNTS, to_host(reduce(counts)).tolist()))

    def add_fisher(self, layer: int, logit_grads: Tensor, valid: Tensor) -> None:
        """Per-token squared router-logit gradients of one MoE layer's valid rows, for this step's estimate.

        A non-finite square is skipped and counted, as the Fisher tracker does with its own input.
        The rows are weighted by their validity, never selected (which would read their number back).
        """
        squares = logit_grads.detach().reshape(-1, logit_grads.shape[-1]).double().square()
        valid = valid.to(squares.device)[:, None]
        finite = torch.isfinite(squares)
        if self._fisher is None:
            self._fisher = torch.zeros((3, *self.tracker.shape), dtype=torch.float64, device=squares.device)
        self._fisher[0, layer] += torch.where(finite & valid, squares, 0.0).sum(0)
        self._fisher[1, layer] += (finite & valid).sum(0)
        self._fisher[2, layer] += (~finite & valid).sum(0)

    def close_step(self, *, reduce: Reduce = _alone, update_epochs: int = 1) -> dict[str, float]:
        """The step's ``replay/`` and ``routing/`` keys (and its probes'); one step of the Fisher estimate.

        ``reduce`` sums the counts and the Fisher sums over the ranks of the run. Every update
        epoch replays each route of the step once, so the per-step counts are the sums divided
        by ``update_epochs``: ``replay/valid_routes`` is the number of valid routes in the step's
        batch. Ratios pool every pass.
        """
        counts = self.counts if self.counts is not None else self.new_counts()
        # Every rank takes part in the sums, with zeros where it saw no gradient.
        fisher = self._fisher if self._fisher is not None else torch.zeros((3, *self.tracker.shape), dtype=torch.float64)
        summed = reduce(torch.cat([counts, fisher.reshape(-1).to(counts)]))
        # One read of the device for the whole step: the counts and Fisher sums (summed over the ranks) and
        # the step's budget checks (this rank's).
        read = to_host(torch.cat([summed, *(check.found.to(summed) for check in self._checks)]))
        steps = len(STEP_COUNTS)
        totals = dict(zip(STEP_COUNTS, read[:steps].tolist()))
        for index, check in enumerate(self._checks):
            start = steps + fisher.numel() + 5 * index
            check.raise_if_broken([int(value) for value in read[start:start + 5].tolist()])
        if totals["unobserved_routes"]:
            log.warning("ablate replay: %d valid routes without a native route from the routers at step %d; the "
                        "routing/ counts of their batches are left out", totals["unobserved_routes"], self.step)
        nonfinite = self._fold_fisher(read[steps:steps + fisher.numel()].reshape(fisher.shape))
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

    def _fold_fisher(self, parts: Tensor) -> int:
        """This step's Fisher sums (summed over the ranks, on the host) become one step of the estimate;
        returns the non-finite contributions skipped, here and by the tracker."""
        sums, counts, skipped = parts
        self.tracker.add_sums(sums, counts, int(skipped.sum().tolist()))
        self.tracker.step()
        return self.tracker.nonfinite_last_step


class _LayerFisher:
    """One MoE layer's row of a Fisher tracker's estimate, read as a one-layer estimate (the same view
    for a step, as the tracker's scores are the same tensor for a step)."""

    def __init__(self, tracker: FisherTracker, layer: int) -> None:
        self.tracker, self.layer = tracker, layer
        self._row: tuple[Tensor, Tensor] | None = None

    @property
    def has_estimate(self) -> bool:
        return self.tracker.has_estimate

    def scores(self) -> Tensor:
        estimate = self.tracker.scores()
        if self._row is None or self._row[0] is not estimate:
            self._row = (estimate, estimate[self.layer:self.layer + 1])
        return self._row[1]

    def scores_or_none(self) -> Tensor | None:
        return self.scores() if self.has_estimate else None
