"""The versioned diagnostics schema (docs/design.md section 4): one source for every key.

Each key has a kind that fixes its type and range, a unit and a meaning. Backends validate every
record against it: in tests an unknown key or an out-of-range value raises, in production it is a
logged warning. ``schema.json`` beside this file is the same schema as JSON Schema, for tools
outside Python; regenerate it with ``python -m ablate.diagnostics``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

#: 1.1 adds replay/effective_budget, replay/fisher_nonfinite, replay/unrecorded_routes and the train/ keys
#: of the synthetic backend's PPO step (clip_frac_lower, reward_chance, task_shifted, is_weight_mean, is_truncated_frac).
#: 1.2 adds the probe families ``probe/<probe id>/<key>`` (docs/probes.md): per counterfactual probe,
#: the ``mismatch/`` keys and replay/budget_realized, override_rate, effective_budget of its mask.
#: 1.3 adds replay/replace_rate (the share of replayed expert slots a gate handed back: policy=threshold)
#: for the replay variants (docs/policies.md); every 1.2 key keeps its meaning.
SCHEMA_VERSION = "1.3"
JSON_SCHEMA_PATH = Path(__file__).with_name("schema.json")
#: Each version whose records only add keys to an earlier version's, with that version: cells of the
#: two are compared as one (:func:`comparable_version`), so a store resumed after the bump stays one sweep.
EXTENDS: dict[str, str] = {"1.3": "1.2"}


def comparable_version(version: str | None) -> str | None:
    """The earliest version whose records ``version``'s only add keys to (itself if none): what cells compare by."""
    while version in EXTENDS:
        version = EXTENDS[version]
    return version


Kind = Literal["fraction", "count", "nonnegative", "real", "flag"]
_RANGES: dict[str, tuple[float, float]] = {
    "fraction": (0.0, 1.0),
    "count": (0.0, math.inf),
    "nonnegative": (0.0, math.inf),
    "real": (-math.inf, math.inf),
    "flag": (0.0, 1.0),
}

log = logging.getLogger(__name__)


class SchemaError(ValueError):
    """A diagnostics record that does not conform to the schema."""


@dataclass(frozen=True)
class Key:
    """One diagnostic: ``kind`` fixes type and range; ``nullable`` allows NaN (undefined this step)."""

    name: str
    kind: Kind
    unit: str
    meaning: str
    nullable: bool = False

    @property
    def range(self) -> tuple[float, float]:
        return _RANGES[self.kind]


