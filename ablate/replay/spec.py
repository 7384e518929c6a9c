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

from ablate.policies import PolicySpec, ReplayPolicy
from ablate.probes import Probe, parse_probes


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
    """

    policy: PolicySpec
    budget: float | None = None
    seed: int = 0
    probes: tuple[Probe, ...] = ()
    probe_every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", self.policy.policy_class.resolve_budget(self.budget))

    @classmethod
    def of(cls, policy: str, budget: float | None = None, seed: int = 0, *, probes: tuple[Probe, ...] | list = (),
           probe_every: int = 1, plugins: tuple[str, ...] = (), **settings: Any) -> ReplaySpec:
        """``ReplaySpec.of("fisher", 0.25, seed=3, tau=1.0)``: a spec from plain values, checked."""
        return cls(PolicySpec(policy, settings, plugins=tuple(plugins)), budget, int(seed),
                   parse_probes(probes) if probes and not isinstance(probes[0], Probe) else tuple(probes),
                   probe_every)

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
                   fields.get("probe_every", 1))
