"""Pack files: many small blocks of one dump group in one file (issue #13, item 2).

One file per block costs a create, a write and a rename per block, and the Python between them
(~10-17 µs a block measured): a 4 KiB dump could not reach a plain process's file rate that way.
So, when ``pack_max_block_bytes`` is set, the Posix tier writes the small blocks of a dump group as
ONE file (as CacheLib's flash cache and LSM logs aggregate small objects): one ``pwritev`` of every
header and payload, one rename, and with durability one sync per pack plus one per group.

Layout: ``<root>/pack/<id[0:2]>/<id>.pack`` (``id``: 16 hex digits of a random 63-bit number; no
block file or namespace directory has these names). Format (version :data:`PACK_VERSION`, little
endian)::

    magic "UCMPACK\\0" | version u16 | flags u16 | count u32 | pack_id u64 | created_ns u64 |
    count x (offset u64, payload_len u64) | crc32 u32 of all before
    then at each offset: the block's own 128-byte header (:mod:`ucm_server.store.format`: key,
    payload length, xxh3 checksum, header CRC) and its payload

so every block in a pack is self-describing, and a reader checks what a block file's reader checks
(header CRC, key, length, payload checksum) plus that the record lies inside the file.

Lifecycle: a pack is written to a temporary name and renamed (never torn under its final name).
Deleting, evicting or quarantining a block in a pack zeroes its 128-byte header in place (a
*tombstone*: written only after the header read back names that key, so a wrong location never
damages a neighbour), and the pack is unlinked when its last live block goes. Until then its dead
bytes still take disk space: the tier counts them against its capacity (``pack_dead_bytes`` in its
stats). A pack whose header or table fails its CRC is quarantined whole; a record outside the file,
overlapping another, with a damaged or mismatching header, or naming a key another record of the same
pack names too, is never adopted; its neighbours are.

The index holds a packed block as a :class:`PackedStamp` (a :class:`~ucm_server.store.posix.block_index.Stamp`
shared by the blocks of one size in one pack, pointing at its :class:`Pack`), and each pack keeps its
keys in a list and their offsets in an ``array``: 16 B more per block than a block file's entry.
"""

from __future__ import annotations

import errno
import os
import struct
import time
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import IoVec, iov_len
from ucm_server.store.format import (
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    encode_header,
    fast_checksum,
    payload_checksum,
)
from ucm_server.store.posix.block_index import Stamp
from ucm_server.store.vector_io import preadv_all

PACK_SUFFIX = ".pack"
PACK_DIR = "pack"
PACK_MAGIC = b"UCMPACK\0"
PACK_VERSION = 1
MAX_MEMBERS = 1024
"""Most blocks a pack may hold (a pack header claiming more is corrupt)."""
_HEAD = struct.Struct("<8sHHIQQ")
_ENTRY = struct.Struct("<QQ")
_CRC = struct.Struct("<I")
_ZERO_HEADER = bytes(HEADER_SIZE)
GAP_MAX = 256 << 10
"""A load of some blocks of a pack reads across a gap up to this long (into scratch) rather than
issue another ``preadv``."""


def head_len(count: int) -> int:
    """Bytes of a pack header and table for ``count`` blocks: where the first record starts."""
    return _HEAD.size + count * _ENTRY.size + _CRC.size


def pack_place(pack_id: int) -> tuple[tuple[str, str], str]:
    """Directories below the root and file name of pack ``pack_id``."""
    name = f"{pack_id:016x}"
    return (PACK_DIR, name[:2]), f"{name}{PACK_SUFFIX}"


def new_pack_id() -> int:
    """A random 63-bit pack id (never 0: the index snapshot's "not packed")."""
    return int.from_bytes(os.urandom(8), "little") >> 1 or 1


