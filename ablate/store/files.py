"""Atomic files: how every whole file of the run store (and of the analysis) is written and read.

A whole file is written to a temporary file beside it, fsynced and renamed over the target, so a
crash leaves either the old or the new version, never half of one; the temporary file is removed
when the write fails (a full disk). A writer killed mid-write (kill -9, the OOM killer) leaves
its temporary file behind: :func:`remove_dead_writers_files` clears them once no writer can be
alive.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class StoreError(RuntimeError):
    """A run store file that cannot be read: names the file and what is wrong with it."""


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def atomic_write(path: Path, write: Any) -> None:
    """``write(tmp)`` then fsync and rename over ``path``; the temporary file never outlives a failure."""
    tmp = _tmp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def json_safe(value: Any) -> Any:
    """NaN and infinities as JSON null, so every file is strict JSON that any tool can read."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def atomic_write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(json_safe(dict(data)), indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise StoreError(f"{path}: corrupt run store file ({error}); expected JSON written by ablate") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: corrupt run store file: expected a JSON object, found {type(data).__name__}")
    return data


def remove_dead_writers_files(directory: Path) -> None:
    """Remove the temporary files of atomic writes that a killed writer left in ``directory``.

    Only the claim's holder writes a cell's files, so once the claim is taken every temporary
    file in the directory belongs to a writer that is gone (kill -9, the OOM killer, a lost node).
    """
    for tmp in directory.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def make_directory(path: Path, what: str) -> None:
    """``mkdir -p``, failing with one :class:`StoreError` that says what stands in the way."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StoreError(f"{path}: a file where {what} should be; move it away, then run again") from None
    except OSError as error:
        raise StoreError(f"{path}: cannot create {what} ({error.strerror}); expected a writable directory") from None
    except UnicodeEncodeError:  # Python's UTF-8 mode off in a locale without the path's letters
        raise StoreError(f"{path}: cannot create {what}: its name is not text in this locale's encoding "
                         f"({sys.getfilesystemencoding()}); run ablate with a UTF-8 locale (LC_ALL=C.UTF-8) or "
                         "Python's UTF-8 mode (PYTHONUTF8=1)") from None


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
