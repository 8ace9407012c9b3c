"""Pack files: many small blocks of one dump group in one file.

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
import itertools
import operator
import os
import struct
import time
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import xxhash

from ucm_protocol.keys import BlockKey
from ucm_protocol.native import native
from ucm_server.store.copying import IoVec, iov_len
from ucm_server.store.format import (
    HEADER_SIZE,
    READABLE_VERSIONS,
    WHOLE_HEADER_CRC,
    CorruptBlock,
    check_headers,
    decode_header,
    encode_header,
    payload_checksum,
)
from ucm_server.store.posix.block_index import Stamp
from ucm_server.store.vector_io import SHORT_READ, preadv_all

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
    """The index's entry for a block in a pack: its size (the ``int``), ``stored_at``, ``pack``, and
    that pack's id as ``pack_id`` (a block file's stamp says 0)."""

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
            found.pack_id = self.id
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

    def offsets(self) -> dict[bytes | None, int]:
        """Every live packed key's record offset in its pack (for a snapshot; any thread: a C-level
        update per pack; a dead block's None key maps to something, and is never asked for)."""
        found: dict[bytes | None, int] = {}
        for pack in list(self.packs.values()):
            found.update(zip(pack.keys, pack.offsets, strict=False))
        found.pop(None, None)
        return found


PackRead = tuple[Pack, list[int], list[int], list[bytes], list[IoVec]]
"""One pack's part of a load: the pack, the positions of its reads, and their record offsets, keys
and destinations (columns: the reader passes them on whole)."""


def read_jobs(reads: Sequence[tuple[bytes, IoVec, PackedStamp]], most: int) -> list[list[PackRead]]:
    """``reads`` (key, destination, the key's entry) grouped by pack, each block at its record's
    offset now (one deleted since it was looked up is left out), and cut into jobs of about ``most``
    blocks: a load reads each pack with one open and one ``preadv`` per run of nearby records."""
    wanted: dict[Pack, list[int]] = {}
    for n, (_, _, stamp) in enumerate(reads):
        which = wanted.get(stamp.pack)
        if which is None:
            wanted[stamp.pack] = [n]
        else:
            which.append(n)
    jobs: list[list[PackRead]] = [[]]
    count = 0
    for pack, asked in wanted.items():
        keys = [reads[n][0] for n in asked]
        found = pack.offsets_of(keys)
        which = asked
        if None in found:
            which = [n for n, offset in zip(asked, found, strict=True) if offset is not None]
            if not which:
                continue
            keys = [reads[n][0] for n in which]
        offsets = cast(
            list[int], [offset for offset in found if offset is not None] if which is not asked else found
        )
        if count >= most:
            jobs.append([])
            count = 0
        jobs[-1].append((pack, which, offsets, keys, [reads[n][1] for n in which]))
        count += len(which)
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


