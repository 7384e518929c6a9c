"""Whether a W&B run's transaction log holds its exit record, read in this process.

The tracker asks this after every cell's ``finish()`` until the answer is yes
(:mod:`ablate.tracking.wandb_run`). Asking wandb's own reader (``wandb-core leet inspect``, see
:mod:`ablate.tracking.offline_reader`) starts a process each time: about 19 ms of CPU per cell,
more than W&B's own work for a one-step run. This reads only the log's framing, which is
LevelDB's log format under a 7-byte header of wandb's (``:W&B``, magic ``0xBEE1``, version 0):
32 KiB blocks of chunks, each chunk a 7-byte header (CRC-32 of the type byte then the data,
length, type: whole, first, middle or last) and its data; a block's tail shorter than a header is
padding. Each whole record is a ``wandb_internal_pb2.Record``, decoded by wandb's own protobuf
classes. A log with another header is not read here (:func:`exit_record_found` says so), and the
caller asks wandb's reader instead.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

#: The header wandb-core writes first: ident, magic and the format version this reader knows.
HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = struct.Struct("<IHB")
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4
#: Each chunk's CRC-32 starts from the CRC-32 of its type byte.
_SEEDS = {kind: zlib.crc32(bytes([kind])) for kind in (WHOLE, FIRST, MIDDLE, LAST)}


def exit_record_found(log_file: Path) -> bool | None:
    """True once the log holds the run's exit record; False while it does not (still being written,
    or cut short); None for a file that does not start with the header this reader knows."""
    data = log_file.read_bytes()
    if not data.startswith(HEADER):
        return None if len(data) >= len(HEADER) or not HEADER.startswith(data) else False
    return any(_is_exit(record) for record in _records(data))


def _records(data: bytes) -> Iterator[bytes]:
    """Each whole record of the log, in order, up to the first chunk that is cut short or damaged."""
    at, pieces = len(HEADER), []
    while True:
        left_in_block = BLOCK - at % BLOCK
        if left_in_block < CHUNK_HEADER.size:
            at += left_in_block  # padding
        if at + CHUNK_HEADER.size > len(data):
            return
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, at)
        body = data[at + CHUNK_HEADER.size:at + CHUNK_HEADER.size + length]
        if kind not in _SEEDS or len(body) < length or zlib.crc32(body, _SEEDS[kind]) != checksum:
            return
        at += CHUNK_HEADER.size + length
        if kind == WHOLE:
            yield body
        elif kind == FIRST:
            pieces = [body]
        elif pieces:
            pieces.append(body)
            if kind == LAST:
                yield b"".join(pieces)
                pieces = []


def _is_exit(record: bytes) -> bool:
    return wandb_internal_pb2.Record.FromString(record).WhichOneof("record_type") == "exit"
