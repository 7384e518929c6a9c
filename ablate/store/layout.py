"""The run store's layout: where a sweep and a cell live, and the files a cell holds.

``<store_dir>/<sweep>/<cell name>-<id[:8]>/`` holds ``cell.json`` (identity),
``config.yaml`` (resolved config), ``status.json`` (running / complete / failed / interrupted,
with error and traceback), ``records.jsonl`` (one line per step, appended and flushed as the
cell runs), ``records.parquet`` (the same records, written when the cell ends),
``summary.json``, ``claim.json`` while a worker holds the cell, and ``wandb/`` (its W&B run).
Entries of a sweep directory whose name starts with ``_`` (Hydra's ``_hydra``) are not cells.
The step log is append-only: a crash can at most cut its last line, which readers skip.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from ablate.config import check_sweep_name
from ablate.store.files import StoreError, read_json

if TYPE_CHECKING:
    import pyarrow as pa

CELL_FILE, CONFIG_FILE, STATUS_FILE = "cell.json", "config.yaml", "status.json"
RECORDS_LOG, RECORDS_FILE, SUMMARY_FILE = "records.jsonl", "records.parquet", "summary.json"
CLAIM_FILE, WANDB_DIR = "claim.json", "wandb"
#: What a new attempt of a cell replaces: the previous attempt's results and its W&B run.
ATTEMPT_FILES = (RECORDS_FILE, RECORDS_LOG, SUMMARY_FILE)
#: libyaml's loader where PyYAML was built with it (about 10x faster on a sweep of many cells).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CellIdentity:
    """The fields of ``cell.json``: which cell a directory holds. The runner writes it, every reader reads it here."""

    cell_id: str
    #: The human name (``fisher-b0.25-s3``); the directory is ``<name>-<cell_id[:8]>``.
    name: str
    backend: str
    policy: str
    budget: float
    seed: int
    sweep: str | None = None
    schema_version: str | None = None
    #: The Optuna trial number of a study's cell.
    trial: int | None = None
    #: The policy's non-default settings, ``tau=1.0`` ("" for defaults): with the policy, the arm.
    variant: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    #: The cell's one W&B run id, kept across attempts.
    wandb_run_id: str | None = None
    #: The seed scheme its random streams came from (:data:`ablate.seeding.STREAMS_VERSION`); None:
    #: written before the field existed, the first scheme. Cells of two schemes share no data.
    streams: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], path: Path) -> "CellIdentity":
        """Check every field's type and range; a wrong one is a :class:`StoreError` naming it."""
        checks: dict[str, tuple[Any, str]] = {
            "cell_id": (lambda v: isinstance(v, str) and len(v) >= 8, "a hex identity of at least 8 characters"),
            "name": (lambda v: isinstance(v, str) and bool(v), "a cell name"),
            "backend": (lambda v: isinstance(v, str) and bool(v), "a backend name"),
            "policy": (lambda v: isinstance(v, str) and bool(v), "a policy name"),
            "budget": (lambda v: (_is_int(v) or isinstance(v, float)) and 0 <= v <= 1, "a number in [0, 1]"),
            "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
            "sweep": (lambda v: v is None or isinstance(v, str), "a sweep name"),
            "schema_version": (lambda v: v is None or isinstance(v, str), "a version string"),
            "trial": (lambda v: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
            "variant": (lambda v: isinstance(v, str), "a string"),
            "settings": (lambda v: isinstance(v, dict), "a mapping of policy settings"),
            "wandb_run_id": (lambda v: v is None or isinstance(v, str), "null or a W&B run id"),
            "streams": (lambda v: v is None or (_is_int(v) and v >= 1), "null or a seed-scheme version >= 1"),
        }
        values: dict[str, Any] = {}
        for spec in fields(cls):
            if spec.name not in data:
                if spec.default is not MISSING or spec.default_factory is not MISSING:
                    continue  # written by an older ablate, or not this kind of cell (trial)
                raise StoreError(f"{path}: corrupt cell identity: no {spec.name}; expected {checks[spec.name][1]}")
            value = data[spec.name]
            ok, expected = checks[spec.name]
            if not ok(value):
                raise StoreError(f"{path}: corrupt cell identity: {spec.name}={value!r}; expected {expected}")
            values[spec.name] = float(value) if spec.name == "budget" else value
        return cls(**values)


def read_identity(cell_dir: Path) -> CellIdentity:
    """A cell's ``cell.json``, checked field by field and against its directory's name."""
    path = cell_dir / CELL_FILE
    identity = CellIdentity.from_json(read_json(path), path)
    if cell_dir.name != f"{identity.name}-{identity.cell_id[:8]}":
        raise StoreError(f"{path}: corrupt cell identity: it names the cell {identity.name}-{identity.cell_id[:8]}, "
                         f"not the directory {cell_dir.name} it is in")
    return identity


def cell_directories(sweep_path: Path) -> list[Path]:
    """The cells of a sweep directory: each entry with a ``cell.json`` (written when a cell is claimed)."""
    return sorted(p.parent for p in sweep_path.glob(f"*/{CELL_FILE}") if not p.parent.name.startswith("_"))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def store_root(store_dir: str | os.PathLike[str]) -> Path:
    """The store root as an absolute path: the one place ``store_dir`` is resolved.

    Relative to the directory the command started in, so that every worker of a sweep (Ray, SLURM,
    joblib, each with its own working directory) writes to the same store.
    """
    return Path(store_dir).expanduser().absolute()


def sweep_directory(store_dir: str | os.PathLike[str], sweep: str) -> Path:
    """``<store root>/<sweep>``, the sweep name checked to be one directory of the store."""
    return store_root(store_dir) / check_sweep_name(sweep)


def read_summary(cell_dir: Path) -> dict[str, Any]:
    """A cell's summary, with the nulls that stand for NaN turned back into NaN."""
    return summary_with_nan(read_json(cell_dir / SUMMARY_FILE))


def summary_with_nan(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary.json`` as read, with the nulls that stand for NaN turned back into NaN."""
    return {key: math.nan if value is None else value for key, value in summary.items()}


def records_frame(rows: list[Mapping[str, Any]]) -> pd.DataFrame:
    """Step records as a frame; every column but ``step`` is float (JSON nulls become NaN)."""
    frame = pd.DataFrame(rows)
    return frame.astype({column: "float64" for column in frame.columns if column != "step"})


def read_records(cell_dir: Path) -> pd.DataFrame:
    """A cell's per-step records: the Parquet file when the cell ended, else the step log."""
    if (cell_dir / RECORDS_FILE).exists():
        return read_records_table(cell_dir).to_pandas()
    rows = []
    log_file = cell_dir / RECORDS_LOG
    if log_file.exists():
        lines = log_file.read_text().splitlines()
        for number, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if number != len(lines) - 1:  # only a cut last line is expected after a crash
                    raise StoreError(f"{log_file}:{number + 1}: corrupt step record; expected one JSON object per line") from None
    return records_frame(rows)


def read_records_table(cell_dir: Path) -> "pa.Table":
    """A cell's Parquet records as an Arrow table: the columnar form a reader of many cells concatenates."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One read of the bytes: Arrow's own file opening costs more than these small files.
    return _parquet(cell_dir / RECORDS_FILE,
                    lambda path: pq.ParquetFile(pa.BufferReader(path.read_bytes())).read(use_threads=False))


def check_parquet(path: Path) -> int:
    """The rows of the Parquet file at ``path``, from its footer (cheap: no data read); StoreError
    unless the footer reads."""
    import pyarrow.parquet as pq

    return int(_parquet(path, pq.read_metadata).num_rows)


def read_config(cell_dir: Path) -> dict[str, Any]:
    """A cell's resolved config (``config.yaml``) as plain data; StoreError naming it when it does not read."""
    path = cell_dir / CONFIG_FILE
    try:
        tree = yaml.load(path.read_bytes(), Loader=_YAML_LOADER)
    except FileNotFoundError:
        raise
    except (OSError, yaml.YAMLError) as error:
        raise StoreError(f"{path}: unreadable config ({error}); expected the YAML written by ablate") from None
    if not isinstance(tree, dict):
        raise StoreError(f"{path}: corrupt config: expected a YAML mapping, found {type(tree).__name__}")
    return tree


def _parquet(path: Path, read: Callable[[Path], Any]) -> Any:
    """``read(path)``, a missing or damaged records file raised as the :class:`StoreError` naming it."""
    try:
        return read(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing, but the cell's status is 'complete'") from None
    except Exception as error:  # pyarrow raises several unrelated types for a damaged file
        raise StoreError(f"{path}: corrupt records file ({error}); expected Parquet written by ablate") from None
