"""Repair an Optuna journal file that a crash cut in the middle of a record.

Optuna's ``JournalFileBackend`` appends one JSON record per line. A driver killed during an append
(SIGKILL, a full disk, a power cut) leaves a last line without its end of line. Optuna's reader
skips such a line, but its next append lands on the same line, and from then on every read of the
journal fails with ``JSONDecodeError``: the study can never be opened again. So before the journal
is opened, a cut last line is dropped, and a line that an earlier append glued onto a cut record is
split again, keeping the whole record that follows the cut. A crash costs the one record it cut.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from optuna.storages.journal import JournalFileSymlinkLock

from ablate.store import atomic_write

log = logging.getLogger(__name__)

class JournalDamaged(ValueError):
    """A journal line that is neither a record nor a record glued onto a cut one."""


#: Every journal record is a JSON object whose first key is its operation code.
RECORD_START = b'{"op_code":'


def repair_journal(path: Path) -> list[str]:
    """Drop the record a crash cut from the journal at ``path``; return one sentence per repair.

    Takes the journal's own lock, so no sweeper appends while the file is rewritten. Raises
    :class:`JournalDamaged` naming the file and the line when a line is damaged beyond a cut record.
    """
    if not path.exists() or path.stat().st_size == 0:
        return []
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # empty when the file ends with an end of line, as a whole journal does
        repaired: list[bytes] = []
        problems: list[str] = []
        for number, line in enumerate(lines, start=1):
            kept = _whole_record(line)
            if kept is None:
                raise JournalDamaged(
                    f"{path}: line {number} is not an Optuna journal record ({line[:60]!r}...); "
                    "expected one JSON object per line"
                )
            if len(kept) != len(line):
                problems.append(f"line {number} began with {len(line) - len(kept)} bytes of a record cut by a crash: "
                                "dropped that record, the study goes on without it")
            repaired.append(kept)
        if _is_object(tail):  # whole but for its end of line, which Optuna's reader requires
            repaired.append(tail)
            problems.append("its last record had lost its end of line: added it")
        elif tail:
            problems.append(f"its last record was cut by a crash ({len(tail)} bytes without an end of line): "
                            "dropped that record, the study goes on without it")
        if not problems:
            return []
        text = b"".join(line + b"\n" for line in repaired)
        atomic_write(path, lambda tmp: tmp.write_bytes(text))
    finally:
        lock.release()
    sentences = [f"{path}: {problem}" for problem in problems]
    for sentence in sentences:
        log.warning(sentence)
    return sentences


def _whole_record(line: bytes) -> bytes | None:
    """``line`` if it is one JSON object, else the whole record at its end (the cut one before it
    dropped), else ``None``."""
    if _is_object(line):
        return line
    start = line.find(RECORD_START, 1)
    while start != -1:
        if _is_object(line[start:]):
            return line[start:]
        start = line.find(RECORD_START, start + 1)
    return None


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
