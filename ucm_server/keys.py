"""Moved to :mod:`ucm_protocol.keys`; this path re-exports the same names and is kept until 0.2."""

from __future__ import annotations

from ucm_protocol.keys import (
    KEY_BYTES,
    NAMESPACE_BYTES,
    BlockKey,
    Digest,
    Namespace,
    check_digest,
    check_digests,
    check_namespace,
    make_keys,
    unpack_digests,
)

__all__ = [
    "KEY_BYTES",
    "NAMESPACE_BYTES",
    "BlockKey",
    "Digest",
    "Namespace",
    "check_digest",
    "check_digests",
    "check_namespace",
    "make_keys",
    "unpack_digests",
]