_KEYS = [
    # replay/: what the mask did.
    Key("replay/budget_requested", "fraction", "fraction of valid routes", "budget b asked of the policy"),
    Key("replay/budget_realized", "fraction", "fraction of valid routes", "replayed routes / valid routes"),
    Key("replay/valid_routes", "count", "routes", "N: valid tokens times MoE layers"),
    Key("replay/replayed_routes", "count", "routes", "n: routes whose rollout route was replayed"),
    Key("replay/unrecorded_routes", "count", "routes",
        "routes the rollout engine did not record (multi-turn gaps, the final token's placeholder): "
        "not replayable and not counted in valid_routes"),
    Key("replay/override_rate", "fraction", "fraction of replayed routes",
        "share of replayed routes whose rollout route differs from the native route: how much replay changed", True),
    Key("replay/effective_budget", "fraction", "fraction of valid routes",
        "replayed routes whose rollout route differs from the native route: the routes replay changed "
        "(budget_realized x override_rate)", True),
    Key("replay/replace_rate", "fraction", "fraction of replayed expert slots",
        "replayed experts the trainer's score gate handed back to its own top-k (policy=threshold; 0 without a "
        "gate)", True),
    Key("replay/fisher_mass", "fraction", "fraction of Fisher score",
        "share of the total Fisher route score of valid routes that the mask covers", True),
    Key("replay/fisher_fallback", "flag", "0/1",
        "1 when the fisher policy had no usable estimate (none yet, non-finite, or all zero) and selected at random"),
    Key("replay/fisher_nonfinite", "count", "contributions",
        "non-finite per-token squared gradients the Fisher tracker skipped in its last update", True),
    # routing/: rollout versus native routes.
    Key("routing/route_mismatch_rate", "fraction", "fraction of valid routes",
        "routes whose rollout and native expert sets differ", True),
    Key("routing/token_mismatch_rate", "fraction", "fraction of valid tokens",
        "tokens with at least one mismatched layer", True),
    Key("routing/topk_overlap", "fraction", "|A and B| / k", "mean top-k overlap of rollout and native routes", True),
    Key("routing/mismatch_recall", "fraction", "fraction of mismatched routes",
        "mismatched routes that were replayed", True),
    Key("routing/residual_mismatch_rate", "fraction", "fraction of valid routes",
        "routes still mismatched after replay: mismatched and not replayed", True),
    # mismatch/: rollout versus training log-probs after replay, l = logp_train - logp_rollout.
    Key("mismatch/kl_k1", "real", "nats", "mean(-l): the k1 estimator of KL(rollout || train)"),
    Key("mismatch/kl_k2", "nonnegative", "nats", "mean(l^2 / 2)"),
    Key("mismatch/kl_k3", "nonnegative", "nats", "mean(exp(l) - 1 - l): unbiased, non-negative KL estimator"),
    Key("mismatch/extreme_token_frac", "fraction", "fraction of valid tokens",
        "tokens with max(r, 1/r) > tau, r = exp(l), tau = 2 by default"),
    Key("mismatch/abs_logratio_mean", "nonnegative", "nats", "mean |l|"),
    Key("mismatch/abs_logratio_max", "nonnegative", "nats", "max |l|"),
    # load/: expert load of the routes the training forward used, per layer, reduced over layers.
    Key("load/entropy_norm", "fraction", "entropy / log(E)", "normalised entropy of expert load, mean over layers"),
    Key("load/entropy_norm_min", "fraction", "entropy / log(E)", "normalised entropy of expert load, worst layer"),
    Key("load/max_violation", "nonnegative", "max/mean - 1", "load imbalance, mean over layers"),
    Key("load/max_violation_max", "nonnegative", "max/mean - 1", "load imbalance, worst layer"),
    Key("load/cv", "nonnegative", "std/mean", "coefficient of variation of expert load, mean over layers"),
    Key("load/dead_expert_frac", "fraction", "fraction of (layer, expert)", "experts that received no token"),
    # drift/: relative parameter change since step 0.
    Key("drift/experts", "nonnegative", "||w - w0|| / ||w0||", "relative change of all expert parameters"),
    Key("drift/router", "nonnegative", "||w - w0|| / ||w0||", "relative change of all router parameters"),
    # train/: the RL update itself.
    Key("train/reward", "real", "task reward", "mean reward of the step's rollouts"),
    Key("train/reward_std", "nonnegative", "task reward", "standard deviation of the step's rewards"),
    Key("train/loss", "real", "loss", "policy-gradient loss"),
    Key("train/grad_norm", "nonnegative", "L2 norm", "gradient norm before clipping"),
    Key("train/clip_frac", "fraction", "fraction of valid tokens",
        "tokens whose gradient the PPO clip removes (the clipped term wins; verl's pg_clipfrac)"),
    Key("train/clip_frac_lower", "fraction", "fraction of valid tokens",
        "negative-advantage tokens whose ratio the dual clip caps (verl's pg_clipfrac_lower)"),
    Key("train/entropy", "nonnegative", "nats", "mean policy entropy per valid token"),
    Key("train/reward_chance", "real", "task reward", "expected reward of a uniformly random response"),
    Key("train/task_shifted", "flag", "0/1", "1 once the task's rules have changed (a task-shift regime)"),
    Key("train/is_weight_mean", "nonnegative", "ratio",
        "mean truncated importance weight old / rollout over valid tokens (verl's rollout_is_mean)", True),
    Key("train/is_truncated_frac", "fraction", "fraction of valid tokens or sequences",
        "importance weights above the truncation threshold (verl's rollout_is_ratio_fraction_high)", True),
]

SCHEMA: dict[str, Key] = {key.name: key for key in _KEYS}
SECTIONS: tuple[str, ...] = ("replay", "routing", "mismatch", "load", "drift", "train")


#: The schema keys a probe family holds, each validated like the key itself.
PROBE_KEYS: tuple[str, ...] = (
    *(name for name in SCHEMA if name.startswith("mismatch/")),
    "replay/budget_realized", "replay/override_rate", "replay/effective_budget",
)
#: A probe id (``ablate.probes.Probe.id``): a policy, ``@budget``, ``:key=value`` settings.
PROBE_ID = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*(@[0-9.e+-]+)?(:[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.+-]+)*")
PROBE_PREFIX = "probe/"


def probe_key(probe_id: str, key: str) -> str:
    """``probe/<probe id>/<key>``, e.g. ``probe/random@0.25/mismatch/kl_k3``."""
    return f"{PROBE_PREFIX}{probe_id}/{key}"


def split_probe_key(name: str) -> tuple[str, str] | None:
    """``(probe id, key)`` of a probe key, None for any other name. The key's last two parts are the key."""
    if not name.startswith(PROBE_PREFIX):
        return None
    probe_id, _, key = name[len(PROBE_PREFIX):].rpartition("/")
    probe_id, _, section = probe_id.rpartition("/")
    return (probe_id, f"{section}/{key}") if probe_id else None


