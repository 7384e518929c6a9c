"""Block framing of W&B's transaction log (the ``run-<id>.wandb`` file).

W&B 0.31 ships no Python reader for this file: its writer and reader live in the Go
``wandb-core`` binary (``core/pkg/leveldb/record.go``, ``core/internal/transactionlog``). The
format is LevelDB's log format with a W&B file header:

- The file starts with a 7-byte header: ``b":W&B"``, magic ``0xBEE1`` (uint16 LE), version 0.
  The header sits *inside* block 0, so block boundaries are multiples of 32 KiB from offset 0.
- The file is a sequence of 32 KiB blocks, each packed with chunks; a chunk never crosses a
  block boundary. A chunk is a 7-byte header (CRC32 uint32 LE, payload length uint16 LE,
  type uint8) and its payload. The CRC is IEEE CRC-32 (``zlib.crc32``) over the type byte and
  the payload (version 0 uses ``CRCAlgoIEEE``, not LevelDB's masked CRC-32C).
- A record (one serialised ``wandb_internal_pb2.Record``) is one FULL chunk, or a FIRST chunk,
  any number of MIDDLE chunks and a LAST chunk. When fewer than 7 bytes remain in a block, or
  the next header is all zeros, the rest of the block is zero padding.

This module only splits the file into record payloads; ``offline_reader`` decodes them.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FILE_VERSION = 0

CHUNK_HEADER = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class LogScan:
    """The whole records of a transaction log, and why reading stopped early, if it did.

    ``problem`` is ``None`` when the file was read to its end with no partial record left
    over; otherwise it is a sentence naming the byte offset (a crash leaves a truncated tail,
    which is expected and not an error).
    """

    payloads: list[bytes]
    problem: str | None


def check_header(path: Path, data: bytes) -> None:
    """Raise ``ValueError`` naming ``path`` unless ``data`` starts with a W&B log header."""
    if len(data) < FILE_HEADER.size:
        raise ValueError(
            f"{path}: not a W&B transaction log: {len(data)} bytes, shorter than the "
            f"{FILE_HEADER.size}-byte header {FILE_IDENT!r}"
        )
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if ident != FILE_IDENT or magic != FILE_MAGIC:
        raise ValueError(
            f"{path}: not a W&B transaction log: header {data[: FILE_HEADER.size]!r}, "
            f"expected {FILE_IDENT!r} with magic {FILE_MAGIC:#x}"
        )
    if version != FILE_VERSION:
        raise ValueError(
            f"{path}: W&B transaction log version {version} is not supported, expected "
            f"version {FILE_VERSION} (written by wandb 0.31)"
        )


def scan_log(path: Path) -> LogScan:
    """Split the transaction log at ``path`` into record payloads.

    Never raises on damage after a valid header: a truncated or corrupt tail ends the scan and
    is described in ``LogScan.problem``, because a crashed run must still give back every
    record it wrote whole. Raises ``ValueError`` if the file is not a W&B log at all.
    """
    data = path.read_bytes()
    check_header(path, data)
    payloads: list[bytes] = []
    pending: list[bytes] | None = None  # chunks of a record whose LAST chunk is not read yet
    offset = FILE_HEADER.size
    while offset < len(data):
        block_end = (offset // BLOCK_SIZE + 1) * BLOCK_SIZE
        if block_end - offset < CHUNK_HEADER.size:
            offset = block_end  # trailer too short for a header: zero padding
            continue
        if offset + CHUNK_HEADER.size > len(data):
            return LogScan(payloads, f"{path}: truncated chunk header at byte {offset}")
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, offset)
        if checksum == 0 and length == 0 and kind == 0:
            offset = block_end  # zeroed rest of a block
            continue
        start = offset + CHUNK_HEADER.size
        end = start + length
        if end > block_end:
            return LogScan(payloads, f"{path}: chunk at byte {offset} overflows its 32 KiB block")
        if end > len(data):
            return LogScan(payloads, f"{path}: truncated chunk at byte {offset}")
        payload = data[start:end]
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != checksum:
            return LogScan(payloads, f"{path}: checksum mismatch in chunk at byte {offset}")
        if kind == FULL and pending is None:
            payloads.append(payload)
        elif kind == FIRST and pending is None:
            pending = [payload]
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending.append(payload)
            if kind == LAST:
                payloads.append(b"".join(pending))
                pending = None
        else:
            return LogScan(
                payloads, f"{path}: chunk type {kind} at byte {offset} breaks the record sequence"
            )
        offset = end
    if pending is not None:
        return LogScan(payloads, f"{path}: file ends inside a record split across blocks")
    return LogScan(payloads, None)
