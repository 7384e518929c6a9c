"""One builder for a cell's replay policy, in every backend and every process.

A :class:`PolicySpec` holds what a cell asks of its policy: the registered name, the policy's
own settings (``per_layer``, ``tau``) and the Fisher estimate settings. The synthetic backend
builds it in process; the verl backend sends it as JSON to verl's worker processes and builds it
there, once the model's layer and expert counts are known. Both get the policy and its Fisher
tracker from :meth:`PolicySpec.build`, so the two backends cannot drift apart. The spec names
the modules to import first (``plugins``), so a policy of the user's own is found in every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ablate.fisher import FisherTracker
from ablate.policies.base import ReplayPolicy, get_policy, load_plugins, policy_class


@dataclass(frozen=True)
class PolicySpec:
    """A replay policy by name and settings, plus how its Fisher estimate is smoothed.

    Args:
        name: a registered policy (``none``, ``full``, ``random``, ``uniform``, ``fisher``, ...).
        settings: the policy's keyword settings for :func:`ablate.policies.get_policy`.
        fisher_decay: the decay of the :class:`ablate.fisher.FisherTracker`. Every policy gets a
            tracker (its Fisher mass is logged for every arm); a policy that ``reads_fisher``
            ranks routes by it.
        fisher_normalize: the tracker's normalization (``none``, ``layer`` or ``global``).
        plugins: modules to import before the policy is looked up (the config's ``plugins``).
    """

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    fisher_decay: float = 0.9
    fisher_normalize: str = "none"
    plugins: tuple[str, ...] = ()

    @property
    def policy_class(self) -> type[ReplayPolicy]:
        """The policy's class, with its traits (``fixed_budget``, ``needs_native_routes``, ...)."""
        load_plugins(self.plugins)
        return policy_class(self.name)

    def build(self, num_layers: int, num_experts: int) -> tuple[ReplayPolicy, FisherTracker]:
        """The policy and its Fisher tracker for a model of ``num_layers`` MoE layers."""
        normalize = self.fisher_normalize
        tracker = FisherTracker(num_layers, num_experts, decay=self.fisher_decay, normalize=normalize)  # type: ignore[arg-type]
        return self.policy_reading(tracker), tracker

    def policy_reading(self, tracker: FisherTracker) -> ReplayPolicy:
        """The policy, reading the Fisher estimate of ``tracker`` (a probe reads its cell's)."""
        settings = dict(self.settings)
        if self.policy_class.reads_fisher:
            settings["fisher"] = tracker
        return get_policy(self.name, **settings)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> PolicySpec:
        return cls(**{**fields, "plugins": tuple(fields.get("plugins", ()))})
