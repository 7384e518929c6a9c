"""The run store as a source: the complete cells of a sweep directory, read through :mod:`ablate.store`.

The store decides what a cell is (:func:`~ablate.store.inspect_cell`): complete only with a valid
identity that names its own directory and agrees with its config, its summary and Parquet records
(a step at least); every other cell is counted by its state, and a corrupt one raises
:class:`CorruptCellError` naming its file (or, with ``on_corrupt="exclude"``, is counted and named).

Each complete cell costs the parsing of its files and nothing per cell beyond it: its records are
read as an Arrow table when the store checks them (``inspect_cell(..., contents=True)``), all of them concatenated
once, and its outcomes are taken from its ``summary.json`` when that summary holds every outcome
and was written after the records (the runner writes the records, then the summary, from the
same rows): a records file replaced after its summary gets its outcomes recomputed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ablate.analysis.sources import (
    CELL,
    EXCLUDED_AS,
    CorruptCellError,
    Loaded,
    LoadedCell,
    flatten_config,
    no_exclusions,
    version,
    with_arm,
)
from ablate.outcomes import OUTCOME_NAMES
from ablate.store import (
    RECORDS_FILE,
    SUMMARY_FILE,
    CellState,
    cell_directories,
    inspect_cell,
)

def read_store(sweep_path: Path, on_corrupt: str) -> Loaded:
    """The complete cells of a sweep directory, with their summaries' outcomes where those stand."""
    cells: list[LoadedCell] = []
    records = _Records()
    excluded = no_exclusions()
    corrupt: list[str] = []
    for cell_dir in cell_directories(sweep_path):
        view = inspect_cell(cell_dir, contents=True)
        if view.state is CellState.CORRUPT:
            error = CorruptCellError(view.detail or f"{cell_dir}: corrupt cell")
            if on_corrupt == "error":
                raise error
            excluded["corrupt"] += 1
            corrupt.append(str(error))
            continue
        if view.state is not CellState.COMPLETE:
            excluded[EXCLUDED_AS[view.state]] += 1
            continue
        contents = view.contents
        assert contents is not None
        identity, config = contents.identity, flatten_config(contents.config)
        meta = {
            **vars(identity), "sweep": identity.sweep or sweep_path.name, "status": CellState.COMPLETE.value,
            "path": str(cell_dir), "schema_version": version(identity.schema_version or config.get("schema_version")),
            "streams": identity.streams or 1,
        }
        cells.append(LoadedCell(with_arm(meta), config, outcomes=_summary_outcomes(cell_dir, contents.summary)))
        records.add(contents.records)
    return Loaded(cells, records.frame(), excluded, corrupt)


def _summary_outcomes(cell_dir: Path, summary: dict[str, Any]) -> dict[str, float] | None:
    """The outcomes of the cell's summary, or None when they may not be those of its records.

    They stand for a recomputation when the summary holds every outcome as a number and was
    written no earlier than the records file (the runner writes them in that order; a copy that
    keeps modification times, ``cp -a`` or ``rsync -a``, keeps the order too).
    """
    if os.stat(cell_dir / SUMMARY_FILE).st_mtime_ns < os.stat(cell_dir / RECORDS_FILE).st_mtime_ns:
        return None
    outcomes = {name: summary.get(name) for name in OUTCOME_NAMES}
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in outcomes.values()):
        return None
    return {name: float(value) for name, value in outcomes.items()}


class _Records:
    """Every cell's records gathered into one frame, with the cell's index in :data:`CELL`.

    Arrow concatenates the tables (a column some cells lack is null there, and an integer column
    that another cell wrote as float becomes float), a batch at a time: a small table costs far more
    memory as an object of its own than its values do (about 70 KiB against 7 KiB of values here),
    so each batch is merged into contiguous columns as soon as it is full, and the result is
    converted to pandas once. Batches of 32 cost the least CPU of 4 to 1,024 on a 5,000-cell sweep
    (merged while their tables are still in the CPU's caches) and hold the least memory.
    """

    BATCH = 32

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._pending: list[Any] = []
        self._parts: list[Any] = []  # Arrow tables, or frames where Arrow would not unify the columns

    def add(self, table: Any) -> None:
        self.lengths.append(table.num_rows)
        self._pending.append(table)
        if len(self._pending) == self.BATCH:
            self._parts.append(_merge(self._pending, contiguous=True))
            self._pending = []

    def frame(self) -> pd.DataFrame:
        """The records as one frame; the batches are released as they are converted."""
        if not self.lengths:
            return pd.DataFrame({CELL: np.zeros(0, dtype=np.int64)})
        merged = _merge(self._parts + self._pending, contiguous=False)
        self._parts, self._pending = [], []
        if isinstance(merged, pd.DataFrame):
            frame = merged
        else:  # the first cell's pandas metadata (an index of its length) does not describe the whole
            frame = merged.replace_schema_metadata(None).to_pandas(split_blocks=True, self_destruct=True)
        frame[CELL] = np.repeat(np.arange(len(self.lengths), dtype=np.int64), self.lengths)
        return frame


def _merge(parts: list[Any], *, contiguous: bool) -> Any:
    """One Arrow table of ``parts`` (``contiguous``: each column one array); a pandas frame where
    Arrow will not unify a column's types (text in one cell, numbers in another), as pandas can."""
    import pyarrow as pa

    if all(isinstance(part, pa.Table) for part in parts):
        first = parts[0].schema
        same = all(part.schema.equals(first) for part in parts)  # the usual case, 3x cheaper than unifying
        try:
            merged = pa.concat_tables(parts) if same else pa.concat_tables(parts, promote_options="permissive")
            return merged.combine_chunks() if contiguous else merged
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            pass
    return pd.concat([part if isinstance(part, pd.DataFrame) else part.to_pandas() for part in parts],
                     ignore_index=True)
