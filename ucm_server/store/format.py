"""The on-media block format every persistent tier uses: a fixed header, then the payload.

Any tier can verify what it returns with nothing but the stored object: the header names the block
(namespace + key, so a file moved or an object overwritten under the wrong name is caught), its payload
length (so a torn write is caught) and an xxh3-64 checksum of the payload (so a flipped byte is caught).
The header has its own CRC so a damaged header is not trusted to describe the payload.

Layout (little endian, 128 bytes so the payload stays aligned)::

    magic "UCMB" | version u16 | flags u16 | header_len u32 | namespace 16s | key 32s |
    payload_len u64 | checksum u64 | created_ns u64 | header_crc u32 | zero padding
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass

import xxhash

from ucm_server.keys import KEY_BYTES, NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.base import IoVec

MAGIC = b"UCMB"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_FIELDS = struct.Struct(f"<4sHHI{NAMESPACE_BYTES}s{KEY_BYTES}sQQQ")
_CRC = struct.Struct("<I")


class CorruptBlock(Exception):
    """A stored object that is not a valid block; the message says which check failed."""


class UnsupportedFormat(CorruptBlock):
    """A valid-looking block of another format version (a newer daemon wrote it): not ours to read,
    and not ours to quarantine either — on a shared tier another node may be serving it."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    key: BlockKey
    payload_len: int
    checksum: int
    created_ns: int
    flags: int = 0


def payload_checksum(iov: IoVec) -> int:
    """xxh3-64 over the concatenated segments (no copy: the hasher takes each view)."""
    h = xxhash.xxh3_64()
    for seg in iov:
        h.update(seg)
    return h.intdigest()


def encode_header(key: BlockKey, payload_len: int, checksum: int, created_ns: int | None = None) -> bytes:
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        HEADER_SIZE,
        key.namespace,
        key.digest,
        payload_len,
        checksum,
        created_ns if created_ns is not None else time.time_ns(),
    )
    crc = _CRC.pack(zlib.crc32(fields))
    return (fields + crc).ljust(HEADER_SIZE, b"\0")


def decode_header(raw: bytes | memoryview, expect: BlockKey | None = None) -> BlockHeader:
    """Parse and check a header; ``expect`` also checks it names the block we asked for."""
    if len(raw) < HEADER_SIZE:
        raise CorruptBlock(f"header truncated: {len(raw)} of {HEADER_SIZE} bytes")
    fields = bytes(raw[: _FIELDS.size])
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    magic, version, flags, header_len, ns, digest, payload_len, checksum, created_ns = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:  # checked before the CRC: another version may lay its header out anew
        raise UnsupportedFormat(f"block format version {version}; this daemon reads version {FORMAT_VERSION}")
    if zlib.crc32(fields) != crc:
        raise CorruptBlock("header checksum mismatch")
    if header_len != HEADER_SIZE:
        raise CorruptBlock(f"header length {header_len}, expected {HEADER_SIZE}")
    key = BlockKey(Namespace(ns), Digest(digest))
    if expect is not None and key != expect:
        raise CorruptBlock(f"header names block {key.hex()}, expected {expect.hex()}")
    return BlockHeader(
        key=key, payload_len=payload_len, checksum=checksum, created_ns=created_ns, flags=flags
    )


def verify_payload(header: BlockHeader, iov: IoVec) -> None:
    """Raise :class:`CorruptBlock` unless ``iov`` is exactly the payload the header describes."""
    got = sum(m.nbytes for m in iov)
    if got != header.payload_len:
        raise CorruptBlock(f"payload is {got} bytes, header says {header.payload_len}")
    if payload_checksum(iov) != header.checksum:
        raise CorruptBlock("payload checksum mismatch")
