"""The local run store: the source of truth for every cell (docs/design.md section 5).

One concern a module:

- :mod:`~ablate.store.files`: atomic writes and strict JSON reads, for every whole file;
- :mod:`~ablate.store.layout`: where a sweep and a cell live, the files a cell holds, and the
  readers of its identity, records and summary;
- :mod:`~ablate.store.claims`: the claim that keeps two workers off one cell, and the fence that
  stops a worker that lost it;
- :mod:`~ablate.store.state`: where a cell stands (:class:`CellState`), read from its files alone;
- :mod:`~ablate.store.recorder`: the writer of a cell's files as it runs.
"""

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
    read_summary,
    records_frame,
    store_root,
    sweep_directory,
)
from ablate.store.recorder import CellRecorder, describe_error
from ablate.store.state import CellState, CellView, inspect_cell

__all__ = [
    "ATTEMPT_FILES", "CELL_FILE", "CLAIM_FILE", "CONFIG_FILE", "HEARTBEAT_EVERY", "RECORDS_FILE", "RECORDS_LOG",
    "STALE_AFTER", "STATUS_FILE", "SUMMARY_FILE", "WANDB_DIR", "CellBusy", "CellIdentity", "CellRecorder", "CellState",
    "CellView", "Claim", "ClaimLost", "StoreError", "atomic_write", "atomic_write_bytes", "atomic_write_json",
    "cell_directories", "claim", "claim_holder", "describe_error", "describe_holder", "held", "holder_is_alive",
    "inspect_cell", "is_disk_full", "make_directory", "read_identity", "read_json", "read_records", "read_summary",
    "records_frame", "remove_dead_writers_files", "store_root", "sweep_directory", "this_process",
]
