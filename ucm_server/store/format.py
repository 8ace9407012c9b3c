"""The on-media block format every persistent tier uses: a fixed header, then the payload.

Any tier can verify what it returns with nothing but the stored object: the header names the block
(namespace + key, so a file moved or an object overwritten under the wrong name is caught), its payload
length (so a torn write is caught) and an xxh3-64 checksum of the payload (so a flipped byte is caught).
The header has its own CRC so a damaged header is not trusted to describe the payload.

Layout (little endian)::

    magic "UCMB" | version u16 | flags u16 | header_len u32 | namespace 16s | key 32s |
    payload_len u64 | checksum u64 | created_ns u64 | header_crc u32 | zero padding to header_len

``header_len`` is where the payload starts: 128 bytes (:data:`HEADER_SIZE`, every object tier), or
4 KiB (:data:`ALIGNED_HEADER_SIZE`) for files the Posix tier writes with ``O_DIRECT``, which needs
every write to start and end on a 4 KiB boundary. The padding must be zero, so no byte of a stored
block goes unchecked: payload by its checksum, header by its CRC, padding by being zero.

Versions: 1 had only the 128-byte header. 2 allows the 4 KiB one. A 128-byte header is still written
as version 1, so the previous release reads those blocks; it skips version-2 files (an unknown version
is skipped, never quarantined), which therefore survive a downgrade and serve again after re-upgrade.
3 has the fields of 2 and says where the file lives: the Posix tier's two-level directory layout
(:data:`FLAT_LAYOUT_VERSION`, see :mod:`ucm_server.store.posix`). A release that knows only 1 and 2
skips such a file (never quarantines it, though it is not at the path that release expects), so a
downgrade loses no block; object tiers keep writing 1.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np
import xxhash

from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.store.copying import IoVec

MAGIC = b"UCMB"
ALIGNED_VERSION = 2
"""The first version whose ``header_len`` may be 4 KiB (``O_DIRECT`` files)."""
FLAT_LAYOUT_VERSION = 3
"""Version 2's fields, written by the Posix tier for files at ``<ns>/<k[0:2]>/<key>.blk`` (versions 1
and 2 live one directory deeper, at ``<ns>/<k[0:2]>/<k[2:4]>/<key>.blk``)."""
FORMAT_VERSION = FLAT_LAYOUT_VERSION
"""The newest layout this daemon writes: a Posix block file in the two-level directory layout."""
READABLE_VERSIONS = (1, 2, 3)
"""Version 1 is version 2 with a 128-byte header; blocks with that header are still written as 1 by
the tiers that do not say otherwise, so a daemon of an older release reads them, and skips (never
quarantines) the 4 KiB-header ones and the version-3 ones."""
HEADER_SIZE = 128
"""The smallest header: all fields, zero padded to 128 bytes."""
ALIGNED_HEADER_SIZE = 4096
"""A header padded so the payload starts on a 4 KiB boundary (``O_DIRECT`` files)."""
HEADER_SIZES = (HEADER_SIZE, ALIGNED_HEADER_SIZE)
_FIELDS = struct.Struct(f"<4sHHI{NAMESPACE_BYTES}s{KEY_BYTES}sQQQ")
_CRC = struct.Struct("<I")
_FIELDS_AND_CRC = struct.Struct(_FIELDS.format + "I")
_KEY_AT = struct.calcsize("<4sHHI")
_KEY_END = _KEY_AT + NAMESPACE_BYTES + KEY_BYTES
_ZEROS = bytes(ALIGNED_HEADER_SIZE)


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
    header_len: int = HEADER_SIZE
    """Offset of the payload in the stored object."""
    version: int = 1
    """The format version the header was written in (:data:`READABLE_VERSIONS`)."""

    @property
    def stored_len(self) -> int:
        """Bytes of the whole stored object: header, padding and payload."""
        return self.header_len + self.payload_len


def payload_checksum(iov: IoVec) -> int:
    """xxh3-64 over the concatenated segments (no copy: the hasher takes each view)."""
    if len(iov) == 1:  # the common case: one call, no hasher object (per block on the data path)
        return xxhash.xxh3_64_intdigest(iov[0])
    h = xxhash.xxh3_64()
    for seg in iov:
        h.update(seg)
    return h.intdigest()


def encode_header(
    key: BlockKey,
    payload_len: int,
    checksum: int,
    created_ns: int | None = None,
    *,
    header_len: int = HEADER_SIZE,
    version: int | None = None,
) -> bytes:
    """The header of a block, ``header_len`` bytes long (one of :data:`HEADER_SIZES`). ``version``:
    by default the oldest that can say it (1, or 2 for a 4 KiB header), so older releases read it."""
    if header_len not in HEADER_SIZES:
        raise ValueError(f"header_len {header_len} is not one of {HEADER_SIZES}")
    if version is None:
        version = 1 if header_len == HEADER_SIZE else ALIGNED_VERSION
    if version not in READABLE_VERSIONS or (header_len != HEADER_SIZE and version < ALIGNED_VERSION):
        raise ValueError(f"format version {version} cannot have a {header_len}-byte header")
    fields = _FIELDS.pack(
        MAGIC,
        version,
        0,
        header_len,
        key.namespace,
        key.digest,
        payload_len,
        checksum,
        created_ns if created_ns is not None else time.time_ns(),
    )
    crc = _CRC.pack(zlib.crc32(fields))
    return (fields + crc).ljust(header_len, b"\0")


def decode_header(
    raw: bytes | memoryview, expect: BlockKey | None = None, *, max_payload: int | None = None
) -> BlockHeader:
    """Parse and check a header; ``expect`` also checks it names the block we asked for.

    ``max_payload`` (the daemon's ``max_block_bytes``) makes a larger claimed payload corrupt: a
    valid CRC proves only that the header was written whole, not that its length deserves memory.

    ``raw`` is the start of the stored object: at least :data:`HEADER_SIZE` bytes. Whatever part of
    the padding it holds must be zero; a reader holding less than ``header_len`` bytes learns from
    the object's size (``stored_len``) that the rest is missing.
    """
    if len(raw) < HEADER_SIZE:
        raise CorruptBlock(f"header truncated: {len(raw)} of {HEADER_SIZE} bytes")
    magic, version, flags, header_len, ns, digest, payload_len, checksum, created_ns, crc = (
        _FIELDS_AND_CRC.unpack_from(raw)
    )
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version not in READABLE_VERSIONS:  # before the CRC: another version may lay its header out anew
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise UnsupportedFormat(f"block format version {version}; this daemon reads versions {readable}")
    if zlib.crc32(memoryview(raw)[: _FIELDS.size]) != crc:
        raise CorruptBlock("header checksum mismatch")
    if header_len not in (HEADER_SIZES if version >= ALIGNED_VERSION else (HEADER_SIZE,)):
        raise CorruptBlock(f"header length {header_len} is not valid in format version {version}")
    if expect is not None and ns + digest == expect:
        key = expect  # the same 48 bytes: no new key object per block read
    else:
        key = BlockKey(Namespace(ns), Digest(digest))
        if expect is not None:
            raise CorruptBlock(f"header names block {key.hex()}, expected {expect.hex()}")
    if max_payload is not None and payload_len > max_payload:
        raise CorruptBlock(
            f"header claims a {payload_len}-byte payload, more than max_block_bytes {max_payload}"
        )
    _check_zero(raw[_FIELDS.size + _CRC.size : header_len])
    return BlockHeader(
        key=key,
        payload_len=payload_len,
        checksum=checksum,
        created_ns=created_ns,
        flags=flags,
        header_len=header_len,
        version=version,
    )


def fast_checksum(raw: bytearray, key: bytes, payload_len: int, max_payload: int) -> int | None:
    """The payload checksum of the header in ``raw`` (all ``header_len`` bytes of it) when it
    passes every check :func:`decode_header` makes, names ``key`` and promises exactly
    ``payload_len`` bytes after itself; None otherwise (ask :func:`decode_header` which check
    failed). The read path's per-block test: one unpack and a few compares, no header object (a
    4 KiB block's read costs about 6 µs of system calls; a :class:`BlockHeader` cost 1 µs more)."""
    magic, version, _, header_len, _, _, length, checksum, _, crc = _FIELDS_AND_CRC.unpack_from(raw)
    if (
        magic != MAGIC
        or header_len != len(raw)
        or length != payload_len
        or length > max_payload
        or version not in READABLE_VERSIONS
        or (version < ALIGNED_VERSION and header_len != HEADER_SIZE)
        or raw[_KEY_AT:_KEY_END] != key
        or zlib.crc32(memoryview(raw)[: _FIELDS.size]) != crc
        or raw[_FIELDS_AND_CRC.size :] != _ZEROS[: header_len - _FIELDS_AND_CRC.size]
    ):
        return None
    result: int = checksum
    return result


_HEADER_ROW = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("flags", "<u2"),
        ("header_len", "<u4"),
        ("key", f"V{NAMESPACE_BYTES + KEY_BYTES}"),
        ("payload_len", "<u8"),
        ("checksum", "<u8"),
        ("created_ns", "<u8"),
        ("crc", "<u4"),
        ("padding", f"V{HEADER_SIZE - _FIELDS_AND_CRC.size}"),
    ]
)
"""A 128-byte header as a numpy record (:func:`check_headers` reads many side by side)."""
_MAGIC_WORD = int.from_bytes(MAGIC, "little")


