"""The one seed scheme: every random stream of a cell is derived from the cell's seed and what it is for.

A *stream* is named by a purpose (``"selection"``, ``"probe"``, ``"prompts"``) and keys that tell
its instances apart (a step, a probe's id, a sequence's content key). Its seed is a stable hash of
the cell seed, the purpose and the keys, never ``hash()`` (salted per process) and never arithmetic
on the seed (``seed * 7919 + k`` makes seed 0's stream 1 and seed 1's stream 0 neighbours): two
streams share numbers only if they share every input, and adding a stream changes no other.
Every process that derives a stream (a sweep worker, a verl actor on any rank) derives the same.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Which scheme a cell's streams come from, recorded with the cell: cells of one seed share their
#: data only when they share the scheme, so the analysis never pairs cells of two schemes.
STREAMS_VERSION = 2

StreamKey = int | str | bytes


def stream_seed(seed: int, purpose: str, *keys: StreamKey) -> int:
    """The 63-bit seed of stream ``purpose`` with ``keys`` for a cell of seed ``seed``."""
    digest = hashlib.blake2b(digest_size=8, person=b"ablate-streams")
    for part in (int(seed), purpose, *keys):
        if isinstance(part, bytes):
            tag, data = b"b", part
        elif isinstance(part, str):
            tag, data = b"s", part.encode()
        else:  # an int (bool is refused: a flag is no instance of a stream)
            if isinstance(part, bool) or not isinstance(part, int):
                raise TypeError(f"stream key {part!r}: expected an int, a str or bytes")
            tag, data = b"i", part.to_bytes(16, "little", signed=True)
        digest.update(tag + len(data).to_bytes(4, "little") + data)  # length-prefixed: no two key lists collide
    return int.from_bytes(digest.digest(), "little") % 2**63


def stream(seed: int, purpose: str, *keys: StreamKey, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`stream_seed`."""
    import torch

    return torch.Generator(device=device).manual_seed(stream_seed(seed, purpose, *keys))
