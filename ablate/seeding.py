"""Seeds that are functions of named inputs only, the same in every process and on every run."""

from __future__ import annotations

import hashlib


def keyed_seed(key: str, person: bytes = b"") -> int:
    """A 63-bit seed from ``key``: a stable hash (``hash`` of a string is salted per process)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=person).digest()
    return int.from_bytes(digest, "little") % 2**63