WHOLE_HEADER_CRC = zlib.crc32(encode_header(BlockKey(Namespace(bytes(16)), Digest(bytes(32))), 0, 0, 0))
"""The CRC-32 of every whole, valid 128-byte header: its fields, their CRC and zero padding. A CRC
over data followed by the data's own CRC leaves a constant, and so does the zero padding after it:
one ``crc32`` call per header, on the view it was read into, checks its CRC."""
_READABLE = np.zeros(1 << 16, dtype=bool)
_READABLE[list(READABLE_VERSIONS)] = True


def check_headers(
    heads: bytearray, views: list[memoryview], keys: bytes, lengths: list[int], max_payload: int
) -> tuple[list[bool], list[int]]:
    """:func:`fast_checksum` of the 128-byte headers laid end to end in ``heads`` (``views``: each
    header's own view of it), against ``keys`` (their 48-byte keys, joined) and ``lengths`` (the
    payload each must promise):
    whether each passes every check, and the payload checksum each holds. The same checks as a few
    array operations and one C-level ``crc32`` per header instead of a dozen Python steps each (a
    load of packed 4 KiB blocks spent more on checking headers than on reading them)."""
    count = len(lengths)
    rows = np.frombuffer(heads, dtype=_HEADER_ROW, count=count)
    raw = np.frombuffer(heads, dtype=np.uint8, count=count * HEADER_SIZE).reshape(count, HEADER_SIZE)
    crcs = list(map(zlib.crc32, views))
    claimed = rows["payload_len"]
    valid = (
        (rows["magic"] == _MAGIC_WORD)
        & _READABLE[rows["version"]]
        & (rows["header_len"] == HEADER_SIZE)
        & (claimed == np.array(lengths, dtype=np.uint64))
        & (claimed <= max_payload)
        & (rows["key"] == np.frombuffer(keys, dtype=_HEADER_ROW["key"], count=count))
        & (np.array(crcs, dtype=np.uint32) == WHOLE_HEADER_CRC)
        & ~raw[:, _FIELDS_AND_CRC.size :].any(axis=1)
    )
    return valid.tolist(), rows["checksum"].tolist()


def _check_zero(padding: bytes | memoryview) -> None:
    if padding != _ZEROS[: len(padding)]:
        raise CorruptBlock("header padding is not zero")


def verify_payload(header: BlockHeader, iov: IoVec) -> None:
    """Raise :class:`CorruptBlock` unless ``iov`` is exactly the payload the header describes."""
    got = sum(m.nbytes for m in iov)
    if got != header.payload_len:
        raise CorruptBlock(f"payload is {got} bytes, header says {header.payload_len}")
    if payload_checksum(iov) != header.checksum:
        raise CorruptBlock("payload checksum mismatch")
