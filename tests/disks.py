"""Small real disks for the tests of a full disk: a tmpfs of a given size, mounted under the test's folder."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(folder: Path, size: str, *, instead: str = "") -> Iterator[Path]:
    """A tmpfs of ``size`` (``"96k"``, ``"1m"``) at ``folder``, lazily unmounted at the end.

    Where no tmpfs can be mounted the test is skipped, saying why and, with ``instead``, what
    covers the same ground there.
    """
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})" + (f"; {instead}" if instead else ""))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
