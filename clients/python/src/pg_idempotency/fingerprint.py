"""The request fingerprint, computed as idempotency.fingerprint() does it.

Each part is fed to SHA-256 as a presence byte (1, or 0 for an absent
part), its length as 8 bytes big-endian (0 when absent) and its bytes; the
method is upper-cased in ASCII only. That is fingerprint.c's encoding, so
the digest equals the database's for the same text (UTF-8) and bytes.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Union

Text = Union[str, bytes]


def fingerprint(method: Text, path: Text, body: Optional[bytes] = None,
                query: Optional[Text] = None) -> bytes:
    """Returns the 32-byte SHA-256 of a request; body or query None means absent."""
    if method is None or path is None:
        raise TypeError("fingerprint() needs a method and a path")
    digest = hashlib.sha256()
    _feed(digest, _as_bytes(method).upper())
    _feed(digest, _as_bytes(path))
    _feed(digest, None if body is None else bytes(body))
    _feed(digest, None if query is None else _as_bytes(query))
    return digest.digest()


def _feed(digest, part: Optional[bytes]) -> None:
    """Feeds one part, or its absence, to the digest."""
    if part is None:
        digest.update(b"\x00" + bytes(8))
    else:
        digest.update(b"\x01" + len(part).to_bytes(8, "big") + part)


def _as_bytes(value: Text) -> bytes:
    """Returns text as UTF-8 (the database's encoding), bytes as they are."""
    return value.encode() if isinstance(value, str) else bytes(value)