def _probe_problems(name: str, value: Any) -> list[str] | None:
    """Problems of a probe key, or None when ``name`` is no probe key at all."""
    parts = split_probe_key(name)
    if parts is None:
        return None
    probe_id, key = parts
    if not PROBE_ID.fullmatch(probe_id) or key not in PROBE_KEYS:
        return [f"unknown diagnostics key {name!r} (schema {SCHEMA_VERSION}): a probe key is probe/<probe id>/<key> "
                f"with a key among {', '.join(PROBE_KEYS)}"]
    return [problem.replace(key, name, 1) for problem in _check_value(SCHEMA[key], value)]


def keys_in(section: str) -> list[str]:
    """Every key of one section, e.g. ``keys_in("routing")``."""
    if section not in SECTIONS:
        raise SchemaError(f"unknown section {section!r}: expected one of {', '.join(SECTIONS)}")
    return [name for name in SCHEMA if name.startswith(section + "/")]


def check_record(record: Mapping[str, Any], *, require: tuple[str, ...] = ()) -> list[str]:
    """Every problem of ``record`` as a sentence naming the key; empty when it conforms.

    ``require`` lists sections that must be complete (``("replay", "routing")``), for backends
    that promise them.
    """
    problems = []
    for name, value in record.items():
        key = SCHEMA.get(name)
        probe_problems = None if key is not None else _probe_problems(name, value)
        if probe_problems is not None:
            problems.extend(probe_problems)
            continue
        if key is None:
            problems.append(f"unknown diagnostics key {name!r} (schema {SCHEMA_VERSION})")
            continue
        problems.extend(_check_value(key, value))
    for section in require:
        missing = [name for name in keys_in(section) if name not in record]
        if missing:
            problems.append(f"section {section}/ is missing {', '.join(missing)}")
    return problems


def _check_value(key: Key, value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [f"{key.name}={value!r}: expected a number ({key.kind}), got a {type(value).__name__}"]
    value = float(value)
    if math.isnan(value):
        return [] if key.nullable else [f"{key.name}=nan: this key is always defined ({key.meaning})"]
    low, high = key.range
    if not low <= value <= high:
        return [f"{key.name}={value!r}: expected a {key.kind} in [{low}, {high}] ({key.unit})"]
    if key.kind in ("count", "flag") and value != int(value):
        return [f"{key.name}={value!r}: expected a whole number ({key.kind})"]
    return []


def validate_record(record: Mapping[str, Any], *, strict: bool = True, require: tuple[str, ...] = ()) -> list[str]:
    """Raise :class:`SchemaError` listing every problem (``strict``), or log them and return them."""
    problems = check_record(record, require=require)
    if problems and strict:
        raise SchemaError("diagnostics record does not conform: " + "; ".join(problems))
    for problem in problems:
        log.warning("diagnostics: %s", problem)
    return problems


def to_json_schema() -> dict[str, Any]:
    """The schema as a JSON Schema (draft 2020-12) for one record."""
    properties: dict[str, Any] = {}
    for key in SCHEMA.values():
        low, high = key.range
        prop: dict[str, Any] = {
            "type": "integer" if key.kind in ("count", "flag") else "number",
            "description": f"{key.meaning} [{key.unit}]",
            "x-kind": key.kind,
            "x-unit": key.unit,
        }
        if math.isfinite(low):
            prop["minimum"] = low
        if math.isfinite(high):
            prop["maximum"] = high
        if key.nullable:
            prop = {"anyOf": [prop, {"const": "NaN"}], "description": prop["description"] + " NaN when undefined."}
        properties[key.name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"ablate-diagnostics-{SCHEMA_VERSION}",
        "title": f"ablate diagnostics record, schema {SCHEMA_VERSION}",
        "type": "object",
        "properties": properties,
        "patternProperties": {_probe_pattern(key): _without_range_note(properties[key]) for key in PROBE_KEYS},
        "additionalProperties": False,
    }


def _probe_pattern(key: str) -> str:
    return "^" + re.escape(PROBE_PREFIX) + PROBE_ID.pattern + "/" + re.escape(key) + "$"


def _without_range_note(prop: dict[str, Any]) -> dict[str, Any]:
    """A probe key's JSON Schema: its schema key's, said of a probe's mask."""
    return {**prop, "description": "of a probe's mask: " + prop["description"]}


def write_json_schema(path: Path = JSON_SCHEMA_PATH) -> None:
    path.write_text(json.dumps(to_json_schema(), indent=2) + "\n")