class RecordReads:
    """The reads of one executor job of packed blocks (:data:`PackRead` each: a pack, and the
    ``(offset, key, dest)`` of its blocks), read pack by pack (:meth:`read`: runs of nearby records
    in one ``preadv`` each, every header into one buffer), then checked all at once
    (:meth:`outcomes`: every header by :func:`~ucm_server.store.format.check_headers`, each payload's
    checksum).

    Per block only C-level steps run in the common case (whole packs loaded: records side by side,
    one segment each), and the array checks run once per job, not per pack: on 2 cores the Python
    between a block's bytes is what a load of small packed blocks costs, not the reading. Each
    pack's payload checksums are taken as soon as it is read, while its bytes are still in the CPU's
    cache (a job's worth, read first and summed after, came back from memory: a fifth of a 64 KiB
    Load's time)."""

    def __init__(self, job: Sequence[PackRead]) -> None:
        self.spans: list[tuple[int, int]] = []
        self.orders: list[list[int] | None] = []
        """Per pack: its members' positions in file order (None: they are in order already)."""
        offsets: list[int] = []
        keys: list[bytes] = []
        dests: list[IoVec] = []
        for _, _, at, given_keys, given_dests in job:
            start = len(offsets)
            order = sorted(range(len(at)), key=at.__getitem__)
            if order == list(range(len(at))):
                self.orders.append(None)
                offsets += at
                keys += given_keys
                dests += given_dests
            else:
                self.orders.append(order)
                offsets += [at[i] for i in order]
                keys += [given_keys[i] for i in order]
                dests += [given_dests[i] for i in order]
            self.spans.append((start, len(offsets)))
        count = len(offsets)
        self.offsets, self.keys, self.dests = offsets, keys, dests
        self.views: list[memoryview] | None = (
            [d[0] for d in dests] if count and max(map(len, dests)) == 1 else None
        )
        self.lengths = list(map(_NBYTES, self.views)) if self.views is not None else list(map(iov_len, dests))
        self.heads = bytearray(count * HEADER_SIZE)
        starts = range(0, (count + 1) * HEADER_SIZE, HEADER_SIZE)
        self.head_views = list(map(memoryview(self.heads).__getitem__, map(slice, starts, starts[1:])))
        self.failed: dict[int, Outcome] = {}
        self.sums: list[int] = [0] * count
        """Each block's payload checksum, taken by :meth:`read` (0 where its pack was not read)."""

    def fail(self, n: int, error: OSError) -> None:
        """Pack ``n`` of the job could not be opened: each of its blocks fails with ``error``."""
        self.failed.update(dict.fromkeys(range(*self.spans[n]), error))

    def read(self, n: int, fd: int, size: int) -> None:
        """Read the records of pack ``n`` of the job from its open file ``fd`` of ``size`` bytes."""
        a, b = self.spans[n]
        views = self.views[a:b] if self.views is not None else None
        failed = _read_runs(
            fd, size, self.offsets[a:b], self.lengths[a:b], self.head_views[a:b], self.dests[a:b], views
        )
        self.failed.update((a + i, error) for i, error in failed.items())
        self.sums[a:b] = map(_XXH3, views) if views is not None else map(payload_checksum, self.dests[a:b])

    def outcomes(self, limit: int, checked: bool) -> list[list[Outcome]]:
        """Each pack's outcomes, in its members' order; a failed block's ``dest`` is zeroed
        (``checked`` and a payload mismatch: left for the caller to read again)."""
        valid, checksums = check_headers(
            self.heads, self.head_views, b"".join(self.keys), self.lengths, limit
        )
        matched: list[bool] = list(map(operator.eq, self.sums, checksums))
        out: list[Outcome]
        if self.failed or not all(valid) or not (checked or all(matched)):
            out = [
                self._outcome(n, ok, same, checked)
                for n, (ok, same) in enumerate(zip(valid, matched, strict=True))
            ]
        else:
            out = list(matched)  # each verified (or, ``checked``, whether it matched)
        result: list[list[Outcome]] = []
        for (a, b), order in zip(self.spans, self.orders, strict=True):
            mine = out[a:b]
            if order is not None:
                back: list[Outcome] = [False] * len(mine)
                for n, i in enumerate(order):
                    back[i] = mine[n]
                mine = back
            result.append(mine)
        return result

    def _outcome(self, n: int, valid: bool, matched: bool, checked: bool) -> Outcome:
        """Block ``n``'s outcome where something failed in the job: its read error, a header that
        fails (a tombstone: deleted), or a payload that does not match."""
        failure = self.failed.get(n)
        if failure is not None:
            return failure
        dest = self.dests[n]
        if not valid:
            _zero(dest)
            if self.head_views[n] == _ZERO_HEADER:  # a tombstone: deleted (a stale snapshot may list it)
                return _deleted()
            return CorruptBlock(_BAD_HEADER)
        return True if matched else _mismatched(dest, checked)


_NBYTES = operator.attrgetter("nbytes")
_XXH3 = xxhash.xxh3_64_intdigest
_BAD_HEADER = "the block's header in its pack does not name it, its length, or fails its CRC"
_MISMATCH = "payload checksum mismatch"


def _mismatched(dest: IoVec, checked: bool) -> Outcome:
    """A payload that does not match its checksum: read straight into the caller's memory
    (``checked``), False, for the caller to read it again through its own; else corrupt, its
    destination zeroed (never served)."""
    if checked:
        return False
    _zero(dest)
    return CorruptBlock(_MISMATCH)


def _deleted() -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "deleted from its pack")


def _outside(offset: int, length: int, size: int) -> str:
    return f"record at {offset} of {length} bytes lies outside the {size}-byte pack"


_READ_RECORDS = getattr(native, "read_records", None)
"""The compiled reader (:func:`read_records`); None where the helper was built without the xxHash
header, or not at all (then :class:`RecordReads` reads every job)."""
_READABLE_MASK = sum(1 << version for version in READABLE_VERSIONS)


