"""What a cell replays, settled once: :class:`ReplaySpec`.

A spec is built where a cell is composed (:func:`ablate.compose.build_cell`), with its budget
resolved there and nowhere else (:meth:`ablate.policies.ReplayPolicy.resolve_budget`). Every
backend, the verl launch and verl's workers receive it, the workers as JSON (:meth:`to_json`,
one environment variable), and build their :class:`~ablate.replay.ReplaySession` from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ablate.config import ReplaySource, ReplayWeights
from ablate.policies import PolicySpec, ReplayPolicy
from ablate.probes import Probe, parse_probes

#: ``replay.source``: whose routes are replayed, the rollout's (R3, the default) or the trainer's own (R2).
SOURCES = tuple(source.value for source in ReplaySource)
#: ``replay.weights``: the gate weights of a replayed route, recomputed by the trainer (the default) or the rollout's.
WEIGHTS = tuple(weights.value for weights in ReplayWeights)
#: R3's settings: a spec that keeps them is no variant.
VARIANT_DEFAULTS = {"source": SOURCES[0], "weights": WEIGHTS[0]}


class VariantError(ValueError):
    """A replay variant (``replay.source``, ``replay.weights``) that the cell's policy cannot replay."""


@dataclass(frozen=True)
class ReplaySpec:
    """A replay policy with its settings, its budget, the cell's seed and its probes.

    Args:
        policy: the policy by name, with its settings, Fisher smoothing and plugin modules.
        budget: the fraction of valid routes replayed; ``None`` for a policy whose budget is fixed
            (``none``, ``full``). Resolved when the spec is built: a bad budget raises
            :class:`~ablate.budget.BudgetError` here, before any work.
        seed: the cell's seed; every random stream of the replay derives from it (:mod:`ablate.seeding`).
        probes: counterfactual masks scored every ``probe_every`` steps (docs/probes.md).
        source: whose routes a replayed route takes: ``rollout`` (R3) or ``train``, the routes the
            trainer records in its old-log-prob pass, which routes natively (R2).
        weights: a replayed route's gate weights: ``recompute`` from the trainer's router scores
            (R3), or ``rollout``, the weights the rollout recorded with its expert ids.
    """

    policy: PolicySpec
    budget: float | None = None
    seed: int = 0
    probes: tuple[Probe, ...] = ()
    probe_every: int = 1
    source: str = "rollout"
    weights: str = "recompute"

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", self.policy.policy_class.resolve_budget(self.budget))
        self._check_variant()

    def _check_variant(self) -> None:
        """The variant's values, and the policies that cannot replay it; one line each."""
        if self.source not in SOURCES:
            raise VariantError(f"replay.source={self.source!r}: expected rollout (R3) or train (R2)")
        if self.weights not in WEIGHTS:
            raise VariantError(f"replay.weights={self.weights!r}: expected recompute or rollout")
        name, traits = self.policy.name, self.policy_class
        changed = self.variant()
        if changed and traits.fixed_budget == 0:
            key, value = next(iter(changed.items()))
            raise VariantError(f"replay.{key}={value} with policy={name}: {name} replays no route, so how routes are "
                               f"replayed changes nothing; leave replay.{key} at its default (a sweep's grid drops it "
                               f"for {name})")
        if self.source == "train" and traits.needs_native_routes:
            raise VariantError(f"replay.source=train with policy={name}: {name} ranks routes by how their replayed "
                               "experts differ from the native ones, and R2 replays the trainer's own native routes, "
                               "so none differ; use replay.source=rollout or another policy")
        if self.weights == "rollout" and self.source == "train":
            raise VariantError("replay.weights=rollout with replay.source=train: R2 replays the trainer's own expert "
                               "ids, and its old-log-prob pass records no rollout gate weights to go with them; use "
                               "replay.weights=recompute")
        if self.weights == "rollout" and traits.gates_slots:
            raise VariantError(f"replay.weights=rollout with policy={name}: its gate puts the trainer's experts into "
                               "replayed routes, which have no rollout gate weights; use replay.weights=recompute")

    def variant(self) -> dict[str, str]:
        """The replay settings that differ from R3's defaults, ``{"source": "train"}``."""
        return {key: getattr(self, key) for key, default in VARIANT_DEFAULTS.items() if getattr(self, key) != default}

    @classmethod
    def of(cls, policy: str, budget: float | None = None, seed: int = 0, *, probes: tuple[Probe, ...] | list = (),
           probe_every: int = 1, plugins: tuple[str, ...] = (), source: str = "rollout", weights: str = "recompute",
           **settings: Any) -> ReplaySpec:
        """``ReplaySpec.of("fisher", 0.25, seed=3, tau=1.0)``: a spec from plain values, checked."""
        return cls(PolicySpec(policy, settings, plugins=tuple(plugins)), budget, int(seed),
                   parse_probes(probes) if probes and not isinstance(probes[0], Probe) else tuple(probes),
                   probe_every, source, weights)

    @property
    def policy_class(self) -> type[ReplayPolicy]:
        """The policy's class, with its traits (``fixed_budget``, ``needs_native_routes``, ``reads_fisher``)."""
        return self.policy.policy_class

    @property
    def budget_is_fixed(self) -> bool:
        """The policy replays one budget by definition (``none``, ``full``): cells of it carry no budget."""
        return self.policy_class.fixed_budget is not None

    def probe_spec(self, probe: Probe) -> PolicySpec:
        """A probe's policy, found through the cell's plugins."""
        return PolicySpec(probe.policy, dict(probe.settings), plugins=self.policy.plugins)

    def to_json(self) -> str:
        fields = asdict(self)
        fields["probes"] = [probe.row() for probe in self.probes]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReplaySpec:
        fields = json.loads(text)
        policy = PolicySpec.from_dict(fields["policy"])
        policy.policy_class  # imports the plugins, whose policies the probes may name
        return cls(policy, fields["budget"], fields["seed"], parse_probes(fields.get("probes", ())),
                   fields.get("probe_every", 1), fields.get("source", "rollout"), fields.get("weights", "recompute"))
