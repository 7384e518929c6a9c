"""Counterfactual replay probes: other masks scored on a training step's own batch (docs/probes.md).

A probe is a replay policy and a budget. On a probed step, after the rollout and before the
update, the backend scores each probe's mask on the step's batch with a forward-only pass of the
step's weights and logs what that mask would have left of the train-inference mismatch. Probes
never touch training: their masks draw from generators of their own (:func:`probe_generator`),
seeded from the cell seed, the step and the probe's id, so adding a probe changes neither the
other probes nor the cell's own mask.

A probe is written ``policy@budget`` (``random@0.25``; ``none`` and ``full`` take no budget) with
optional settings after colons (``fisher@0.25:tau=1.0``), or as a mapping
``{policy: fisher, budget: 0.25, settings: {tau: 1.0}}``. Its canonical id (:attr:`Probe.id`)
names its keys, ``probe/<id>/mismatch/kl_k3``; the run config carries the probe table
(:func:`probe_table`), so the analysis reads policy, budget and settings from data, never from
the id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ablate.budget import BudgetError
from ablate.config import ConfigError
from ablate.diagnostics.schema import PROBE_ID, probe_key
from ablate.policies import available_policies, get_policy, policy_class
from ablate.seeding import stream

#: What a probe logs of its pass: the ``mismatch/`` keys and what its mask changed.
PROBE_REPLAY_KEYS = ("replay/budget_realized", "replay/override_rate", "replay/effective_budget")


@dataclass(frozen=True)
class Probe:
    """One probe: a registered policy, its budget (fixed for ``none``/``full``) and its settings."""

    policy: str
    budget: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """``random@0.25``, ``none``, ``fisher@0.25:tau=1.0`` (settings sorted): the keys' family name."""
        head = self.policy if _fixed_budget(self.policy) is not None else f"{self.policy}@{self.budget:g}"
        return head + "".join(f":{key}={_text(value)}" for key, value in sorted(self.settings.items()))

    def row(self) -> dict[str, Any]:
        """The probe as a row of the run config's probe table."""
        return {"id": self.id, "policy": self.policy, "budget": self.budget, "settings": dict(self.settings)}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_probes(entries: Any, where: str = "probes") -> tuple[Probe, ...]:
    """Every probe of the ``probes`` setting, checked before any work; one clear error otherwise."""
    if entries is None:
        return ()
    if isinstance(entries, (str, Mapping)) or not hasattr(entries, "__iter__"):
        raise ConfigError(f"{where}={entries!r}: expected a list of probes such as [none,full,random@0.25]")
    probes = [parse_probe(entry, f"{where}[{index}]") for index, entry in enumerate(entries)]
    seen: dict[str, int] = {}
    for index, probe in enumerate(probes):
        if probe.id in seen:
            raise ConfigError(f"{where}[{index}]={probe.id}: the same probe as {where}[{seen[probe.id]}]")
        seen[probe.id] = index
    return tuple(probes)


def parse_probe(entry: Any, where: str) -> Probe:
    """A probe from ``policy@budget[:key=value...]`` or ``{policy, budget, settings}``."""
    if isinstance(entry, str):
        policy, budget, settings = _split(entry, where)
    elif isinstance(entry, Mapping):  # a row of the probe table has its id too
        unknown = set(entry) - {"id", "policy", "budget", "settings"}
        if unknown or "policy" not in entry:
            raise ConfigError(f"{where}={dict(entry)}: expected the keys policy, budget (optional), settings (optional)")
        policy, budget, settings = str(entry["policy"]), entry.get("budget"), dict(entry.get("settings") or {})
    else:
        raise ConfigError(f"{where}={entry!r}: expected a probe such as random@0.25 or {{policy: random, budget: 0.25}}")
    if policy not in available_policies():
        raise ConfigError(f"{where}={entry}: policy {policy!r} is not one of {', '.join(available_policies())}")
    try:
        budget = policy_class(policy).resolve_budget(budget)
        get_policy(policy, **settings)
    except (BudgetError, ValueError, TypeError) as error:
        raise ConfigError(f"{where}={entry}: {error}") from None
    probe = Probe(policy, budget, settings)
    if isinstance(entry, Mapping) and entry.get("id", probe.id) != probe.id:
        raise ConfigError(f"{where}={dict(entry)}: id {entry['id']!r} does not name this probe (expected {probe.id!r})")
    if not PROBE_ID.fullmatch(probe.id):
        raise ConfigError(f"{where}={entry}: its id {probe.id!r} has characters a metric name cannot hold")
    return probe


def _fixed_budget(policy: str) -> float | None:
    """The policy's budget by definition (``none`` 0, ``full`` 1), None for others and unknown names."""
    return policy_class(policy).fixed_budget if policy in available_policies() else None


_SETTING = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.+)")


def _split(text: str, where: str) -> tuple[str, float | None, dict[str, Any]]:
    head, *pairs = text.split(":")
    policy, _, budget_text = head.partition("@")
    budget: float | None = None
    if budget_text:
        try:
            budget = float(budget_text)
        except ValueError:
            raise ConfigError(f"{where}={text}: budget {budget_text!r} is not a number (expected e.g. random@0.25)") from None
    elif _fixed_budget(policy) is None:
        raise ConfigError(f"{where}={text}: expected a budget, e.g. {policy}@0.25 (only none and full have one already)")
    settings: dict[str, Any] = {}
    for pair in pairs:
        match = _SETTING.fullmatch(pair)
        if match is None:
            raise ConfigError(f"{where}={text}: setting {pair!r} is not key=value (e.g. fisher@0.25:tau=1.0)")
        settings[match[1]] = _value(match[2])
    return policy, budget, settings


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def probe_table(probes: tuple[Probe, ...]) -> list[dict[str, Any]]:
    """The probe table of a run config: one row per probe, in the order they run."""
    return [probe.row() for probe in probes]


def check_probe_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"probe_every={value!r}: expected an integer >= 1 (probe every N-th training step)")
    return value


def is_probed(step: int, every: int) -> bool:
    """Steps 0, every, 2 * every, ...: the first step is always probed."""
    return step % every == 0


def probe_generator(seed: int, step: int, probe_id: str, *sequence: bytes) -> torch.Generator:
    """The generator of one probe at one step (of one sequence, by its content key): a function of
    (cell seed, step, probe id, sequence) only."""
    return stream(seed, "probe", step, probe_id, *sequence)


def probe_record(probe_id: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """A probe's ``mismatch/`` and :data:`PROBE_REPLAY_KEYS` under its own family ``probe/<id>/``."""
    return {probe_key(probe_id, key): float(value) for key, value in metrics.items()
            if key.startswith("mismatch/") or key in PROBE_REPLAY_KEYS}
