"""Block keys and namespaces: the fixed-size identities every tier stores blocks under.

A key is the 32-byte digest of a block's token prefix (vLLM's ``request.block_hashes`` or a digest of
them); a namespace is the 16-byte digest of everything that makes KV bytes incompatible (model, dtype,
layout, block size, TP rank...). Both are fixed-size so a tier can lay them out without parsing and a
wrong size is caught at the edge, with the offending index named.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import NewType, overload

import numpy as np

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.native import native

KEY_BYTES = 32
NAMESPACE_BYTES = 16
_new_bytes = bytes.__new__

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


_KEYS_IN_C = native is not None and sys.version_info < (3, 14)
"""Whether :func:`make_keys` makes packed keys in the compiled helper: it writes a ``bytes`` object's
fields the way CPython 3.11-3.13 lays them out, and refuses on a later Python (the Python path then)."""


def make_keys(namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
    """Validate a batch of digests under one namespace, naming the first bad index."""
    ns = check_namespace(namespace)
    if _KEYS_IN_C and isinstance(digests, PackedDigests):  # whole digests by construction
        # one object a key, made in C (4,096 keys: ~0.8 ms the Python way, every Dump and Load)
        return native.block_keys(BlockKey, ns, digests.packed)
    check_digests(digests)
    # ``bytes.__new__(BlockKey, ns + digest)`` per key through C-level maps: what ``BlockKey(ns, d)``
    # builds, without its Python ``__new__`` frame (256 keys: 108 -> 32 µs, paid by every Dump/Load).
    return list(map(_new_bytes, repeat(BlockKey), map(ns.__add__, digests)))


def unpack_digests(packed: bytes) -> list[bytes]:
    """Split concatenated 32-byte keys (the Lookup RPC's ``packed_keys``)."""
    return list(PackedDigests(packed))


class PackedDigests(Sequence[bytes]):
    """The Lookup RPC's ``packed_keys`` as a sequence of 32-byte digests, split only when asked.

    The hot path (every key found in a local index) never splits them: :meth:`scoped` builds the
    48-byte ``namespace + digest`` index keys in one numpy pass, a third of the cost of slicing
    2,048 digests and concatenating each with the namespace in Python. Any other reader (shared
    tiers asked about misses, wrappers, events) sees an ordinary sequence. The numpy ``void``
    dtype keeps every byte (``S`` would strip trailing zero bytes from a key).
    """

    __slots__ = ("_split", "packed")

    def __init__(self, packed: bytes) -> None:
        if len(packed) % KEY_BYTES:
            raise InvalidArgument(f"packed_keys is {len(packed)} bytes, not a multiple of {KEY_BYTES}")
        self.packed = bytes(packed)
        self._split: list[bytes] | None = None

    def _digests(self) -> list[bytes]:
        if self._split is None:
            self._split = np.frombuffer(self.packed, dtype=f"V{KEY_BYTES}").tolist()
        return self._split

    def __len__(self) -> int:
        return len(self.packed) // KEY_BYTES

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        return self._digests()[index]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._digests())

    def scoped(self, namespace: bytes) -> list[bytes]:
        """``namespace + digest`` for every digest, as plain bytes (what a block index is keyed by)."""
        n = len(self)
        rows = np.empty((n, NAMESPACE_BYTES + KEY_BYTES), dtype=np.uint8)
        rows[:, :NAMESPACE_BYTES] = np.frombuffer(namespace, dtype=np.uint8)
        rows[:, NAMESPACE_BYTES:] = np.frombuffer(self.packed, dtype=np.uint8).reshape(n, KEY_BYTES)
        return rows.view(f"V{NAMESPACE_BYTES + KEY_BYTES}").ravel().tolist()


def check_digests(digests: Sequence[bytes]) -> None:
    """Every digest is KEY_BYTES long; on error, name the first bad index."""
    if set(map(len, digests)) - {KEY_BYTES}:  # C-level scan; find the index only on error
        for i, d in enumerate(digests):
            check_digest(d, i)
