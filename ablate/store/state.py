"""Where a cell stands in the run store, read from its files alone: the one vocabulary of states
that planning, progress, the final tally and the analysis all use."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ablate.store.claims import claim_holder, describe_holder
from ablate.store.files import StoreError, read_json
from ablate.store.identity import DETERMINED, check_identity, config_identity
from ablate.store.layout import (
    CELL_FILE,
    CLAIM_FILE,
    CONFIG_FILE,
    RECORDS_FILE,
    STATUS_FILE,
    SUMMARY_FILE,
    CellIdentity,
    check_parquet,
    read_config,
    read_identity,
    read_records_table,
    summary_with_nan,
)

if TYPE_CHECKING:
    import pyarrow as pa


class CellState(str, Enum):
    """Where a cell stands in the run store: the one vocabulary of the store's readers.

    ``status.json`` records ``running``, ``complete``, ``failed`` or ``interrupted``; the other
    states are derived: ``new`` (never started), ``unfinished`` (recorded as running, but no
    live worker holds it: killed or crashed) and ``corrupt`` (a file that must be readable is
    not: ``status.json``, or a complete cell's ``cell.json``, summary or Parquet records).
    """

    NEW = "new"
    RUNNING = "running"
    UNFINISHED = "unfinished"
    COMPLETE = "complete"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CORRUPT = "corrupt"

    @property
    def rerun(self) -> bool:
        """Whether a sweep (re)launches a cell in this state: all but complete and running ones."""
        return self not in (CellState.COMPLETE, CellState.RUNNING)


@dataclass(frozen=True)
class CellView:
    """What the store says about one cell directory, read once."""

    directory: Path
    state: CellState
    #: The attempt recorded in ``status.json`` (0: never started or unreadable).
    attempt: int
    #: The recorded error of a failed or interrupted cell, why a cell is corrupt, or who runs it.
    detail: str | None = None
    #: The warnings a complete cell recorded (a W&B run that fell back offline, a schema problem).
    warnings: tuple[str, ...] = ()
    #: What a complete cell holds, when ``inspect_cell(..., contents=True)`` was asked for it.
    contents: CellContents | None = None


@dataclass(frozen=True)
class CellContents:
    """A complete cell's identity, config, summary and records, as :func:`inspect_cell` read them to check them."""

    identity: CellIdentity
    #: ``config.yaml``: the resolved config the identity was checked against.
    config: dict[str, Any]
    #: ``summary.json``, with the nulls that stand for NaN turned back into NaN.
    summary: dict[str, Any]
    #: Every step record, read whole (the check that the records read back and the read are one).
    records: pa.Table


def inspect_cell(directory: Path, expected: str | CellIdentity | None = None, *, contents: bool = False) -> CellView:
    """Classify one cell directory; never raises for damage, which is the ``corrupt`` state.

    ``expected``, when given, is the cell the caller looks for: its id (or its whole identity)
    must match the one in ``cell.json`` for the cell to count as complete (a directory of another
    config under the same name is not this cell's result), and with the same id, every other
    field the config determines must match too (a ``cell.json`` that says another policy lies). A
    complete cell counts only when its identity (every field of :class:`CellIdentity`, and the
    directory it names), config, summary and Parquet records read back (the Parquet footer is
    checked, not every row) and the records hold a step; ``contents=True`` reads every row and
    the config, holds the identity to what the config says and hashes to
    (:mod:`ablate.store.identity`), and hands a complete cell's identity, config, summary and
    records back in :attr:`CellView.contents` (the analysis reads each file once). So a damaged
    cell is rerun instead of skipped, and read by no analysis.
    """
    # The status is read first: most cells a sweep plans have none yet, and one failed open says
    # so without the two checks below (a file where the directory is fails as ENOTDIR, not ENOENT).
    try:
        status = read_json(directory / STATUS_FILE)
    except FileNotFoundError:
        status = None
    except StoreError as error:
        status = error
    if status is not None and directory.exists() and not directory.is_dir():
        return CellView(directory, CellState.CORRUPT, 0,
                        f"{directory}: a file where the cell's directory should be; move it away, then run again")
    if (directory / CLAIM_FILE).is_dir():
        return CellView(directory, CellState.CORRUPT, 0,
                        f"{directory / CLAIM_FILE}: a directory where the cell's claim file should be; remove it, "
                        "then run again")
    if status is None:
        return CellView(directory, CellState.NEW, 0)
    if isinstance(status, StoreError):
        return CellView(directory, CellState.CORRUPT, 0, str(status))
    attempt = status.get("attempt")
    attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
    recorded = status.get("status")
    if recorded == CellState.RUNNING.value:
        holder = claim_holder(directory / CLAIM_FILE)
        if holder is None:
            return CellView(directory, CellState.UNFINISHED, attempt, "no live worker holds it (killed or crashed)")
        return CellView(directory, CellState.RUNNING, attempt, describe_holder(holder))
    if recorded in (CellState.FAILED.value, CellState.INTERRUPTED.value):
        return CellView(directory, CellState(recorded), attempt, status.get("error"))
    if recorded != CellState.COMPLETE.value:
        return CellView(directory, CellState.CORRUPT, attempt,
                        f"{directory / STATUS_FILE}: unknown status {recorded!r}; expected running, complete, "
                        "failed or interrupted")
    cell_id = expected.cell_id if isinstance(expected, CellIdentity) else expected
    try:
        identity = read_identity(directory)
        if cell_id is not None and identity.cell_id != cell_id:
            return CellView(directory, CellState.NEW, attempt, f"holds another cell ({identity.cell_id})")
        if isinstance(expected, CellIdentity):
            check_identity(identity, {field: getattr(expected, field) for field in (*DETERMINED, "name", "variant")},
                           directory / CELL_FILE, "the cell of this id")
        summary = read_json(directory / SUMMARY_FILE)
        if contents:
            records = read_records_table(directory)
            rows = records.num_rows
            config = read_config(directory)
            check_identity(identity, config_identity(config), directory / CELL_FILE, f"its {CONFIG_FILE}")
        else:
            rows = check_parquet(directory / RECORDS_FILE)
            if not (directory / CONFIG_FILE).is_file():
                raise FileNotFoundError(errno.ENOENT, "missing", str(directory / CONFIG_FILE))
        if rows == 0:
            raise StoreError(f"{directory / RECORDS_FILE}: no step record, but the cell's status is 'complete'")
    except FileNotFoundError as error:
        return CellView(directory, CellState.CORRUPT, attempt, f"{error.filename}: missing, but the cell is complete")
    except StoreError as error:
        return CellView(directory, CellState.CORRUPT, attempt, str(error))
    warnings = status.get("warnings")
    kept = tuple(str(w) for w in warnings) if isinstance(warnings, list) else ()
    return CellView(directory, CellState.COMPLETE, attempt, warnings=kept,
                    contents=CellContents(identity, config, summary_with_nan(summary), records) if contents else None)