def encode_head(pack_id: int, created_ns: int, entries: Sequence[tuple[int, int]]) -> bytes:
    body = _HEAD.pack(PACK_MAGIC, PACK_VERSION, 0, len(entries), pack_id, created_ns) + b"".join(
        _ENTRY.pack(off, length) for off, length in entries
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_head(raw: bytes, file_size: int) -> tuple[int, int, list[tuple[int, int]]]:
    """``(pack_id, created_ns, [(offset, payload_len)])`` of a pack's first bytes; raises
    :class:`CorruptBlock` if the magic, version, count or CRC is wrong."""
    if len(raw) < _HEAD.size:
        raise CorruptBlock(f"pack header truncated: {len(raw)} bytes")
    magic, version, _, count, pack_id, created_ns = _HEAD.unpack_from(raw)
    if magic != PACK_MAGIC:
        raise CorruptBlock(f"bad pack magic {magic!r}")
    if version != PACK_VERSION:
        raise CorruptBlock(f"pack format version {version}; this daemon reads {PACK_VERSION}")
    end = head_len(count)
    if count > MAX_MEMBERS or end > min(len(raw), file_size):
        raise CorruptBlock(f"pack header claims {count} blocks; the file cannot hold their table")
    (crc,) = _CRC.unpack_from(raw, end - _CRC.size)
    if zlib.crc32(memoryview(raw)[: end - _CRC.size]) != crc:
        raise CorruptBlock("pack header checksum mismatch")
    entries = [_ENTRY.unpack_from(raw, _HEAD.size + i * _ENTRY.size) for i in range(count)]
    return pack_id, created_ns, entries


class PackedStamp(Stamp):
    """The index's entry for a block in a pack: its size (the ``int``), ``stored_at``, and ``pack``."""

    pack: Pack


class Pack:
    """One pack file as the index knows it: its live keys (None where one died) and their offsets."""

    __slots__ = ("_stamps", "dead_bytes", "id", "keys", "live", "offsets", "root")

    def __init__(self, pack_id: int, root: Path) -> None:
        self.id = pack_id
        self.root = root
        self.keys: list[bytes | None] = []
        self.offsets = array("Q")
        self.live = 0
        self.dead_bytes = 0
        self._stamps: dict[tuple[int, int], PackedStamp] = {}

    def add(self, key: bytes, offset: int) -> None:
        self.keys.append(key)
        self.offsets.append(offset)
        self.live += 1

    def stamp(self, size: int, stored_at: float) -> PackedStamp:
        """The stamp shared by this pack's blocks of ``size`` stored in that second."""
        second = int(stored_at)
        found = self._stamps.get((size, second))
        if found is None:
            found = self._stamps[(size, second)] = PackedStamp(size)
            found.stored_at = float(second)
            found.pack = self
        return found

    def offset_of(self, key: bytes) -> int | None:
        try:
            return self.offsets[self.keys.index(key)]
        except ValueError:
            return None

    def offsets_of(self, keys: Sequence[bytes]) -> list[int | None]:
        """:meth:`offset_of` for many keys: a load of many blocks of one pack finds each through one
        position map built here (a linear search per key cost ~0.5 µs a block in a 64-block pack)."""
        if len(keys) < 4:
            return [self.offset_of(k) for k in keys]
        count = len(self.keys)
        # Built from the end, so that a key listed twice maps to its first place, as index() finds.
        where = dict(zip(reversed(self.keys), range(count - 1, -1, -1), strict=True))
        offsets = self.offsets
        return [None if (i := where.get(k)) is None else offsets[i] for k in keys]

    def kill(self, key: bytes) -> int | None:
        """Mark ``key`` dead here; its record's offset, or None if it was not live here."""
        try:
            i = self.keys.index(key)
        except ValueError:
            return None
        self.keys[i] = None
        self.live -= 1
        return self.offsets[i]

    @property
    def place(self) -> tuple[tuple[str, str], str]:
        return pack_place(self.id)


@dataclass(slots=True)
class Retire:
    """Disk work a removal leaves: zero a record's header (``offset``), or unlink the pack (None)."""

    pack: Pack
    key: bytes
    offset: int | None


class PackTable:
    """The live packs of a tier by id, the dead bytes they still hold, and the disk work pending."""

    __slots__ = ("dead_bytes", "packs", "pending")

    def __init__(self) -> None:
        self.packs: dict[int, Pack] = {}
        self.dead_bytes = 0
        self.pending: list[Retire] = []

    def register(self, pack: Pack) -> Pack:
        """``pack``, or the pack of that id already known (a snapshot's, then met by the sweep)."""
        return self.packs.setdefault(pack.id, pack)

    def kill(self, stamp: PackedStamp, key: bytes, *, tombstone: bool = True) -> None:
        """``key`` (indexed with ``stamp``) is gone: dead in its pack; queue its tombstone, or the
        pack's unlink when it was the last live block."""
        pack = stamp.pack
        offset = pack.kill(key)
        if offset is None:
            return
        if pack.live <= 0:
            if self.packs.get(pack.id) is pack:
                del self.packs[pack.id]
            self.dead_bytes -= pack.dead_bytes
            self.pending.append(Retire(pack, key, None))
            return
        pack.dead_bytes += int(stamp)
        self.dead_bytes += int(stamp)
        if tombstone:
            self.pending.append(Retire(pack, key, offset))

    def take(self) -> list[Retire]:
        pending, self.pending = self.pending, []
        return pending

    def locations(self) -> dict[bytes, tuple[int, int]]:
        """Every live packed key's ``(pack id, offset)`` (for a snapshot; any thread)."""
        found: dict[bytes, tuple[int, int]] = {}
        for pack in list(self.packs.values()):
            for key, offset in zip(list(pack.keys), list(pack.offsets), strict=False):
                if key is not None:
                    found[key] = (pack.id, offset)
        return found


PackRead = tuple[Pack, list[int], list[tuple[int, bytes, IoVec]]]
"""One pack's part of a load: the pack, the positions of its reads, and ``(offset, key, dest)`` each."""


def read_jobs(reads: Sequence[tuple[bytes, IoVec, PackedStamp]], most: int) -> list[list[PackRead]]:
    """``reads`` (key, destination, the key's entry) grouped by pack, each block at its record's
    offset now (one deleted since it was looked up is left out), and cut into jobs of about ``most``
    blocks: a load reads each pack with one open and one ``preadv`` per run of nearby records."""
    wanted: dict[Pack, list[int]] = {}
    for n, (_, _, stamp) in enumerate(reads):
        wanted.setdefault(stamp.pack, []).append(n)
    jobs: list[list[PackRead]] = [[]]
    count = 0
    for pack, which in wanted.items():
        slot: PackRead = (pack, [], [])
        for n, offset in zip(which, pack.offsets_of([reads[n][0] for n in which]), strict=True):
            if offset is not None:
                slot[1].append(n)
                slot[2].append((offset, reads[n][0], reads[n][1]))
        if not slot[1]:
            continue
        if count >= most:
            jobs.append([])
            count = 0
        jobs[-1].append(slot)
        count += len(slot[1])
    return [job for job in jobs if job]


# -- blocking file work (worker threads) -----------------------------------------------------------------
def pack_parts(
    pack_id: int, items: Sequence[tuple[BlockKey, IoVec]], created_ns: int | None = None
) -> tuple[list[memoryview], list[int]]:
    """The segments of a whole pack file (header, then each block's header and payload) and each
    block's record offset."""
    created = created_ns if created_ns is not None else time.time_ns()
    offset = head_len(len(items))
    entries: list[tuple[int, int]] = []
    body: list[memoryview] = []
    for key, src in items:
        size = iov_len(src)
        entries.append((offset, size))
        body.append(memoryview(encode_header(key, size, payload_checksum(src), created)))
        body.extend(src)
        offset += HEADER_SIZE + size
    head = memoryview(encode_head(pack_id, created, entries))
    return [head, *body], [off for off, _ in entries]


Outcome = bool | OSError | CorruptBlock
"""A block's read from a pack: True (verified), False (``checked``: read, bytes did not match), or
the error."""


def read_members(
    fd: int, size: int, members: Sequence[tuple[int, bytes, IoVec]], limit: int, checked: bool
) -> list[Outcome]:
    """Read blocks ``(offset, key, dest)`` of the open pack file ``fd`` (``size`` bytes) into their
    destinations: runs of nearby records in one ``preadv`` each, then each block's header checked
    (:func:`~ucm_server.store.format.fast_checksum`: names ``key``, promises ``dest``'s length, CRC)
    and its payload's checksum. Outcomes in ``members`` order; a failed block's ``dest`` is zeroed
    (``checked`` and a payload mismatch: left for the caller to read again)."""
    order = sorted(range(len(members)), key=lambda i: members[i][0])
    out: list[Outcome] = [CorruptBlock("not read")] * len(members)
    heads: dict[int, bytearray] = {}
    run: list[int] = []
    iov: list[memoryview] = []
    pos = 0
    scratch = memoryview(bytearray(GAP_MAX))

    def flush() -> None:
        if not run:
            return
        start = members[run[0]][0]
        try:
            preadv_all(fd, iov, start)
        except (OSError, CorruptBlock) as exc:
            for i in run:
                out[i] = exc
                _zero(members[i][2])
        else:
            for i in run:
                out[i] = _check(heads[i], members[i][1], members[i][2], limit, checked)
        run.clear()
        iov.clear()

    for i in order:
        offset, _, dest = members[i]
        nbytes = iov_len(dest)
        if offset < head_len(1) or offset + HEADER_SIZE + nbytes > size:
            out[i] = CorruptBlock(f"record at {offset} of {nbytes} bytes lies outside the {size}-byte pack")
            _zero(dest)
            continue
        if run and (offset < pos or offset - pos > GAP_MAX):
            flush()
        if run and offset > pos:
            iov.append(scratch[: offset - pos])
        head = heads[i] = bytearray(HEADER_SIZE)
        iov.append(memoryview(head))
        iov.extend(dest)
        run.append(i)
        pos = offset + HEADER_SIZE + nbytes
    flush()
    return out


def _check(head: bytearray, key: bytes, dest: IoVec, limit: int, checked: bool) -> Outcome:
    want = fast_checksum(head, key, iov_len(dest), limit)
    if want is None:
        _zero(dest)
        if head == _ZERO_HEADER:  # a tombstone: deleted (a stale snapshot may still list it)
            return FileNotFoundError(errno.ENOENT, "deleted from its pack")
        return CorruptBlock("the block's header in its pack does not name it, its length, or fails its CRC")
    matched = payload_checksum(dest) == want
    if checked or matched:
        return matched
    _zero(dest)
    return CorruptBlock("payload checksum mismatch")


@dataclass(frozen=True, slots=True)
class Scanned:
    """What a start-up scan found in one pack: its id and time, the blocks it may adopt, and how many
    records it refused (with the first reason)."""

    pack_id: int
    created_ns: int
    blocks: list[tuple[BlockKey, int, int]]
    """``(key, payload_len, offset)`` of each adoptable block."""
    refused: int
    reason: str


def scan_pack(fd: int, size: int, max_payload: int) -> Scanned:
    """Read a pack's header and its records' headers (not payloads: those are checked at load).
    Raises :class:`CorruptBlock` when the pack header itself is bad (the caller quarantines the pack)."""
    pack_id, created_ns, entries = decode_head(os.pread(fd, head_len(MAX_MEMBERS), 0), size)
    first = head_len(len(entries))
    refused = 0
    reason = ""
    found: list[tuple[BlockKey, int, int]] = []
    end = first
    for offset, length in sorted(entries):
        why = ""
        if offset < first or offset + HEADER_SIZE + length > size:
            why = f"record at {offset} of {length} bytes lies outside the pack"
        elif offset < end:
            why = f"record at {offset} overlaps the one before it"
        else:
            end = offset + HEADER_SIZE + length
            raw = os.pread(fd, HEADER_SIZE, offset)
            if raw == _ZERO_HEADER:
                continue  # a tombstone: deleted
            try:
                header = decode_header(raw, max_payload=max_payload)
                if header.payload_len != length or header.header_len != HEADER_SIZE:
                    raise CorruptBlock(f"header promises {header.payload_len} bytes, the table {length}")
            except CorruptBlock as exc:
                why = str(exc)
            else:
                found.append((header.key, length, offset))
        if why:
            refused += 1
            reason = reason or why
    seen: dict[bytes, int] = {}
    for key, _, _ in found:
        seen[key] = seen.get(key, 0) + 1
    twice = [item for item in found if seen[item[0]] > 1]
    if twice:
        refused += len(twice)
        reason = reason or f"block {twice[0][0].hex()} appears {seen[twice[0][0]]} times"
        found = [item for item in found if seen[item[0]] == 1]
    return Scanned(pack_id, created_ns, found, refused, reason)


def tombstone(fd: int, offset: int, key: bytes) -> bool:
    """Zero the header of ``key``'s record at ``offset`` if the header there names ``key``; whether
    it did (a wrong location never damages another block)."""
    raw = os.pread(fd, HEADER_SIZE, offset)
    try:
        header = decode_header(raw)
    except CorruptBlock:
        return False
    if header.key != key:
        return False
    os.pwrite(fd, _ZERO_HEADER, offset)
    return True


def _zero(dest: IoVec) -> None:
    for seg in dest:
        seg[:] = bytes(seg.nbytes)
