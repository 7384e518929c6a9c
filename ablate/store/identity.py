"""A cell's identity against what it computed: ``cell.json`` is checked, never trusted.

``cell.json`` says which cell a directory holds (policy, budget, seed, ...), and every reader
groups the cell by it: a sweep skips it as complete, the analysis puts it in an arm. Its fields
are what the cell's resolved config (``config.yaml``) says, and its ``cell_id`` is the hash of
that config (:func:`cell_id_of`); a ``cell.json`` edited or copied from another cell says
otherwise, and the cell is refused (:func:`check_identity`) rather than counted where it does not
belong. The check is two comparisons of plain values; hashing the config costs a parse of
``config.yaml``, which only the analysis reads anyway (a sweep compares with the cell it
planned, whose id it already knows).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ablate.store.files import StoreError

if TYPE_CHECKING:
    from ablate.store.layout import CellIdentity

#: Top-level config keys that never change what a cell computes (``plugins`` says where a policy's
#: code is found; the policy's name and settings are what the cell computes with; ``analysis`` is
#: read by ``ablate-analyze`` only; ``cell_timeout`` only bounds how long the cell may take).
NOT_IDENTITY = ("tracking", "store_dir", "sweep", "objective", "hydra", "plugins", "analysis", "cell_timeout")

#: The fields of ``cell.json`` that a cell's config determines; ``name`` and ``variant`` are
#: derived from them, ``sweep`` and ``wandb_run_id`` say where it ran, not what it computed.
DETERMINED = ("cell_id", "backend", "policy", "budget", "seed", "trial", "settings", "schema_version")


#: Config keys added after cells were first stored, with their defaults: a cell that leaves one at its
#: default computes what it computed before the key existed, and its identity hashes without it.
LATER_KEYS: dict[str, object] = {"replay.source": "rollout", "replay.weights": "recompute"}
#: Diagnostics schema versions that only add keys, with the version they extend: a cell of one hashes
#: the version it extends, so a store resumed after the bump keeps its cells' identities (the records'
#: own version is ``schema_version`` in the config). Versions that change keys hash as themselves.
ADDITIVE_SCHEMA_VERSIONS: dict[str, str] = {"1.3": "1.2"}


def cell_id_of(resolved: Mapping[str, Any]) -> str:
    """The identity of a resolved config: a hash of every key that changes what the cell computes.

    A key of :data:`LATER_KEYS` at its default and a schema version of :data:`ADDITIVE_SCHEMA_VERSIONS`
    hash as they did before the key or the version existed, so a run store keeps its cells' identities.
    """
    identity = {k: v for k, v in resolved.items() if k not in NOT_IDENTITY}
    for key, default in LATER_KEYS.items():
        section, _, name = key.partition(".")
        values = identity.get(section)
        if isinstance(values, Mapping) and values.get(name) == default:
            values = {k: v for k, v in values.items() if k != name}
            identity = {**identity, section: values} if values else {k: v for k, v in identity.items() if k != section}
    version = identity.get("schema_version")
    if isinstance(version, str) and version in ADDITIVE_SCHEMA_VERSIONS:
        identity["schema_version"] = ADDITIVE_SCHEMA_VERSIONS[version]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def config_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`DETERMINED` fields as a cell's resolved config gives them."""
    policy = config.get("policy") if isinstance(config.get("policy"), Mapping) else {}
    backend = config.get("backend") if isinstance(config.get("backend"), Mapping) else {}
    return {
        "cell_id": cell_id_of(config), "backend": backend.get("name"), "policy": policy.get("name"),
        "budget": config.get("budget"), "seed": config.get("seed"), "trial": config.get("trial"),
        "settings": {k: v for k, v in policy.items() if k not in ("name", "fisher")},
        "schema_version": config.get("schema_version"),
    }


def check_identity(identity: CellIdentity, expected: Mapping[str, Any], path: Path, source: str) -> None:
    """Raise :class:`StoreError` naming the first field of ``identity`` that ``expected`` contradicts.

    ``expected`` holds fields of :data:`DETERMINED` (and may hold ``name`` and ``variant``), as
    ``source`` gives them (the cell's config, or the cell a sweep planned).
    """
    for field, value in expected.items():
        found = getattr(identity, field)
        if found != value:
            raise StoreError(f"{path}: corrupt cell identity: {field}={found!r}, but {source} says {value!r}")
