"""Where ``load_runs`` reads a sweep from, and the one form every source hands back.

A source (:mod:`.store`, :mod:`.wandb_offline`, :mod:`.wandb_api`) reads the complete cells of a
sweep and returns a :class:`Loaded`: per cell its identity and flattened config (a
:class:`LoadedCell`), and the step records of every cell in **one** frame, one cell's rows after
another's, with the cell's position in the column :data:`CELL`. The frames the analysis builds
(one row per cell, or per cell and step) come from that one frame by column operations, so a
sweep costs what its files cost, not a pandas frame per cell.

A cell may also carry its outcomes as the run store's ``summary.json`` holds them (the runner
wrote them with :func:`ablate.outcomes.cell_outcomes`, from the same records); a cell
without them has them computed from its records.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ablate.arms import arm_name
from ablate.store import CellState

#: The column of :attr:`Loaded.records` that holds each row's cell (its index in :attr:`Loaded.cells`).
CELL = "__cell__"
#: Keys the cell runner adds to the flattened W&B config beside the resolved config's own.
WANDB_IDENTITY_KEYS: frozenset[str] = frozenset(
    {"policy", "budget", "seed", "backend", "schema_version", "streams", "cell_id", "sweep", "variant", "trial"}
)
#: W&B runs of this job type hold analysis results, not cells (see ``dashboard.log_summary_table``).
SUMMARY_JOB_TYPE = "summary"
#: How the analysis counts a store cell that is not complete, by its :class:`~ablate.store.CellState`:
#: a cell started and never ended (killed, crashed, or claimed and killed before it started) is
#: "unfinished"; "running" is a cell a live worker holds now.
EXCLUDED_AS = {CellState.FAILED: "failed", CellState.INTERRUPTED: "interrupted", CellState.RUNNING: "running",
               CellState.UNFINISHED: "unfinished", CellState.NEW: "unfinished", CellState.CORRUPT: "corrupt"}
EXCLUDED_KINDS = ("failed", "interrupted", "running", "unfinished", "corrupt")


class CorruptCellError(RuntimeError):
    """A run-store file that exists but cannot be read (the message names the file)."""


def no_exclusions() -> dict[str, int]:
    """``df.attrs["excluded"]`` before counting: every kind of cell left out, at 0."""
    return {kind: 0 for kind in EXCLUDED_KINDS}


@dataclass
class LoadedCell:
    """One complete cell: its identity (``meta``), its resolved config flattened with dots, and,
    while a source reads it, its own records (a source gathers them into :attr:`Loaded.records`)."""

    meta: dict[str, Any]
    config: dict[str, Any]
    records: pd.DataFrame | None = None
    #: The outcomes of the cell's summary, when they can stand for a recomputation; else None.
    outcomes: dict[str, float] | None = None


@dataclass
class Loaded:
    """The complete cells a source read, their records in one frame, and what it left out."""

    cells: list[LoadedCell]
    #: Every cell's step records, cell after cell, with the cell's index in :data:`CELL`.
    records: pd.DataFrame
    excluded: dict[str, int] = field(default_factory=no_exclusions)
    #: The error of each corrupt cell that was excluded, naming its file.
    corrupt: list[str] = field(default_factory=list)

    @classmethod
    def from_cells(cls, cells: list[LoadedCell], excluded: dict[str, int], corrupt: list[str]) -> "Loaded":
        """Gather the records each cell carries into one frame (the W&B sources, which read run by run)."""
        frames = [cell.records.assign(**{CELL: index}) for index, cell in enumerate(cells)
                  if cell.records is not None and len(cell.records)]
        records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({CELL: np.zeros(0, dtype=np.int64)})
        for cell in cells:
            cell.records = None
        return cls(cells, records, excluded, corrupt)

    def subset(self, keep: Sequence[int]) -> "Loaded":
        """The cells at the ascending positions ``keep``, with their records and cell indices renumbered."""
        if len(keep) == len(self.cells):
            return self
        renumber = np.full(len(self.cells), -1, dtype=np.int64)
        renumber[np.asarray(keep, dtype=np.int64)] = np.arange(len(keep))
        new_index = renumber[self.records[CELL].to_numpy()]
        kept = new_index >= 0
        records = self.records.loc[kept].reset_index(drop=True)
        records[CELL] = new_index[kept]
        return Loaded([self.cells[i] for i in keep], records, self.excluded, self.corrupt)


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{"backend.steps": 100, ...}``; lists stay values and empty mappings leave no key."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = sys.intern(f"{prefix}{key}")  # one string per key for all the cells of a sweep
        if isinstance(value, dict):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def with_arm(meta: dict[str, Any]) -> dict[str, Any]:
    """``policy`` becomes the arm: the policy name plus its non-default settings, if any.

    Cells of one policy with other settings (``fisher[tau=1.0]``, ``random[per_layer=True]``) are
    different arms, so tables and effects keep them apart; ``policy_name`` keeps the bare name.
    """
    variant = meta.get("variant") or ""
    name = meta.get("policy")
    return {**meta, "policy_name": name, "variant": variant, "policy": arm_name(name, variant)}


def version(value: Any) -> str | None:
    return None if value is None else str(value)


def wandb_cell(config: dict[str, Any], records: pd.DataFrame, *, group: str, name: str, run_id: str,
               path: str) -> LoadedCell:
    """A cell from the flattened config the cell runner gives W&B (offline or online)."""
    meta = with_arm({
        "sweep": group,
        "cell_id": config.get("cell_id", run_id),
        "name": name,
        "backend": config.get("backend"),
        "policy": config.get("policy"),
        "budget": config.get("budget"),
        "seed": config.get("seed"),
        "variant": config.get("variant", ""),
        "schema_version": version(config.get("schema_version")),
        "streams": int(config.get("streams") or 1),
        "status": "complete",
        "path": path,
    })
    flat = flatten_config({k: v for k, v in config.items() if k not in WANDB_IDENTITY_KEYS and not k.startswith("_")})
    return LoadedCell(meta, flat, records)
