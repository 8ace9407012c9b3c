"""Block keys and namespaces: the fixed-size identities every tier stores blocks under.

A key is the 32-byte digest of a block's token prefix (vLLM's ``request.block_hashes`` or a digest of
them); a namespace is the 16-byte digest of everything that makes KV bytes incompatible (model, dtype,
layout, block size, TP rank...). Both are fixed-size so a tier can lay them out without parsing and a
wrong size is caught at the edge, with the offending index named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

from ucm_protocol.errors import InvalidArgument

KEY_BYTES = 32
NAMESPACE_BYTES = 16

Namespace = NewType("Namespace", bytes)
Digest = NewType("Digest", bytes)


class BlockKey(bytes):
    """One block's identity: ``namespace`` (16 bytes) + ``digest`` (32 bytes), as one 48-byte string.

    A ``bytes`` subclass, so hashing and comparison run in C and a plain ``namespace + digest``
    string finds the same dict entry: the Lookup hot path indexes with plain bytes and never builds
    thousands of key objects.
    """

    __slots__ = ()

    def __new__(cls, namespace: bytes, digest: bytes) -> BlockKey:
        return super().__new__(cls, bytes(namespace) + bytes(digest))

    @property
    def namespace(self) -> Namespace:
        return Namespace(bytes(self[:NAMESPACE_BYTES]))

    @property
    def digest(self) -> Digest:
        return Digest(bytes(self[NAMESPACE_BYTES:]))

    def hex(self) -> str:  # type: ignore[override]
        """``<namespace hex>/<digest hex>``, the form ``ucm-admin`` prints and accepts."""
        return f"{self.namespace.hex()}/{self.digest.hex()}"

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()})"

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        """Parse the ``<namespace hex>/<digest hex>`` form; errors name what is wrong."""
        ns_hex, sep, key_hex = text.partition("/")
        if not sep:
            raise InvalidArgument(f"block key {text!r}: expected '<namespace hex>/<key hex>'")
        try:
            ns, digest = bytes.fromhex(ns_hex), bytes.fromhex(key_hex)
        except ValueError as exc:
            raise InvalidArgument(f"block key {text!r}: not hexadecimal ({exc})") from exc
        return cls(check_namespace(ns), check_digest(digest))


def check_namespace(value: bytes) -> Namespace:
    if len(value) != NAMESPACE_BYTES:
        raise InvalidArgument(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(value)}")
    return Namespace(bytes(value))


def check_digest(value: bytes, index: int | None = None) -> Digest:
    if len(value) != KEY_BYTES:
        where = f"keys[{index}]" if index is not None else "key"
        raise InvalidArgument(f"{where} must be {KEY_BYTES} bytes, got {len(value)}")
    return Digest(bytes(value))


def make_keys(namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
    """Validate a batch of digests under one namespace, naming the first bad index."""
    ns = check_namespace(namespace)
    check_digests(digests)
    return [BlockKey(ns, d) for d in digests]


def unpack_digests(packed: bytes) -> list[bytes]:
    """Split concatenated 32-byte keys (the Lookup RPC's ``packed_keys``)."""
    if len(packed) % KEY_BYTES:
        raise InvalidArgument(f"packed_keys is {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def check_digests(digests: Sequence[bytes]) -> None:
    """Every digest is KEY_BYTES long; on error, name the first bad index."""
    if set(map(len, digests)) - {KEY_BYTES}:  # C-level scan; find the index only on error
        for i, d in enumerate(digests):
            check_digest(d, i)
