"""The local run store: the source of truth for every cell (docs/design.md section 5).

One concern a module:

- :mod:`~ablate.store.files`: atomic writes and strict JSON reads, for every whole file;
- :mod:`~ablate.store.layout`: where a sweep and a cell live, the files a cell holds, and the
  readers of its identity, records and summary;
- :mod:`~ablate.store.claims`: the claim that keeps two workers off one cell, and the fence that
  stops a worker that lost it;
- :mod:`~ablate.store.state`: where a cell stands (:class:`CellState`), read from its files alone;
- :mod:`~ablate.store.recorder`: the writer of a cell's files as it runs.

The names below load on first use (PEP 562), so that a light module of the store (``files``)
is imported without the rest (pandas, psutil): logging setup and ``--help`` pay for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_EXPORTS = {
    "ATTEMPT_FILES": "ablate.store.layout",
    "CELL_FILE": "ablate.store.layout",
    "CLAIM_FILE": "ablate.store.layout",
    "CONFIG_FILE": "ablate.store.layout",
    "CellBusy": "ablate.store.claims",
    "CellIdentity": "ablate.store.layout",
    "CellRecorder": "ablate.store.recorder",
    "CellContents": "ablate.store.state",
    "CellState": "ablate.store.state",
    "CellView": "ablate.store.state",
    "Claim": "ablate.store.claims",
    "ClaimLost": "ablate.store.claims",
    "HEARTBEAT_EVERY": "ablate.store.claims",
    "RECORDS_FILE": "ablate.store.layout",
    "RECORDS_LOG": "ablate.store.layout",
    "STALE_AFTER": "ablate.store.claims",
    "STATUS_FILE": "ablate.store.layout",
    "SUMMARY_FILE": "ablate.store.layout",
    "StoreError": "ablate.store.files",
    "WANDB_DIR": "ablate.store.layout",
    "atomic_write": "ablate.store.files",
    "atomic_write_bytes": "ablate.store.files",
    "atomic_write_json": "ablate.store.files",
    "cell_directories": "ablate.store.layout",
    "claim": "ablate.store.claims",
    "claim_holder": "ablate.store.claims",
    "describe_error": "ablate.store.recorder",
    "describe_holder": "ablate.store.claims",
    "held": "ablate.store.claims",
    "holder_is_alive": "ablate.store.claims",
    "inspect_cell": "ablate.store.state",
    "is_disk_full": "ablate.store.files",
    "make_directory": "ablate.store.files",
    "read_identity": "ablate.store.layout",
    "read_json": "ablate.store.files",
    "read_records": "ablate.store.layout",
    "read_records_table": "ablate.store.layout",
    "read_summary": "ablate.store.layout",
    "summary_with_nan": "ablate.store.layout",
    "records_frame": "ablate.store.layout",
    "remove_dead_writers_files": "ablate.store.files",
    "store_root": "ablate.store.layout",
    "sweep_directory": "ablate.store.layout",
    "this_process": "ablate.store.claims",
}

__all__ = [
    "ATTEMPT_FILES",
    "CELL_FILE",
    "CLAIM_FILE",
    "CONFIG_FILE",
    "CellBusy",
    "CellIdentity",
    "CellRecorder",
    "CellContents",
    "CellState",
    "CellView",
    "Claim",
    "ClaimLost",
    "HEARTBEAT_EVERY",
    "RECORDS_FILE",
    "RECORDS_LOG",
    "STALE_AFTER",
    "STATUS_FILE",
    "SUMMARY_FILE",
    "StoreError",
    "WANDB_DIR",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "cell_directories",
    "claim",
    "claim_holder",
    "describe_error",
    "describe_holder",
    "held",
    "holder_is_alive",
    "inspect_cell",
    "is_disk_full",
    "make_directory",
    "read_identity",
    "read_json",
    "read_records",
    "read_records_table",
    "read_summary",
    "records_frame",
    "remove_dead_writers_files",
    "store_root",
    "summary_with_nan",
    "sweep_directory",
    "this_process",
]

if TYPE_CHECKING:
    from ablate.store.claims import (
        HEARTBEAT_EVERY,
        STALE_AFTER,
        CellBusy,
        Claim,
        ClaimLost,
        claim,
        claim_holder,
        describe_holder,
        held,
        holder_is_alive,
        this_process,
    )
    from ablate.store.files import (
        StoreError,
        atomic_write,
        atomic_write_bytes,
        atomic_write_json,
        is_disk_full,
        make_directory,
        read_json,
        remove_dead_writers_files,
    )
    from ablate.store.layout import (
        ATTEMPT_FILES,
        CELL_FILE,
        CLAIM_FILE,
        CONFIG_FILE,
        RECORDS_FILE,
        RECORDS_LOG,
        STATUS_FILE,
        SUMMARY_FILE,
        WANDB_DIR,
        CellIdentity,
        cell_directories,
        read_identity,
        read_records,
        read_records_table,
        read_summary,
        records_frame,
        store_root,
        summary_with_nan,
        sweep_directory,
    )
    from ablate.store.recorder import CellRecorder, describe_error
    from ablate.store.state import CellContents, CellState, CellView, inspect_cell


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ablate.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
