"""Which config keys make an arm: the keys whose value differs between the loaded cells.

An arm is the policy (with its non-default settings), the budget and every config key that varies
in the sweep, except the keys that say where or how a cell ran, the grid's own axes, and policy
settings and replay variants that the arm's name already carries (docs/analysis.md, "Arms"). A
cell stored before a key existed has that key's default (:data:`ablate.cell.LATER_KEYS`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol, Sequence

from ablate.cell import LATER_KEYS

#: Config keys (and the sub-trees under them) that never make an arm: where and how a cell ran,
#: and the grid's own axes, which are columns of their own.
NOT_ARM_KEYS: tuple[str, ...] = (
    "tracking", "store_dir", "sweep", "objective", "hydra", "budget", "seed", "trial", "schema_version", "policy.name",
    "analysis", "cell_timeout",
)
#: The value of a key a cell's config does not have.
MISSING = "<missing>"


class ConfiguredCell(Protocol):
    meta: dict[str, Any]
    config: dict[str, Any]


def varied_config_keys(cells: Sequence[ConfiguredCell]) -> tuple[list[str], dict[str, str]]:
    """Config keys whose value differs between ``cells`` and that make an arm (module doc).

    Returns the arm keys and, apart, the varied keys that another arm key determines, each with
    the key that determines it: a named regime of a backend (``backend=synthetic_async``) sets
    ``backend.regime`` together with its settings (``backend.rollout_lag``), and those settings
    add no arm of their own. Keys with more distinct values are kept first, then by name.
    """
    keys = sorted(key for key in _all_keys(cells) if not _not_arm_key(key))
    values: dict[str, list[Any]] = {}
    for key in keys:
        column = _column(cells, key)
        if len(set(column)) < 2:
            continue
        if key.split(".")[0] in ("policy", "replay") and _fixed_within_policy_arms(cells, column):
            continue  # the arm name (fisher[tau=1.0], full[replay.source=train]) already tells these cells apart
        values[key] = column
    varied: list[str] = []
    determined: dict[str, str] = {}
    for key in sorted(values, key=lambda k: (-len(set(values[k])), k)):
        by = next((kept for kept in varied if _determines(values[kept], values[key])), None)
        if by is None:
            varied.append(key)
        else:
            determined[key] = by
    return sorted(varied), determined


def varied_policy_settings(cells: Sequence[ConfiguredCell], config_keys: list[str]) -> list[str]:
    """``policy.*`` keys (besides the name) whose value differs between cells and that are no arm keys."""
    keys = sorted(key for key in _all_keys(cells)
                  if key.startswith("policy.") and key != "policy.name" and key not in config_keys)
    return [key for key in keys if len(set(_column(cells, key))) > 1]


def hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _all_keys(cells: Sequence[ConfiguredCell]) -> set[str]:
    keys: set[str] = set()
    for cell in cells:
        keys.update(cell.config)
    return keys


def _column(cells: Sequence[ConfiguredCell], key: str) -> list[Any]:
    column = [cell.config.get(key, LATER_KEYS.get(key, MISSING)) for cell in cells]
    if any(isinstance(value, (list, dict)) for value in column):
        return [hashable(value) for value in column]
    return column


def _determines(cause: list[Any], effect: list[Any]) -> bool:
    """Whether each value of ``cause`` goes with one value of ``effect`` only."""
    seen: dict[Any, Any] = {}
    return all(seen.setdefault(c, e) == e for c, e in zip(cause, effect))


def _not_arm_key(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in NOT_ARM_KEYS)


def _fixed_within_policy_arms(cells: Sequence[ConfiguredCell], column: list[Any]) -> bool:
    values: dict[str, set[Any]] = {}
    for cell, value in zip(cells, column):
        values.setdefault(cell.meta["policy"], set()).add(value)
    return all(len(found) == 1 for found in values.values())
