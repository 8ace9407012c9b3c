"""The Cache tier: blocks in a fixed host-memory arena, least-recently-used eviction, read leases.

Bookkeeping (index, LRU order, leases, page allocation) happens on the event loop thread, so it
needs no lock; only byte copies run in the executor. A block is published in the index only after
its bytes are fully copied in, and a block with a live lease (a reader copying out, or write-back
flushing it to a slower tier) is never evicted and its pages never reused: replacing or deleting it
unlinks it at once and frees its pages when the last lease goes.

Above a tier that holds pins (Posix), the Cache is a cache of it for pinned blocks too: a pinned
block whose copy is safe below (written down, or promoted from there) may be evicted, after every
unpinned one. A pinned block the Cache alone holds (its write-down not done, skipped or failed) is
never evicted: each entry knows whether its version is safe below (:attr:`_Entry.below`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from ucm_protocol.errors import ConfigError
from ucm_protocol.host import available_memory
from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.arena import Arena, Extent
from ucm_server.store.base import (
    DEFAULT_CONTEXT,
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    SizeIndex,
    Tier,
    TierContext,
    TierStats,
    failed,
    load_tier_settings,
)
from ucm_server.store.copy_lane import run_copy
from ucm_server.store.copying import IoVec, copy_all, copy_in_order, iov_len
from ucm_server.store.policy import EvictionPolicy, make_policy
from ucm_server.store.spans import SpanItems, copy_spans, keys_of
from ucm_server.store.watch import IndexWatch

INLINE_COPY_BYTES = 512 << 10
"""A batch copy up to this size runs on the event loop thread instead of the executor."""


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The Cache tier's settings; the daemon fills them from ``cache_capacity``, ``cache_page_size``
    and ``cache_prefault``."""

    capacity: int = field(metadata={"size": True})
    """Bytes of host memory in the arena."""
    page_size: int = field(default=64 << 10, metadata={"size": True})
    """Allocation unit of the arena; a block uses whole pages."""
    prefault: bool = False
    """Fault the arena's memory in at ``open`` so storing a block never pays first-touch faults."""
    eviction: str = "lru"
    """The eviction policy by name (:data:`ucm_server.store.policy.POLICIES`: ``lru``, ``arc``)."""


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    size: int
    extents: Sequence[Extent]
    """The block's pages (a tuple for the usual block of one run: it leaves the garbage collector's
    sight, with the tuples in it, where a list stays in it for as long as the block is cached)."""
    stored_at: float
    leases: int = 0
    unlinked: bool = False  # replaced or deleted while leased: free pages when leases reach 0
    below: bool = False
    """This version is safe in a tier below that holds pins (written down, or promoted from one)."""


class Lease:
    """A hold on one cached block: its bytes stay put until :meth:`release`."""

    __slots__ = ("_entry", "_tier", "iov", "size")

    def __init__(self, tier: CacheTier, entry: _Entry, iov: list[memoryview]) -> None:
        self._tier, self.iov, self.size = tier, iov, entry.size
        self._entry: _Entry | None = entry

    @property
    def superseded(self) -> bool:
        """The block was deleted or replaced since this lease was taken."""
        return self._entry is None or self._entry.unlinked

    def release(self) -> None:
        if self._entry is not None:
            self._tier._unlease_many((self._entry,))
            self._entry = None

    def written_down(self) -> None:
        """The leased version is now stored in the tiers below (a pin may then leave the Cache)."""
        if self._entry is not None and not self._entry.unlinked:
            self._entry.below = True


