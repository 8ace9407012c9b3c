"""Client memory the daemon copies into and out of: memfd regions handed over by file descriptor.

A client creates a memfd sealed against shrinking, hands the descriptor over (:mod:`ucm_server.handover`),
registers it once, and from then on names ``(region, offset, length)`` segments in Load/Dump. The
daemon maps the memory and copies between its tiers and that mapping directly — bulk bytes never
cross the socket. Because the memory cannot shrink, nothing the client does to its own copy can take
pages from under the mapping. A session may hold at most ``max_regions`` regions of at most
``max_bytes`` bytes in all (``RESOURCE_EXHAUSTED`` beyond).

The memory must be fully allocated by the client when registered and stay so: the daemon keeps one
descriptor per memfd and checks it before and after every task that copies through it
(:mod:`ucm_server.client_memory`); memory found with holes is refused, its regions dropped and its
pages released, so no client can make the daemon allocate (and be charged for) the client's memory.
The descriptors kept are bounded: at most 1/16 of the daemon's share for them per session
(:mod:`ucm_server.descriptors`).

Every segment is checked against its region before anything is copied; a bad one fails the whole
request with ``INVALID_ARGUMENT`` naming the block and the bounds. A region belongs to the session that
registered it and is unmapped when that session ends; while a task is copying into it the mapping is
pinned, so unregistering waits for the copy instead of pulling memory from under it.

GPU regions (CUDA IPC, :mod:`ucm_server.gpu`) share the table, its ids and those rules, but are made
elsewhere (:meth:`RegionTable.add`) and never resolved to memoryviews: a request naming one goes down
the GPU copy path, and a request mixing host and GPU regions is refused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucm_protocol.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from ucm_protocol.keys import BlockKey
from ucm_server.client_memory import ALLOCATE, ClientMemory, unallocated
from ucm_server.descriptors import DescriptorBudget, process_budget
from ucm_server.gpu_region import GpuRegion
from ucm_server.region_prefault import RegionPrefaulter
from ucm_server.store.copying import IoVec
from ucm_server.store.spans import SpanItems

log = logging.getLogger(__name__)

SESSION_SHARE = 16
"""One session may hold at most this fraction (1/16) of the descriptors kept for client memfds."""


@dataclass(slots=True, eq=False)  # identity: regions are pinned in sets
class Region:
    region_id: int
    session_id: str
    name: str
    size: int
    label: str
    view: memoryview
    users: int = 0
    closing: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    owner_uid: int = -1
    """uid and pid of the process that handed the memory over (``SO_PEERCRED``)."""
    owner_pid: int = 0
    memory: ClientMemory | None = None
    """The memfd it maps, checked around every copy (None: a region made without one, in tests)."""

    def close(self) -> None:
        try:
            self.view.release()
        except BufferError:
            pass  # a finished task's views are still referenced; the mapping goes with them


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _munmap(address: int, size: int) -> None:
    _libc().munmap(address, size)


def map_shared(fd: int, size: int) -> memoryview:
    """Map ``size`` bytes of ``fd`` read-write and shared, as a byte memoryview that holds no file
    descriptor (Python's ``mmap`` keeps a duplicate of the fd open per mapping, so a client registering
    many regions would exhaust the daemon's descriptors). The mapping is removed when the last view of
    it (the region's, and any slice a task still holds) is gone."""
    address = _libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    pages: Any = type("ClientPages", (ctypes.c_char * size,), {})  # a subclass: weakly referenceable
    array = pages.from_address(address)
    weakref.finalize(array, _munmap, address, size)
    return memoryview(array).cast("B")


@dataclass(frozen=True, slots=True)
class SegmentColumns:
    """A request's segments, column-wise as on the wire: block ``b`` is the next ``counts[b]``
    entries of ``region_ids`` / ``offsets`` / ``lengths`` (no ``counts``: one segment per block)."""

    counts: list[int]
    region_ids: list[int]
    offsets: list[int]
    lengths: list[int]

    def block_counts(self, nblocks: int) -> list[int]:
        """Check the columns' shape against ``nblocks`` keys; the segments per block."""
        nseg = len(self.region_ids)
        if not (len(self.offsets) == len(self.lengths) == nseg):
            raise InvalidArgument(
                "region_ids, offsets and lengths must have equal lengths, "
                f"got {nseg}, {len(self.offsets)}, {len(self.lengths)}"
            )
        counts = self.counts or [1] * nblocks
        if len(counts) != nblocks:
            raise InvalidArgument(f"segment_counts has {len(counts)} entries for {nblocks} keys")
        if sum(counts) != nseg:
            raise InvalidArgument(f"segment_counts add up to {sum(counts)}, but {nseg} segments were given")
        return counts


class RegionTable:
    """All registered regions, by id, with per-session ownership."""

    def __init__(
        self,
        *,
        max_regions: int = 4096,
        max_bytes: int = 1 << 40,
        prefaulter: RegionPrefaulter | None = None,
        budget: DescriptorBudget | None = None,
    ) -> None:
        self.prefaulter = prefaulter
        """Populates new regions' page tables in the background (see :mod:`ucm_server.region_prefault`)."""
        self.budget = budget if budget is not None else process_budget()
        """Descriptors of client memfds come out of it (one per memfd)."""
        self._regions: dict[int, Region | GpuRegion] = {}
        self._ids = itertools.count(1)
        self._gpu = 0  # GPU regions registered: host-only daemons skip the GPU check entirely
        self._usage: dict[str, tuple[int, int]] = {}  # session -> (regions, bytes)
        self._memories: dict[tuple[int, int], ClientMemory] = {}  # (st_dev, st_ino) -> memfd kept
        self._memories_of: dict[str, int] = {}  # session -> memfds it registered first
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.tampered = 0
        """Client memfds found with holes after registration, and released (a figure for tests)."""

    def __len__(self) -> int:
        return len(self._regions)

    @property
    def memories(self) -> int:
        """Client memfds the daemon holds a descriptor of."""
        return len(self._memories)

    @property
    def total_bytes(self) -> int:
        # list() first: one C-level copy, so the metrics scrape thread never iterates a dict that
        # the event loop is changing (ucm_server.snapshot).
        return sum(r.size for r in list(self._regions.values()))

    def register_fd(
        self, session_id: str, fd: int, size: int, label: str, *, uid: int = -1, pid: int = 0, name: str = ""
    ) -> Region:
        """Map ``size`` bytes of a checked, sealed memfd (the caller keeps and closes ``fd``; the table
        keeps a descriptor of its own, one per memfd). Refused unless the memory is fully allocated."""
        if size <= 0:
            raise InvalidArgument(f"region size must be positive, got {size}")
        self.check_limits(session_id, size)
        st = os.fstat(fd)
        memory = self._memories.get((st.st_dev, st.st_ino))
        if memory is None:
            if (why := unallocated(st)) is not None:
                raise InvalidArgument(f"the handed-over memory has holes: {why}; {ALLOCATE}")
            memory = self._keep(session_id, fd, st, uid=uid, pid=pid)
        elif memory.tampered:
            raise FailedPrecondition(
                f"this memory was found with holes after registration and dropped; {ALLOCATE}"
            )
        try:
            try:
                view = map_shared(fd, size)
            except OSError as exc:
                if exc.errno == errno.ENOMEM:
                    raise ResourceExhausted(
                        f"cannot map {size} more bytes of client memory: {exc.strerror} (the daemon's "
                        "mappings or address space are exhausted)"
                    ) from None
                msg = f"the handed-over memory cannot be mapped read-write: {exc.strerror}"
                raise InvalidArgument(msg) from None
            if (why := memory.holes()) is not None:  # after mapping: holes punched since the handover
                view.release()
                if memory.regions:
                    self._tampered(memory, why)
                raise InvalidArgument(f"the handed-over memory has holes: {why}; {ALLOCATE}")
        except BaseException:
            if not memory.regions:
                self._forget(memory)
            raise
        region = Region(
            region_id=next(self._ids),
            session_id=session_id,
            name=name or f"memfd:{pid}",
            size=size,
            label=label,
            view=view,
            owner_uid=uid,
            owner_pid=pid,
            memory=memory,
        )
        memory.regions.add(region)
        self._insert(region)
        if self.prefaulter is not None:
            self.prefaulter.add(view, memory, lambda: region.closing, self._tamper_callback(memory))
        log.debug(
            "registered region %d (%d bytes from pid %d uid %d) for session %s",
            region.region_id,
            size,
            pid,
            uid,
            session_id,
        )
        return region

    def _keep(self, session_id: str, fd: int, st: os.stat_result, *, uid: int, pid: int) -> ClientMemory:
        """A descriptor of the memfd of its own, out of the budget (1/:data:`SESSION_SHARE` of it per
        session, so a few sessions cannot take it all)."""
        mine = self._memories_of.get(session_id, 0)
        share = max(1, self.budget.capacity // SESSION_SHARE)
        if mine >= share:
            raise ResourceExhausted(
                f"session {session_id[:8]} has {mine} distinct memfds registered, its share "
                f"(1/{SESSION_SHARE}) of the daemon's {self.budget.describe()}; register regions of "
                "fewer, larger buffers"
            )
        if not self.budget.take():
            raise ResourceExhausted(
                f"the daemon holds {self.budget.used} memfds of clients' regions, all of its "
                f"{self.budget.describe()}; unregister memory no longer used, or raise the daemon's "
                "descriptor limit"
            )
        try:
            kept = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        except OSError as exc:
            self.budget.give()
            raise ResourceExhausted(f"cannot keep a descriptor of the memory: {exc.strerror}") from None
        memory = ClientMemory(kept, st, pid=pid, uid=uid, session_id=session_id)
        self._memories[memory.key] = memory
        self._memories_of[session_id] = mine + 1
        return memory

    def _forget(self, memory: ClientMemory) -> None:
        """The memfd has no region left: release it (punched first when it was tampered with)."""
        if self._memories.get(memory.key) is memory:
            del self._memories[memory.key]
            left = self._memories_of.pop(memory.session_id, 1) - 1
            if left > 0:
                self._memories_of[memory.session_id] = left
        if not memory.closed:
            memory.release()
            self.budget.give()

    def _tamper_callback(self, memory: ClientMemory) -> Callable[[str], None]:
        """For the prefault thread: report holes found there to the table, on the event loop."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

        def report(why: str) -> None:
            memory.tampered = True  # the next pin refuses it at once, whatever the loop is doing
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # a loop already closed: shutting down
                    loop.call_soon_threadsafe(self._tampered, memory, why)

        return report

    def _tampered(self, memory: ClientMemory, why: str) -> None:
        """Memory found with holes: drop its regions; it is punched and closed once no copy uses it."""
        memory.tampered = True
        if memory.dropped:
            return
        memory.dropped = True
        if memory.regions:
            self.tampered += 1
            log.warning(
                "client memory of pid %d (uid %d) changed after registration (%s): its %d region(s) "
                "are dropped and its pages released",
                memory.pid,
                memory.uid,
                why,
                len(memory.regions),
            )
        for region in list(memory.regions):
            if isinstance(region, Region) and not region.closing:
                self._drop(region)
        if not memory.regions:
            self._forget(memory)

    def check_limits(self, session_id: str, size: int) -> None:
        """``RESOURCE_EXHAUSTED`` if one more region of ``size`` bytes would pass the session's limits."""
        count, nbytes = self._usage.get(session_id, (0, 0))
        if count >= self.max_regions:
            raise ResourceExhausted(
                f"session {session_id[:8]} already has {count} regions registered, the limit "
                f"(max_session_regions = {self.max_regions}); unregister regions it no longer uses"
            )
        if nbytes + size > self.max_bytes:
            raise ResourceExhausted(
                f"session {session_id[:8]} has {nbytes} bytes registered; {size} more would pass the "
                f"limit (max_session_region_bytes = {self.max_bytes})"
            )

    def usage(self, session_id: str) -> tuple[int, int]:
        """Regions and bytes the session has registered."""
        return self._usage.get(session_id, (0, 0))

    def _insert(self, region: Region | GpuRegion) -> None:
        self._regions[region.region_id] = region
        count, nbytes = self._usage.get(region.session_id, (0, 0))
        self._usage[region.session_id] = (count + 1, nbytes + region.size)

    def add(self, make: Callable[[int], GpuRegion]) -> GpuRegion:
        """Register a region built elsewhere (a CUDA IPC mapping) under a fresh id."""
        region = make(next(self._ids))
        self._insert(region)
        self._gpu += 1
        return region

    def has_gpu(self, region_ids: Iterable[int]) -> bool:
        """Whether a request names any GPU region (then it takes the GPU copy path)."""
        if not self._gpu:
            return False
        return any(isinstance(self._regions.get(rid), GpuRegion) for rid in set(region_ids))

    def get(self, session_id: str, region_id: int) -> Region | GpuRegion:
        region = self._regions.get(region_id)
        if region is None or region.closing:
            raise InvalidArgument(f"unknown region {region_id}")
        if region.session_id != session_id:
            raise PermissionDenied(f"region {region_id} belongs to another session")
        return region

    def unregister(self, session_id: str, region_id: int) -> None:
        region = self.get(session_id, region_id)
        self._drop(region)

    def release_session(self, session_id: str) -> int:
        mine = [r for r in self._regions.values() if r.session_id == session_id]
        for r in mine:
            self._drop(r)
        return len(mine)

    def _drop(self, region: Region | GpuRegion) -> None:
        region.closing = True
        if self._regions.pop(region.region_id, None) is not None:
            count, nbytes = self._usage.pop(region.session_id, (1, region.size))
            if count > 1:
                self._usage[region.session_id] = (count - 1, nbytes - region.size)
            if isinstance(region, GpuRegion):
                self._gpu -= 1
        if region.users == 0:
            self._close(region)

    def _close(self, region: Region | GpuRegion) -> None:
        """No copy uses the region any more: unmap it, and release its memfd after its last region."""
        region.close()
        memory = region.memory if isinstance(region, Region) else None
        if memory is not None and region in memory.regions:
            memory.regions.discard(region)
            if not memory.regions:
                self._forget(memory)

    def pin(self, regions: Iterable[Region | GpuRegion]) -> None:
        """Before a task copies through ``regions``: each host region's memory is still whole (else
        ``FAILED_PRECONDITION``, the memory dropped, and nothing pinned)."""
        regions = list(regions)
        if (found := self._check_memory(regions)) is not None:
            region, why = found
            raise FailedPrecondition(
                f"region {region.region_id}: its memory has holes now ({why}): the region is dropped and "
                f"the memory released; {ALLOCATE}"
            )
        for r in regions:
            r.users += 1

    def unpin(self, regions: Iterable[Region | GpuRegion]) -> None:
        """After a task copied through ``regions``: memory found with holes now is dropped and
        released (the copy may have been the one to allocate them)."""
        regions = list(regions)
        self._check_memory(regions)
        for r in regions:
            r.users -= 1
            if r.users == 0 and r.closing:
                self._close(r)

    def _check_memory(self, regions: list[Region | GpuRegion]) -> tuple[Region, str] | None:
        """Check the memory of every host region (one ``fstat`` per memfd); each found with holes is
        dropped. The first such region and why, or None."""
        first: tuple[Region, str] | None = None
        seen: set[int] = set()
        for r in regions:
            memory = r.memory if isinstance(r, Region) else None
            if memory is None or id(memory) in seen:
                continue
            seen.add(id(memory))
            why = "it was found with holes before" if memory.tampered else memory.holes()
            if why is not None:
                assert isinstance(r, Region)
                self._tampered(memory, why)
                first = first or (r, why)
        return first

    def segments(
        self, session_id: str, columns: SegmentColumns, nblocks: int, max_block_bytes: int, *, gpu: bool
    ) -> tuple[list[list[tuple[Any, int, int]]], set[Any]]:
        """Check every segment of a column-wise batch before anything is copied: each block's
        ``(region, offset, length)`` list, and the regions used. ``gpu`` says which kind of region the
        request must name only (one request cannot mix host and GPU memory)."""
        counts = columns.block_counts(nblocks)
        found = self.regions_for(session_id, columns, counts, gpu=gpu)
        return check_segments(columns, counts, found, max_block_bytes), set(found.values())

    def regions_for(
        self, session_id: str, columns: SegmentColumns, counts: list[int], *, gpu: bool
    ) -> dict[int, Any]:
        """The regions a batch names, by id: each must exist, be the session's, and be of the one
        kind (host or GPU) the request copies. Cheap (one lookup per distinct region), so it runs on
        the event loop; :func:`check_segments` then checks every segment against them."""
        found: dict[int, Any] = {}
        for rid in dict.fromkeys(columns.region_ids):  # first-use order: errors name the first block
            try:
                region = self.get(session_id, rid)
            except InvalidArgument:
                b = _block_of(counts, columns.region_ids.index(rid))
                raise InvalidArgument(f"block {b}: unknown region {rid}") from None
            except PermissionDenied:
                b = _block_of(counts, columns.region_ids.index(rid))
                raise PermissionDenied(f"block {b}: region {rid} belongs to another session") from None
            if isinstance(region, GpuRegion) != gpu:
                kind = "GPU memory" if not gpu else "host memory"
                b = _block_of(counts, columns.region_ids.index(rid))
                raise InvalidArgument(
                    f"block {b}: region {rid} is {kind}; one request cannot mix host and GPU regions"
                )
            found[rid] = region
        return found

    def resolve(
        self, session_id: str, columns: SegmentColumns, nblocks: int, max_block_bytes: int
    ) -> tuple[list[IoVec], set[Region]]:
        """Turn a column-wise batch of host regions into one iovec per block."""
        blocks, used = self.segments(session_id, columns, nblocks, max_block_bytes, gpu=False)
        return host_iovecs(blocks), used


def host_iovecs(blocks: list[list[tuple[Any, int, int]]]) -> list[IoVec]:
    """Checked host segments as one iovec (memoryviews into the regions' mappings) per block.
    A block of one segment (the usual one) skips the inner comprehension's call (256 blocks:
    43 -> 28 µs)."""
    out: list[IoVec] = []
    for segs in blocks:
        if len(segs) == 1:
            ((r, o, n),) = segs
            out.append([r.view[o : o + n]])
        else:
            out.append([r.view[o : o + n] for r, o, n in segs])
    return out


class SingleSegmentBatch:
    """A checked batch of the usual shape (:func:`single_segment_batch`): its blocks are handed out a
    chunk at a time (:meth:`items`) as span batches, offsets into the region's view with no view
    made a block (4,096 views cost ~1.5 ms of the event loop, and the Cache copies by offsets)."""

    __slots__ = ("ascending", "lengths", "offsets", "view")

    def __init__(
        self, view: memoryview, offsets: list[int], lengths: list[int], ascending: bool = False
    ) -> None:
        self.view, self.offsets, self.lengths = view, offsets, lengths
        self.ascending = ascending
        """Each span starts at or past the end of the one before: no two overlap (a Load then
        needs no :func:`check_disjoint`, which sorts the batch again from its lists)."""

    def items(self, keys: Sequence[BlockKey], start: int, stop: int) -> SpanItems:
        """Blocks ``start`` to ``stop`` of ``keys`` (the checks held for all of them)."""
        return SpanItems(keys[start:stop], self.view, self.offsets[start:stop], self.lengths[start:stop])

    def iovecs(self, start: int, stop: int) -> list[IoVec]:
        """Blocks ``start`` to ``stop``, one view each."""
        view = self.view
        return [
            [view[o : o + n]] for o, n in zip(self.offsets[start:stop], self.lengths[start:stop], strict=True)
        ]


def single_segment_iovecs(
    columns: SegmentColumns, found: dict[int, Any], max_block_bytes: int
) -> list[IoVec] | None:
    """:func:`single_segment_batch`'s iovecs, all of them at once."""
    batch = single_segment_batch(columns, found, max_block_bytes)
    return None if batch is None else batch.iovecs(0, len(batch.offsets))


def single_segment_batch(
    columns: SegmentColumns, found: dict[int, Any], max_block_bytes: int
) -> SingleSegmentBatch | None:
    """:func:`check_segments` for the usual batch (one segment per block, every block in one
    region) with the checks run as array operations: 4,096 blocks cost ~0.3 ms instead of ~2.3 ms
    of per-segment Python. None where the batch is of another shape or any check fails: the caller
    then runs the per-segment checks, whose errors name the block."""
    if len(found) != 1 or (columns.counts and columns.counts.count(1) != len(columns.counts)):
        return None
    (region,) = found.values()
    try:
        offsets = np.array(columns.offsets, dtype=np.uint64)
        lengths = np.array(columns.lengths, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        return None
    if not offsets.size:
        return None
    size = region.size
    if lengths.min() == 0 or lengths.max() > min(size, max_block_bytes) or offsets.max() > size:
        return None
    ends = offsets + lengths  # no wrap-around: both terms are at most the region's size
    if ends.max() > size:
        return None
    ascending = bool((offsets[1:] >= ends[:-1]).all())
    return SingleSegmentBatch(region.view, columns.offsets, columns.lengths, ascending)


def check_segments(
    columns: SegmentColumns, counts: list[int], found: dict[int, Any], max_block_bytes: int
) -> list[list[tuple[Any, int, int]]]:
    """Each block's ``(region, offset, length)`` list, every segment checked against its region
    (``found``, from :meth:`RegionTable.regions_for`). Linear in the segments and free of event-loop
    state, so a large request is checked in a worker thread while the regions are pinned."""
    region_ids, offsets, lengths = columns.region_ids, columns.offsets, columns.lengths
    blocks: list[list[tuple[Any, int, int]]] = []
    pos = 0
    for b, count in enumerate(counts):
        if count == 0:
            raise InvalidArgument(f"block {b} has no segments")
        segs: list[tuple[Any, int, int]] = []
        total = 0
        for s in range(pos, pos + count):
            rid, off, length = region_ids[s], offsets[s], lengths[s]
            region = found[rid]
            if length == 0:
                raise InvalidArgument(f"block {b}: segment of length 0")
            if off + length > region.size:
                raise InvalidArgument(
                    f"block {b}: segment [{off}, {off + length}) is outside region {rid} "
                    f"of {region.size} bytes"
                )
            segs.append((region, off, length))
            total += length
        pos += count
        if total > max_block_bytes:
            raise InvalidArgument(f"block {b} is {total} bytes, more than max_block_bytes {max_block_bytes}")
        blocks.append(segs)
    return blocks


def check_disjoint(columns: SegmentColumns, counts: list[int]) -> None:
    """Refuse a Load whose destination segments overlap (two blocks, or two segments of one block,
    naming the same bytes): the result would depend on which copy lands last. Sorts the segments by
    region and offset, O(n log n); call it after :func:`check_segments` (offsets are then in range)."""
    n = len(columns.offsets)
    if n < 2:
        return
    rid = np.asarray(columns.region_ids, dtype=np.int64)
    start = np.asarray(columns.offsets, dtype=np.int64)
    end = start + np.asarray(columns.lengths, dtype=np.int64)
    order = np.lexsort((start, rid))
    same = rid[order][1:] == rid[order][:-1]
    clash = np.flatnonzero(same & (start[order][1:] < end[order][:-1]))
    if clash.size == 0:
        return
    first, second = sorted((int(order[clash[0]]), int(order[clash[0] + 1])))
    b1, b2 = _block_of(counts, first), _block_of(counts, second)
    where = f"block {b1}" if b1 == b2 else f"blocks {b1} and {b2}"
    raise InvalidArgument(
        f"{where}: destination segments [{start[first]}, {end[first]}) and "
        f"[{start[second]}, {end[second]}) of region {rid[first]} overlap; a Load must write "
        "each byte at most once"
    )


def _block_of(counts: list[int], segment: int) -> int:
    """The block that segment number ``segment`` belongs to."""
    return bisect.bisect_right(list(itertools.accumulate(counts)), segment)
