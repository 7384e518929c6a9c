"""A folder W&B's service can keep its own logs in, when the user's cache folder cannot hold them.

``wandb-core`` writes its debug log under ``$XDG_CACHE_HOME/wandb/logs`` (else ``~/.cache/...``).
Where that folder cannot be made (a home that is read-only, missing, or a file), it logs to the
console instead, some 18 lines a process, in the middle of the cell's or the sweep's own lines.
While W&B may start its service, :func:`service_cache_home` points ``XDG_CACHE_HOME`` at a
private folder under the temporary directory, for the service only, and the first cell of the
process says so in one line.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "XDG_CACHE_HOME"


@contextmanager
def service_cache_home(notes: list[str]) -> Iterator[None]:
    """Within the block, ``XDG_CACHE_HOME`` names a folder ``wandb-core`` can write its logs in.

    Nothing changes where the user's own cache folder is writable. Otherwise the variable is set
    for the block alone (a service W&B starts in it keeps it), and ``notes`` gets one sentence
    saying why, the first time in the process.
    """
    fallback, why = _fallback()
    if fallback is None:
        yield
        return
    if why not in _said:
        _said.append(why)
        notes.append(why)
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = fallback
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = previous


#: The sentences already said in this process (one, at most).
_said: list[str] = []


@functools.lru_cache(maxsize=1)
def _fallback() -> tuple[str | None, str]:
    """The folder to use instead of the user's cache folder (None: that one is writable), and why."""
    logs = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache") / "wandb" / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        if os.access(logs, os.W_OK):
            return None, ""
        problem = "not writable"
    except OSError as error:
        problem = error.strerror or type(error).__name__
    fallback = Path(tempfile.gettempdir()) / f"ablate-wandb-cache-{os.getuid()}"
    fallback.mkdir(mode=0o700, exist_ok=True)
    return str(fallback), (f"W&B's service cannot keep its logs in {logs} ({problem}): they go to {fallback}; "
                           f"set {CACHE_ENV} or HOME to a writable folder to keep them there")
