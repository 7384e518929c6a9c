"""Writing an analysis output: one error naming the file, and what a killed writer left removed.

Every output of the analysis is written atomically (:func:`ablate.store.atomic_write`: a temporary
file, then a rename), so an analysis stopped midway leaves each file whole, old or new. Around each
write, :func:`naming` turns an ``OSError`` (a full disk, a folder under a file) into one
:class:`OutputError` that names the file and the reason. A writer killed outright (SIGKILL, a
SIGTERM during a plot) leaves ``.<name>.<pid>.<thread>.tmp``; :func:`remove_dead_writers_files`
removes those of processes that are gone, at the start of the next run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ablate.store import StoreError


class OutputError(RuntimeError):
    """An output of the analysis could not be written: the message names the file and the reason."""


@contextmanager
def naming(target: Path) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``target`` into one :class:`OutputError` naming the file.

    The error's own file name is used when it has one (a temporary file is named by the file it
    stands for); else ``target``.
    """
    try:
        yield
    except StoreError as error:
        raise OutputError(str(error)) from None
    except OSError as error:
        path = _final_path(error.filename) if error.filename else target
        reason = error.strerror or str(error) or type(error).__name__
        raise OutputError(f"{path}: cannot write ({reason}); nothing half-written is left there") from None


def _final_path(filename: Any) -> Path:
    """``.x.png.<pid>.<thread>.tmp`` -> ``x.png`` (the file an atomic write stands for)."""
    path = Path(os.fsdecode(filename))
    parts = path.name.split(".")
    if path.name.startswith(".") and path.name.endswith(".tmp") and len(parts) >= 5:
        return path.with_name(".".join(parts[1:-3]))
    return path


def remove_dead_writers_files(folder: Path) -> list[Path]:
    """Remove the temporary files in ``folder`` whose writer (the pid in their name) is gone.

    An analysis killed mid-write (SIGKILL, SIGTERM during a plot) leaves
    ``.<name>.<pid>.<thread>.tmp``; one of a live process is another analysis writing now, and
    stays.
    """
    removed = []
    for tmp in folder.glob(".*.tmp"):
        parts = tmp.name.split(".")
        if len(parts) < 5 or not parts[-3].isdigit() or _alive(int(parts[-3])):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def file_part(key: str) -> str:
    """A config key as part of a file name: ``policy.per_layer`` -> ``policy-per_layer``."""
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in key)