def natively_readable(job: Sequence[PackRead]) -> bool:
    """Whether :func:`read_records` can read ``job``: the helper has it, and every destination is one
    segment (what a load into client or Cache memory gives; other shapes go through :class:`RecordReads`)."""
    return _READ_RECORDS is not None and all(max(map(len, dests)) == 1 for *_, dests in job)


def read_records(fd: int, size: int, read: PackRead, max_payload: int, checked: bool) -> list[Outcome]:
    """One pack's records of ``read`` from its open file ``fd`` of ``size`` bytes, read and checked by
    the compiled helper without the GIL (the same checks as :class:`RecordReads`, in the same order of
    their outcomes). On two cores the Python per record of a small-block load (lists, CRC, checksum,
    array checks) held the GIL for as long as the event loop needed it for the next chunk."""
    assert _READ_RECORDS is not None
    _, _, offsets, keys, dests = read
    joined = b"".join(keys)
    codes, error = _READ_RECORDS(
        fd, size, head_len(1), offsets, joined, dests, max_payload, WHOLE_HEADER_CRC, _READABLE_MASK, GAP_MAX
    )
    if codes.count(0) == len(codes):  # the common case: each verified
        return [True] * len(codes)
    out: list[Outcome] = []
    for n, code in enumerate(codes):
        if code == _VERIFIED:
            out.append(True)
        elif code == _MISMATCHED:
            out.append(_mismatched(dests[n], checked))
        elif code == _TOMBSTONE:
            out.append(_deleted())
        elif code == _OUTSIDE:
            out.append(CorruptBlock(_outside(offsets[n], iov_len(dests[n]), size)))
        elif code == _READ_ERROR:
            out.append(OSError(error, os.strerror(error)))
        elif code == _SHORT:
            out.append(CorruptBlock(SHORT_READ))
        else:
            out.append(CorruptBlock(_BAD_HEADER))
    return out


_VERIFIED, _MISMATCHED, _BAD, _TOMBSTONE, _OUTSIDE, _READ_ERROR, _SHORT = range(7)
"""The compiled reader's outcome bytes (``ucm_protocol/csrc/records.c``)."""


def _read_runs(
    fd: int,
    size: int,
    offsets: list[int],
    lengths: list[int],
    heads: list[memoryview],
    dests: list[IoVec],
    views: list[memoryview] | None,
) -> dict[int, Outcome]:
    """Read the records at ``offsets`` (ascending) into ``heads`` and ``dests``: one ``preadv`` for
    records side by side (the common case, built in C-level steps), else one per run of records
    less than :data:`GAP_MAX` apart. The blocks that could not be read, with their errors (their
    destinations zeroed)."""
    count = len(offsets)
    first = head_len(1)
    ends = list(map(operator.add, offsets, map(HEADER_SIZE.__add__, lengths)))
    if offsets[0] >= first and ends[-1] <= size and offsets[1:] == ends[:-1]:  # side by side
        iov: list[memoryview] = (
            list(itertools.chain.from_iterable(zip(heads, views, strict=True)))
            if views is not None
            else [seg for head, dest in zip(heads, dests, strict=True) for seg in (head, *dest)]
        )
        try:
            preadv_all(fd, iov, offsets[0])
        except (OSError, CorruptBlock) as exc:
            for dest in dests:
                _zero(dest)
            return dict.fromkeys(range(count), exc)
        return {}
    failed: dict[int, Outcome] = {}
    run: list[int] = []
    iov = []
    pos = 0
    scratch: memoryview | None = None

    def flush() -> None:
        try:
            preadv_all(fd, iov, offsets[run[0]])
        except (OSError, CorruptBlock) as exc:
            for n in run:
                failed[n] = exc
                _zero(dests[n])
        run.clear()
        iov.clear()

    for n in range(count):
        offset = offsets[n]
        if offset < first or ends[n] > size:
            failed[n] = CorruptBlock(_outside(offset, lengths[n], size))
            _zero(dests[n])
            continue
        if run and (offset < pos or offset - pos > GAP_MAX):
            flush()
        if run and offset > pos:
            scratch = scratch or memoryview(bytearray(GAP_MAX))
            iov.append(scratch[: offset - pos])
        iov.append(heads[n])
        iov.extend(dests[n])
        run.append(n)
        pos = ends[n]
    if run:
        flush()
    return failed


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