class Reservation:
    """Cache pages taken for one block that is being filled from outside (a device copy)."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry: _Entry | None = entry

    @property
    def size(self) -> int:
        return self._entry.size if self._entry is not None else 0


def check_fits_in_memory(name: str, capacity: int) -> None:
    """Refuse an arena larger than the memory left, before it is mapped.

    ``mmap`` does not refuse one (memory is overcommitted) and the arena is faulted in at start-up
    (``cache_prefault``), so ``cache_capacity: 100GiB`` on a smaller host ended in the OOM killer, and
    a capacity past ``ssize_t`` in an OverflowError traceback."""
    left = available_memory()
    if capacity >= 1 << 63 or (left is not None and capacity > left):
        gib = f"{left / 2**30:.1f} GiB" if left is not None else "unknown"
        raise ConfigError(
            f"{name}: capacity {capacity} bytes ({capacity / 2**30:.1f} GiB, setting cache_capacity) is "
            f"more than the memory available to this process ({gib}); make it smaller"
        )


class CacheTier(Tier):
    """Implements :class:`~ucm_server.store.leasing.Leasing`: the pipeline and the GPU path reach its
    leases, reservations and arena through that capability, not through this class."""

    kind = "Cache"
    persistent = False
    shared = False
    pin_gap = ""

    def __init__(
        self,
        name: str = "Cache",
        *,
        capacity: int,
        page_size: int = 64 << 10,
        executor: Executor | None = None,
        prefault: bool = False,
        eviction: str = "lru",
    ) -> None:
        super().__init__(name)
        check_fits_in_memory(name, capacity)
        self.arena = Arena(capacity, page_size)
        self.policy: EvictionPolicy = make_policy(eviction, self.arena.capacity)
        self._prefault = prefault
        self._index: dict[BlockKey, _Entry] = {}
        """Every block held, by key (a plain dict: the policy keeps the order of use)."""
        self._sizes = SizeIndex()
        self._executor = executor
        self._stats = TierStats(name=name, kind=self.kind, capacity_bytes=self.arena.capacity)
        self._rejected = 0
        self.pins_below = False
        """A tier below holds pins (set by the pipeline): a pinned block safe there may be evicted
        here, after every unpinned one; otherwise the Cache never evicts a pinned block."""

    Settings: ClassVar[type[Any] | None] = CacheSettings

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        """Copies run in the daemon's executor (``context.executor``)."""
        return cls(name, executor=context.executor, **load_tier_settings(cls, name, settings))

    # -- primitives -----------------------------------------------------------------------------------
    async def open(self) -> None:
        if self._prefault:
            self.arena.prefault()

    async def close(self) -> None:
        self._index.clear()
        self._sizes.clear()
        self.policy = make_policy(self.policy.name, self.arena.capacity)
        self.arena.close()

    def watch_index(self, watch: IndexWatch) -> None:
        """KV events (:class:`~ucm_server.store.watch.Watchable`): the size index sees every change."""
        self._sizes.watch = watch
        watch.stored_many(self._sizes.keys())

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        return self._sizes.lookup(keys)

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        return self._sizes.lookup_digests(namespace, digests)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return (await self.read_many([(key, dest)]))[0]

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return (await self.write_many([(key, src)]))[0]

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """All copies of the batch in one executor hop (a hop costs more than a small copy); a span
        batch (:class:`~ucm_server.store.spans.SpanItems`) as one copy by offsets, no view made."""
        if isinstance(items, SpanItems):
            return await self._read_spans(items)
        results, held, pairs = self._hold_reads(items)
        try:
            if pairs:
                await self._copy(pairs, sum(entry.size for _, entry in held))
        finally:
            self._unlease_many([entry for _, entry in held])
        return self._counted(results, held)

    async def _read_spans(self, items: SpanItems) -> list[BlockResult]:
        """:meth:`read_many` of a span batch: each block found at the span's length leased, then the
        arena's pages copied to the spans in one :func:`copy_spans` call."""
        results: list[BlockResult] = [MISSING] * len(items)
        held: list[_Entry] = []
        places: list[int] = []
        index, page = self._index, self.arena.page_size
        if len(items.keys) != len(items.lengths):
            raise ValueError(f"{len(items.keys)} keys for {len(items.lengths)} lengths")
        entries = list(map(index.get, items.keys))
        if all(entries) and [e.size for e in entries] == items.lengths:  # type: ignore[union-attr]
            # The usual batch, every block here at its size: a pass a step, no branch per block.
            held = entries  # type: ignore[assignment]  # no None in it
            places = list(range(len(held)))
        else:
            for i, (entry, want) in enumerate(zip(entries, items.lengths, strict=True)):
                if entry is None:
                    self._stats.misses += 1
                elif want != entry.size:
                    results[i] = failed(f"length mismatch: block is {entry.size} bytes, destination {want}")
                else:
                    held.append(entry)
                    places.append(i)
        for entry in held:
            entry.leases += 1
        runs = [entry.extents for entry in held]
        scattered = any(len(extents) > 1 for extents in runs)
        starts = [extents[0][0] * page for extents in runs]
        """Where each held block's first page is in the arena."""
        every = len(held) == len(items)
        found = items.keys if every else [key for key in items.keys if key in index]
        self.policy.touched_many(found)  # every block found is a use, read or not
        try:
            if held:
                at = items.offsets if every else [items.offsets[i] for i in places]
                lengths = items.lengths if every else [items.lengths[i] for i in places]
                if scattered:
                    starts, at, lengths = self._scattered_spans(held, at)
                await self._copy_spans(items.view, at, self.arena.memory, starts, lengths)
        finally:
            self._unlease_many(held)
        return self._count_reads(results, places, sum(items.lengths if every else (e.size for e in held)))

    async def read_in_order(
        self, items: Sequence[tuple[BlockKey, IoVec]], report: Callable[[int], None]
    ) -> list[BlockResult] | None:
        """Copy the batch segment by segment of the destinations (:func:`copy_in_order`), calling
        ``report(k)`` once the first ``k`` segments of every block are in place; ``None``, with
        nothing copied, unless every block is here at the destination's size (the caller then
        reads the usual way, so a count never covers a block still to be read from elsewhere)."""
        results, held, pairs = self._hold_reads(items)
        try:
            if len(held) < len(items):
                return None
            if sum(entry.size for _, entry in held) <= INLINE_COPY_BYTES:
                copy_in_order(pairs, report)
            else:
                await asyncio.get_running_loop().run_in_executor(self._executor, copy_in_order, pairs, report)
        finally:
            self._unlease_many([entry for _, entry in held])
        return self._counted(results, held)

    def _hold_reads(
        self, items: Sequence[tuple[BlockKey, IoVec]]
    ) -> tuple[list[BlockResult], list[tuple[int, _Entry]], list[tuple[IoVec, IoVec]]]:
        """Results so far (misses, size mismatches); every block to copy leased (:meth:`_hold`), as
        ``(its place in items, its entry)``; and the ``(destination, arena views)`` pairs to copy.
        A batch holds its blocks with no :class:`Lease` object each: the caller releases them all
        at once (:meth:`_unlease_many`)."""
        results: list[BlockResult] = [MISSING] * len(items)
        held: list[tuple[int, _Entry]] = []
        pairs: list[tuple[IoVec, IoVec]] = []
        get, touched, hold = self._index.get, self.policy.touched, self._hold
        for i, (key, dest) in enumerate(items):
            entry = get(key)
            if entry is None:
                self._stats.misses += 1
                continue
            touched(key)
            want = dest[0].nbytes if len(dest) == 1 else iov_len(dest)
            if want != entry.size:
                results[i] = failed(f"length mismatch: block is {entry.size} bytes, destination {want}")
                continue
            held.append((i, entry))
            pairs.append((dest, hold(entry)))
        return results, held, pairs

    def _counted(self, results: list[BlockResult], held: list[tuple[int, _Entry]]) -> list[BlockResult]:
        """:meth:`_count_reads` of the blocks ``held`` as ``(place, entry)``."""
        return self._count_reads(results, [i for i, _ in held], sum(entry.size for _, entry in held))

    def _count_reads(self, results: list[BlockResult], places: list[int], nbytes: int) -> list[BlockResult]:
        """The blocks copied (at ``places`` of the batch, ``nbytes`` in all) are read: OK, and
        counted as hits; returns ``results``."""
        if len(places) == len(results):  # the usual batch: every block read
            results = [OK] * len(results)
        else:
            for i in places:
                results[i] = OK
        self._stats.hits += len(places)
        self._stats.read_bytes += nbytes
        return results

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Pages for every block, one copy of the batch, then every block published in order. The
        per-block steps are spelled out here (a 64 KiB block's bookkeeping cost as much as a third of
        its copy when it went through a method call per step). A span batch
        (:class:`~ucm_server.store.spans.SpanItems`) is copied by offsets, no view made a block."""
        spans = items if isinstance(items, SpanItems) else None
        keys = keys_of(items)
        if spans is not None:
            sizes = spans.lengths
        else:
            sizes = [src[0].nbytes if len(src) == 1 else iov_len(src) for _, src in items]
        results: list[BlockResult] = [OK] * len(items)
        staged: list[_Entry] = []
        refused: list[int] = []
        starts: list[int] = []
        """Where each staged block's first page is in the arena."""
        scattered = False
        now = time.time()  # one clock read per batch
        arena = self.arena
        page, free = arena.page_size, arena.free_list
        self.make_room(sizes)
        for i, key in enumerate(keys):
            size = sizes[i]
            if size <= page and free:  # one page, free: the usual small block
                first = free.pop()
                extents: Sequence[Extent] = ((first, 1),)
            else:
                got = self._allocate(size)
                if got is None:
                    results[i] = failed(
                        f"cache full: {size} bytes needed, {arena.free_pages * page} free "
                        f"and every cached block is in use or pinned"
                    )
                    self._rejected += 1  # not an I/O error: the pipeline writes such blocks further down
                    refused.append(i)
                    continue
                extents = got
                first = got[0][0]
                scattered = scattered or len(got) > 1
            staged.append(_Entry(key, size, extents, now, 1))  # leased: not evictable while being filled
            starts.append(first * page)
        gone = set(refused)
        taken = [i for i in range(len(items)) if i not in gone] if refused else range(len(items))
        nbytes = sum(entry.size for entry in staged) if refused else sum(sizes)
        try:
            if spans is not None and staged:
                at = [spans.offsets[i] for i in taken] if refused else spans.offsets
                lengths = [sizes[i] for i in taken] if refused else sizes
                if scattered:
                    starts, at, lengths = self._scattered_spans(staged, at)
                await self._copy_spans(arena.memory, starts, spans.view, at, lengths)
            elif staged:
                views = arena.views
                pairs = [(views(e.extents, e.size), items[i][1]) for e, i in zip(staged, taken, strict=True)]
                await self._copy(pairs, nbytes)
        except BaseException:
            for entry in staged:
                arena.free(entry.extents)
            raise
        if refused or not isinstance(keys, list):
            self._publish_many(staged)
        else:
            self._publish_many(staged, keys, sizes)
        self._stats.write_bytes += nbytes
        return results

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        return sum(1 for k in keys if self._unlink(k))

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        for entry in list(self._index.values()):
            if namespace is None or entry.key.namespace == namespace:
                yield BlockInfo(key=entry.key, size=entry.size, tier=self.name, stored_at=entry.stored_at)

    def footprint(self, size: int) -> int:
        """Whole pages."""
        return self.arena.pages_for(size) * self.arena.page_size

    async def info(self, key: BlockKey) -> BlockInfo | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        return BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)

    def stats(self) -> TierStats:
        s = self._stats
        s.blocks = len(self._index)
        s.bytes = sum(e.size for e in self._index.values())
        s.extra = {
            "leased_blocks": float(sum(1 for e in self._index.values() if e.leases)),
            "free_bytes": float(self.arena.free_pages * self.arena.page_size),
            "rejected_writes": float(self._rejected),
            "prefault_pending_bytes": float(self.arena.prefault_pending),
        }
        return TierStats(**{f: getattr(s, f) for f in s.__slots__})

    async def evict(self, nbytes: int) -> int:
        freed = 0
        for entry in self._victims():
            if freed >= nbytes:
                break
            freed += entry.size
            self._unlink(entry.key, evicted=True)
            self._stats.evictions += 1
        return freed

    def _victims(self) -> Iterator[_Entry]:
        """Unleased blocks in eviction order (the policy's, under the retention rules: pinned
        never), then, when a tier below holds pins, the pinned blocks safe there (the policy's
        order); safe to unlink while iterating. A pinned block the Cache alone holds is never one."""
        index: dict[bytes, _Entry] = self._index  # type: ignore[assignment]  # BlockKey is bytes
        candidates = ((k, e) for k in self.policy.order() if (e := index.get(k)) is not None)
        for _, entry in self.eviction_order(candidates, index.get):
            if entry.leases == 0 and self._index.get(entry.key) is entry:
                yield entry
        if not self.pins_below:
            return
        for key in self.policy.order():  # every unpinned block is gone: the pinned ones safe below
            pinned = index.get(key)
            if pinned is not None and pinned.below and pinned.leases == 0:
                yield pinned

    # -- leases ---------------------------------------------------------------------------------------
    def lease(self, key: BlockKey, *, read: bool = False) -> Lease | None:
        """Hold a cached block so it can be read (or flushed) in place; ``read``: a use the
        eviction policy hears of (a write-down's lease is not one)."""
        entry = self._index.get(key)
        if entry is None:
            return None
        if read:
            self.policy.touched(key)
        return Lease(self, entry, self._hold(entry))

    def _hold(self, entry: _Entry) -> list[memoryview]:
        """Lease ``entry`` (its pages are neither evicted nor reused until :meth:`_unlease_many`)
        and return its bytes as arena views: every lease, one block's or a batch's, takes this."""
        entry.leases += 1
        extents = entry.extents
        if len(extents) == 1:  # the usual block: one run of pages
            at = extents[0][0] * self.arena.page_size
            return [self.arena.memory[at : at + entry.size]]
        return self.arena.views(extents, entry.size)

    def _unlease_many(self, entries: Iterable[_Entry]) -> None:
        """Release one lease of each entry; an entry unlinked meanwhile frees its pages with its last."""
        free = self.arena.free
        for entry in entries:
            entry.leases -= 1
            if entry.leases == 0 and entry.unlinked:
                free(entry.extents)

    # -- device copies (ucm_server.gpu) ------------------------------------------------------------
    # A GPU copy cannot go through memoryviews: it DMAs into the arena's pages by address. A load
    # leases the block and reads ``host_runs``; a dump reserves pages, fills them, then commits.
    def lease_for_read(self, key: BlockKey) -> Lease | None:
        """:meth:`lease`, counted as a hit when found (a miss is counted by the read that follows)."""
        lease = self.lease(key, read=True)
        if lease is not None:
            self._stats.hits += 1
            self._stats.read_bytes += lease.size
        return lease

    def host_runs(self, held: Lease | Reservation) -> list[tuple[int, int]]:
        """The held block's bytes as (address, length) runs of the arena."""
        entry = held._entry
        if entry is None:
            raise ValueError("the lease or reservation was already released")
        return self.arena.runs(entry.extents, entry.size)

    def reserve(self, key: BlockKey, size: int) -> Reservation | None:
        """Pages for a block whose bytes someone else will copy in; ``None`` if the Cache is full.

        Until :meth:`commit` the block is invisible to readers and its pages cannot be evicted."""
        extents = self._allocate(size)
        if extents is None:
            self._rejected += 1
            return None
        entry = _Entry(key=key, size=size, extents=extents, stored_at=time.time())
        entry.leases = 1
        return Reservation(entry)

    def views(self, reservation: Reservation) -> list[memoryview]:
        """A reservation's pages as memoryviews, for a tier to read a block into (promotion)."""
        entry = reservation._entry
        if entry is None:
            raise ValueError("the reservation was already committed or aborted")
        return self.arena.views(entry.extents, entry.size)

    def holds(self, key: BlockKey) -> bool:
        """Whether the block is cached now (no LRU touch)."""
        return key in self._index

    def keeps(self, key: bytes) -> bool:
        """Whether the Cache holds ``key`` in a version not known to be safe in a tier below that
        holds pins: while pinned, such a copy is never evicted (it may be the only one)."""
        entry = self._index.get(key)  # type: ignore[call-overload]  # a BlockKey is its bytes
        return entry is not None and not entry.below

    def set_below(self, key: BlockKey, below: bool) -> None:
        """Whether the cached version is safe in a tier below that holds pins: promoted from one
        (True), or lost there, evicted while unpinned (False: kept here while pinned)."""
        entry = self._index.get(key)
        if entry is not None:
            entry.below = below

    def commit(self, reservation: Reservation, *, below: bool = False) -> None:
        """Publish a filled reservation (replacing any older version of the key); ``below``: it
        was read from a tier below that holds pins (a promotion), so it is safe there."""
        entry, reservation._entry = reservation._entry, None
        if entry is None:
            raise ValueError("reservation already committed or aborted")
        entry.below = below
        self._publish_many((entry,))
        self._stats.write_bytes += entry.size

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation's pages back (its copy failed)."""
        entry, reservation._entry = reservation._entry, None
        if entry is not None:
            self.arena.free(entry.extents)

    # -- internals ------------------------------------------------------------------------------------
    def _publish_many(
        self, entries: Sequence[_Entry], keys: list[BlockKey] | None = None, sizes: list[int] | None = None
    ) -> None:
        """Make filled entries visible to readers, in order, their fillers' leases ended; each one
        replaces any older version of its key (:meth:`_drop`, the policy hearing of it as a use).
        The index and the policy change per block; the size index and its watchers hear of the
        batch in one call (the blocks' bookkeeping was a third of a 64 KiB dump's time). ``keys``
        and ``sizes``: the entries', where the caller has them as lists already."""
        index, get = self._index, self._index.get
        replaced: list[_Entry] = []
        for entry in entries:
            key = entry.key
            old = get(key)
            if old is not None:
                replaced.append(old)
            entry.leases = 0
            index[key] = entry
        if keys is None or sizes is None:
            keys, sizes = [entry.key for entry in entries], [entry.size for entry in entries]
        self.policy.inserted_many(keys, sizes)
        if replaced:
            self._drop(replaced, replaced=True)
        self._sizes.add_many(keys, sizes)

    def _unlink(self, key: BlockKey, *, evicted: bool = False) -> bool:
        """Take ``key`` out of the index (its pages freed once unleased); ``evicted``: for room."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._drop([entry], evicted=evicted)
        return True

    def _drop(self, entries: list[_Entry], *, evicted: bool = False, replaced: bool = False) -> None:
        """Entries just taken out of the index: the policy (unless ``replaced``) and the size index
        hear of it, and each one's pages are freed, or once its last lease ends. ``replaced``: the
        new versions are published next (:meth:`_publish_many`), which sets their sizes."""
        if replaced:
            self._sizes.replacing([entry.key for entry in entries])
        else:
            for entry in entries:
                self.policy.removed(entry.key, evicted=evicted)
            self._sizes.discard_many([entry.key for entry in entries])
        free = self.arena.free
        for entry in entries:
            if entry.leases:
                entry.unlinked = True
            else:
                free(entry.extents)

    def _allocate(self, size: int) -> list[Extent] | None:
        """Pages for a new block, evicting least-recently-used unleased blocks as needed."""
        need = self.arena.pages_for(size)
        if need > self.arena.npages:
            return None
        self._evict_until_free(need)
        return self.arena.allocate(size)

    def make_room(self, sizes: Sequence[int]) -> None:
        """Evict now what a batch of blocks of ``sizes`` will need, in one walk of the eviction
        order: the blocks at its front that cannot go (leased: awaiting write-back, being read) are
        walked past once per batch, not once per block. Measured: with 1,500 blocks awaiting
        write-back, a 16-block dump spent 2.5 ms of the event loop walking past them, block by block.
        The same blocks go, in the same order, as the batch's allocations would evict them."""
        most = self.arena.npages
        if sizes and isinstance(sizes, list) and sizes.count(sizes[0]) == len(sizes):  # the usual batch
            each = self.arena.pages_for(sizes[0])
            self._evict_until_free(min(each * len(sizes) if each <= most else 0, most))
            return
        need = [n for n in map(self.arena.pages_for, sizes) if n <= most]  # a larger one is refused
        self._evict_until_free(min(sum(need), most))

    def _evict_until_free(self, need: int) -> None:
        if self.arena.free_pages >= need:
            return
        for entry in self._victims():
            self._unlink(entry.key, evicted=True)
            self._stats.evictions += 1
            if self.arena.free_pages >= need:
                return

    async def _copy(self, pairs: Sequence[tuple[IoVec, IoVec]], nbytes: int) -> None:
        """Copy a batch: a small one right here on the event loop (a copy of a few hundred KiB takes
        tens of microseconds, less than an executor hop, and must not queue behind the disk work that
        fills the executor on a loaded node); a large one in the executor, off the loop."""
        if nbytes <= INLINE_COPY_BYTES:
            copy_all(pairs)
            return
        await run_copy(self._executor, copy_all, pairs)

    def _scattered_spans(
        self, entries: list[_Entry], at: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """Entry ``k``'s pages against the span starting at ``at[k]`` of a client buffer, as
        ``(arena offsets, buffer offsets, lengths)``, one span a run of pages (blocks whose pages
        are not one run: the usual block's span is the block's)."""
        page = self.arena.page_size
        pages: list[int] = []
        runs: list[int] = []
        lengths: list[int] = []
        for entry, start in zip(entries, at, strict=True):
            left = entry.size
            for first, npages in entry.extents:
                n = min(left, npages * page)
                pages.append(first * page)
                runs.append(start + entry.size - left)
                lengths.append(n)
                left -= n
        return pages, runs, lengths

    async def _copy_spans(
        self, dst: memoryview, dst_at: list[int], src: memoryview, src_at: list[int], lengths: list[int]
    ) -> None:
        """:func:`copy_spans`, where :meth:`_copy` would copy the same bytes."""
        if sum(lengths) <= INLINE_COPY_BYTES:
            copy_spans(dst, dst_at, src, src_at, lengths)
            return
        await run_copy(self._executor, copy_spans, dst, dst_at, src, src_at, lengths)
