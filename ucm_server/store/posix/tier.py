"""The Posix tier: blocks in files under a sharded directory tree, durable and self-checking.

:class:`PosixTier` is the async face: it keeps the in-memory index (what is stored, in LRU order)
and decides, while the blocking work on files runs in its executor as module functions. The rooms
of the package, each one job:

- :mod:`~ucm_server.store.posix.layout`: where a block lives (and where older releases put it);
- :mod:`~ucm_server.store.posix.files`: reading, writing, removing and quarantining block files;
- :mod:`~ucm_server.store.posix.group_commit`: a batch written as staged files and one commit;
- :mod:`~ucm_server.store.posix.room`: the capacity as a bound (room reserved before a write);
- :mod:`~ucm_server.store.posix.recovery`: the index after a start (snapshots, then the files);
- :mod:`~ucm_server.store.posix.packs`: many small blocks in one file (blocks up to
  ``pack_max_block_bytes``, 64 KiB by default, written together);
- :mod:`~ucm_server.store.posix.block_index`, :mod:`~ucm_server.store.posix.confined`: the index,
  and file access that never follows what is planted in the tree.

Each file is a header of :mod:`ucm_server.store.format` followed by the payload. A file whose header
or size is wrong, or whose header claims a payload above ``max_block_bytes``, is moved to
``<root>/.quarantine/`` and never served; so is one whose payload checksum fails on read.

A file tier built on this one (DS3FS) states what it changes in a :class:`Profile`.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar, cast

from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.base import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_BLOCK_BYTES,
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    Tier,
    TierContext,
    TierStats,
    bounded_gather,
    failed,
    load_tier_settings,
)
from ucm_server.store.copying import IoVec, iov_len
from ucm_server.store.format import CorruptBlock, UnsupportedFormat
from ucm_server.store.posix import files, group_commit
from ucm_server.store.posix.block_index import BlockIndex, Stamp
from ucm_server.store.posix.files import Disk
from ucm_server.store.posix.group_commit import GROUP_BLOCKS, GROUP_BYTES, PackStaged
from ucm_server.store.posix.layout import Layout, block_key
from ucm_server.store.posix.packs import Outcome, PackedStamp, PackTable, read_jobs
from ucm_server.store.posix.recovery import INDEX_STATS, Recovery
from ucm_server.store.posix.room import Room
from ucm_server.store.posix.settings import (
    DEFAULT_PACK_MAX_BLOCK_BYTES,
    DEFAULT_PROFILE,
    Entry,
    PosixSettings,
    Profile,
)
from ucm_server.store.watch import IndexWatch

T = TypeVar("T")
R = TypeVar("R")

READ_GROUP_BLOCKS = 256
"""Most blocks one executor job of a batched read reads (a whole chunk of small blocks, see
:data:`ucm_server.chunks.CHUNK_BLOCKS`). Measured on 2 cores with 4,096 blocks of 4 KiB: one job
per 256 blocks 6.9 µs a block, jobs of 64 running 16 at a time 16.5 µs: the Python between a
block's system calls needs the GIL, so small blocks read in parallel threads mostly wait for it
(large ones still read in parallel: a job ends at :data:`GROUP_BYTES`)."""


class PosixTier(Tier):
    kind = "Posix"
    persistent = True
    shared = False
    pin_gap: ClassVar[str] = ""
    max_concurrency = 16
    Settings: ClassVar[type[Any] | None] = PosixSettings

    def __init__(
        self,
        name: str = "Posix",
        *,
        roots: Sequence[Path],
        capacity: int = 0,
        durable: bool = True,
        direct_io: bool = True,
        index_wait_s: float = 0.2,
        direct_min_bytes: int = 256 << 10,
        snapshot_interval_s: float = 60.0,
        pack_max_block_bytes: int = DEFAULT_PACK_MAX_BLOCK_BYTES,
        executor: Executor | None = None,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        profile: Profile = DEFAULT_PROFILE,
    ) -> None:
        """``max_block_bytes``: a stored header claiming a larger payload is corrupt (quarantined,
        never allocated for), whatever its CRC says."""
        super().__init__(name)
        if not roots:
            raise ValueError("PosixTier needs at least one root directory")
        if not snapshot_interval_s >= 0:
            raise ValueError(f"snapshot_interval_s: must be 0 (off) or more, got {snapshot_interval_s}")
        if not 0 <= pack_max_block_bytes <= GROUP_BYTES:
            raise ValueError(
                f"pack_max_block_bytes: must be 0 (off) to {GROUP_BYTES} bytes, got {pack_max_block_bytes}"
            )
        self.profile = profile
        self.layout = Layout(roots, flat=profile.flat_layout)
        self.roots = self.layout.roots
        self.capacity = capacity
        self.index_wait_s = index_wait_s
        self.pack_max_block_bytes = pack_max_block_bytes
        self._executor = executor
        self._index = BlockIndex()
        self._packs = PackTable()
        """Pack files holding live blocks (:mod:`ucm_server.store.posix.packs`)."""
        self._stats = TierStats(name=name, kind=self.kind, capacity_bytes=capacity)
        self.disk = Disk(
            name, self.layout, durable, direct_io, direct_min_bytes, max_block_bytes, self._stats
        )
        self.recovery = Recovery(
            self.disk,
            self._index,
            self._packs,
            run=self._run,
            unindex=self._unindex,
            snapshot_interval_s=snapshot_interval_s,
            index_wait_s=index_wait_s,
            capacity=capacity,
        )
        self.snapshots = self.recovery.snapshots
        self.room = Room(capacity, lambda: self._index.bytes + self._packs.dead_bytes, self.evict)
        """The capacity as a bound: room reserved by each write before it writes."""

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        """File work runs in ``context.executor``; headers above ``context.max_block_bytes`` are corrupt."""
        values = load_tier_settings(cls, name, settings)
        return cls(name, executor=context.executor, max_block_bytes=context.max_block_bytes, **values)

    @property
    def max_block_bytes(self) -> int:
        return self.disk.max_block_bytes

    @max_block_bytes.setter
    def max_block_bytes(self, value: int) -> None:
        self.disk.max_block_bytes = value

    @property
    def durable(self) -> bool:
        return self.disk.durable

    @property
    def direct_io(self) -> bool:
        return self.disk.direct_io

    @property
    def direct_min_bytes(self) -> int:
        return self.disk.direct_min_bytes

    def path_of(self, key: BlockKey) -> Path:
        """Where ``key``'s block is written (and read first)."""
        return self.layout.path_of(key)

    def legacy_path_of(self, key: BlockKey) -> Path:
        """Where format versions 1 and 2 put ``key``'s block: one directory level deeper."""
        return self.layout.legacy_path_of(key)

    # -- life cycle -----------------------------------------------------------------------------------
    async def open(self) -> None:
        if self.profile.index_snapshots:
            await self.recovery.start()
        else:
            await self.recovery.scan_before_serving(self.profile.temp_grace_s)

    @property
    def indexing(self) -> bool:
        return self.recovery.phase in ("snapshot", "scan")

    async def indexed(self) -> None:
        await self.recovery.indexed()

    async def close(self) -> None:
        """Stop any re-adoption; after a complete index, leave a snapshot the next start trusts."""
        await self.recovery.stop(snapshot=self.profile.index_snapshots)

    def watch_index(self, watch: IndexWatch) -> None:
        """KV events (:class:`~ucm_server.store.watch.Watchable`): the index sees every change."""
        self._index.watch = watch
        watch.stored_many(self._index.columns()[0])

    # -- lookups --------------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        found = self._index.lookup(keys)
        if self._index.adopting and None in found:  # not indexed yet, perhaps: ask the files
            await self._probe([key for key, size in zip(keys, found, strict=True) if size is None])
            found = self._index.lookup(keys)
        return found

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        if self.shared:  # a subclass on a shared mount looks beyond its own index (see its lookup)
            return await super().lookup_digests(namespace, digests)
        found = self._index.lookup_digests(namespace, digests)
        if self._index.adopting and None in found:  # not indexed yet, perhaps: ask the files
            unknown = [BlockKey(namespace, digests[n]) for n, size in enumerate(found) if size is None]
            await self._probe(unknown)
            found = self._index.lookup_digests(namespace, digests)
        return found

    # -- reads ----------------------------------------------------------------------------------------
    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        (result,) = await self._read([(key, dest)], checked=False)
        assert result is not None  # only a checked read answers "not matched"
        return result

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        if not self.profile.client_reads:
            return None
        (result,) = await self._read([(key, dest)], checked=True)
        return result

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        return [r if r is not None else failed("not read") for r in await self._read(items, checked=False)]

    async def read_checked_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult | None]:
        if not self.profile.client_reads:
            return await super().read_checked_many(items)
        return await self._read(items, checked=True)

    async def _read(
        self, items: Sequence[tuple[BlockKey, IoVec]], *, checked: bool
    ) -> list[BlockResult | None]:
        """Read blocks into ``items``' destinations: each found in the index (:meth:`_entries`),
        read in executor jobs of many blocks (:meth:`_fetch`), answered (:meth:`_answer`). A block
        stored again or deleted while it was read is read again from where it is now.
        ``checked``: straight into the caller's memory, None where the bytes there did not match."""
        if not isinstance(items, list):  # a span batch makes its pairs on demand: once each here,
            items = list(items)  # not once per look (index, pack grouping, answer)
        results: list[BlockResult | None] = [MISSING] * len(items)
        todo: Sequence[int] = range(len(items))
        while todo:
            entries = await self._entries(items, todo, results)
            outcomes = await self._fetch(items, entries, checked)
            todo = await self._answer(items, entries, outcomes, results)
        return results

    async def _entries(
        self, items: Sequence[tuple[BlockKey, IoVec]], todo: Sequence[int], results: list[BlockResult | None]
    ) -> dict[int, Stamp]:
        """The index's entry of each block ``todo`` names whose destination has its size; the others
        answered (missing, or a length mismatch). While re-adopting, a key not indexed yet is looked
        for on disk (:meth:`_probe`), so a Load never waits for the scan."""
        index = self._index
        if index.adopting:
            await self._probe([items[i][0] for i in todo if items[i][0] not in index])
        asked = list(map(items.__getitem__, todo))
        found = index.get_many([key for key, _ in asked])
        wants: list[int | None] = [dest[0].nbytes if len(dest) == 1 else iov_len(dest) for _, dest in asked]
        if found == wants:  # every block indexed, every destination its size (a stamp is the size)
            return dict(zip(todo, cast(list[Stamp], found), strict=True))
        entries: dict[int, Stamp] = {}
        for i, entry, want in zip(todo, found, wants, strict=True):
            if entry is None:
                self._stats.misses += 1
                results[i] = MISSING
            elif want != entry:
                results[i] = failed(f"length mismatch: block is {entry} bytes, destination {want}")
            else:
                entries[i] = entry
        return entries

    async def _fetch(
        self, items: Sequence[tuple[BlockKey, IoVec]], entries: dict[int, Stamp], checked: bool
    ) -> dict[int, Outcome]:
        """Read the blocks of ``entries`` from where each is: block files in jobs of up to
        :data:`READ_GROUP_BLOCKS` (by key, so a job's blocks share few directories), packed blocks
        by pack (:func:`~ucm_server.store.posix.packs.read_jobs`); ``max_concurrency`` jobs at a time.
        Each block's outcome: True (verified), False (``checked``: did not match), or its error."""
        singles = [i for i, e in entries.items() if not isinstance(e, PackedStamp)]
        singles.sort(key=lambda i: items[i][0])
        packed = [(i, e) for i, e in entries.items() if isinstance(e, PackedStamp)]
        groups = self._groups([items[i] for i in singles], READ_GROUP_BLOCKS)
        pack_jobs = read_jobs([(items[i][0], items[i][1], e) for i, e in packed], READ_GROUP_BLOCKS)
        jobs: list[Coroutine[Any, Any, Any]] = [
            self._run(files.read_group, self.disk, [items[i] for i in singles[a:b]], checked)
            for a, b in groups
        ]
        jobs += [self._run(files.read_pack_job, self.disk, job, checked) for job in pack_jobs]
        done: list[Any] = (
            [await jobs[0]] if len(jobs) == 1 else await bounded_gather(self.max_concurrency, jobs)
        )
        outcomes: dict[int, Outcome] = {}
        for (a, b), got in zip(groups, done, strict=False):
            outcomes.update(zip(singles[a:b], got, strict=True))
        for job, got in zip(pack_jobs, done[len(groups) :], strict=True):
            for (_, which, *_), read in zip(job, got, strict=True):
                outcomes.update(zip([packed[n][0] for n in which], read, strict=True))
        if len(outcomes) < len(entries):  # packed blocks no longer in their packs (deleted meanwhile)
            for i in entries.keys() - outcomes.keys():
                outcomes[i] = FileNotFoundError(errno.ENOENT, "not in its pack")
        return outcomes

    async def _answer(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        entries: dict[int, Stamp],
        outcomes: dict[int, Outcome],
        results: list[BlockResult | None],
    ) -> list[int]:
        """Each read block's result (:meth:`_read_result`); the blocks to read again: a failed read
        whose key was stored again or deleted while it ran is stale, not a fault (its old place may
        be gone: a block moved into or out of a pack, its pack record retired), so nothing is
        forgotten or quarantined for it."""
        index = self._index
        ok = [i for i, outcome in outcomes.items() if outcome is True]  # the common case, in C-level steps
        index.touch([items[i][0] for i in ok])
        for i in ok:
            results[i] = OK
        self._stats.hits += len(ok)
        self._stats.read_bytes += sum([entries[i] for i in ok])
        if len(ok) == len(entries):
            return []
        again: list[int] = []
        for i, entry in entries.items():
            key, outcome = items[i][0], outcomes[i]
            if outcome is True:
                continue
            if outcome is not False and index.get(key) is not entry:
                if key in index:
                    again.append(i)
                else:
                    self._stats.misses += 1
                    results[i] = MISSING
                continue
            results[i] = await self._read_result(
                key, outcome, entry.size, packed=isinstance(entry, PackedStamp)
            )
        return again

    async def _probe(self, keys: list[BlockKey]) -> None:
        """While the index is re-adopted, the blocks of ``keys`` it lacks are looked for on disk
        (their headers checked) and adopted where found, so a Lookup or a Load never waits for the
        scan, nor finds a stored block missing; a key stored or deleted since start-up is what the
        index says."""
        touched = self._index.touched
        keys = [key for key in keys if touched is not None and key not in touched]
        if not keys:
            return
        found = await self._run(files.probe_files, self.disk, keys)
        touched = self._index.touched
        for key, hit in zip(keys, found, strict=True):
            if hit is not None and touched is not None and key not in touched:
                self._index.adopt(key, *hit)
        if None in found and not self.recovery.packs_adopted.is_set():
            await self.recovery.packs_adopted.wait()  # the rest may be in a pack not read yet

    async def _read_result(
        self, key: BlockKey, outcome: Outcome, size: int, *, packed: bool = False
    ) -> BlockResult | None:
        """What one block's read means for the caller and the tier (one place for the single-block
        and the batched reads): True read (and verified), False read but not matching in the
        caller's memory (None: read it again through daemon memory), or the error it raised.
        A corrupt block in a pack (``packed``) is not moved (its pack holds others) but dies in the
        index and on disk (its header zeroed): never served again."""
        if outcome is True:
            self._index.move_to_end(key)
            self._stats.hits += 1
            self._stats.read_bytes += size
            return OK
        if outcome is False:
            return None
        if isinstance(outcome, FileNotFoundError):
            self._forget(key, tombstone=False)  # evicted or deleted under us
            self._stats.misses += 1
            return MISSING
        if isinstance(outcome, UnsupportedFormat):
            self._forget(key)  # not ours to read, nor to quarantine
            return failed(f"{self.name}: {outcome}")
        if isinstance(outcome, CorruptBlock):
            if packed:
                self._forget(key)
                await self._retire()
                self._stats.corrupt += 1
                files.log.error(
                    "posix tier %s: block %s in a pack is corrupt, dropped: %s", self.name, key.hex(), outcome
                )
            else:
                await self._quarantine(key, str(outcome))
            return failed(f"corrupt block in {self.name}: {outcome}")
        self._stats.errors += 1
        return failed(f"{self.name} read error: {outcome.strerror or outcome}")

    # -- writes ---------------------------------------------------------------------------------------
    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        size = iov_len(src)
        if self.capacity and size > self.capacity:
            return failed(f"block of {size} bytes exceeds {self.name} capacity {self.capacity}")
        reserved = await self.room.reserve(size) if self.capacity else 0
        if reserved < size and self.capacity:
            self.room.release(reserved)
            return failed(self.room.full(self.name, size))
        try:
            direct = await self._run(files.write_file, self.disk, key, src)
        except OSError as exc:
            self._stats.errors += 1
            return failed(f"{self.name} write error: {exc.strerror or exc}")
        finally:
            self.room.release(reserved)  # the block is indexed below, with no await in between
        self._forget(key)
        self._remember(key, Entry(size=size, stored_at=time.time()))
        self._stats.write_bytes += size
        self.disk.count("direct_writes" if direct else "buffered_writes")  # an operator sees O_DIRECT at work
        await self._retire()
        return OK

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Write a batch in a few executor jobs of many blocks each, with group commit.

        Per-block costs dominate small blocks, so a job writes :data:`GROUP_BLOCKS` blocks (up to
        :data:`GROUP_BYTES`) and reuses each directory's descriptor; jobs run ``max_concurrency`` at
        a time. Durable tiers commit as a group (:mod:`~ucm_server.store.posix.group_commit`):
        a batch costs two syncs per root, not two fsyncs per block, and a block visible after a
        crash is still always complete (its data was durable before its name was).
        """
        if len(items) < 2:
            return [await self.write_from(k, s) for k, s in items]
        results: list[BlockResult] = [OK] * len(items)
        sizes = [iov_len(src) for _, src in items]
        todo: list[int] = []
        for i, size in enumerate(sizes):
            if self.capacity and size > self.capacity:
                results[i] = failed(f"block of {size} bytes exceeds {self.name} capacity {self.capacity}")
            else:
                todo.append(i)
        reserved = 0
        if self.capacity and todo:
            fits, reserved = await self.room.admit(sizes, todo)
            for i in set(todo).difference(fits):
                results[i] = failed(self.room.full(self.name, sizes[i]))
            todo = fits
        group = self.durable and group_commit.SYNCFS is not None
        todo.sort(key=lambda i: items[i][0])  # by namespace and key: a job's blocks share few directories
        packed = self._packable(items, sizes, todo)
        in_packs = set(packed)
        singles = [i for i in todo if i not in in_packs] if packed else todo
        try:
            file_outcomes, pack_outcomes = await asyncio.gather(
                self._stage(group_commit.stage_group, [items[i] for i in singles], group),
                self._stage(group_commit.stage_packs, [items[i] for i in packed], group),
            )
            by_item = dict(zip(singles, file_outcomes, strict=True))
            by_item.update(zip(packed, pack_outcomes, strict=True))
            outcomes = [by_item[i] for i in todo]
            if group:
                outcomes = await group_commit.commit(self._run, self.disk, outcomes)
        finally:
            self.room.release(reserved)  # the blocks are indexed below, with no await in between
        stale: list[Path] = []
        now = time.time()
        for i, outcome in zip(todo, outcomes, strict=True):
            key = items[i][0]
            if isinstance(outcome, BaseException):
                self._stats.errors += 1
                text = outcome.strerror if isinstance(outcome, OSError) and outcome.strerror else outcome
                results[i] = failed(f"{self.name} write error: {text}")
                continue
            old = self._forget(key)
            if isinstance(outcome, PackStaged):
                pack = self._packs.register(outcome.pack)
                self._index.put(key, pack.stamp(sizes[i], now))
                if old is not None and not isinstance(old, PackedStamp):  # its block file is older now
                    stale += self.layout.file_paths_of(key)
                kind = "packed_writes"
            else:
                self._remember(key, Entry(size=sizes[i], stored_at=now))
                kind = "direct_writes" if outcome.direct else "buffered_writes"
            self._stats.write_bytes += sizes[i]
            self.disk.count(kind)
        if stale:
            await self._run(files.unlink_all, self.disk, stale)
        await self._retire()
        return results

    def _packable(
        self, items: Sequence[tuple[BlockKey, IoVec]], sizes: list[int], todo: list[int]
    ) -> list[int]:
        """The blocks of a batch that go into packs: at most ``pack_max_block_bytes`` (not empty), a
        key only once in the batch, and at least two of them (else one file each, as always)."""
        limit = self.pack_max_block_bytes
        if not limit:
            return []
        small = [i for i in todo if 0 < sizes[i] <= limit]
        if len(small) < 2:
            return []
        counts = Counter(items[i][0] for i in small)
        chosen = [i for i in small if counts[items[i][0]] == 1]
        return chosen if len(chosen) >= 2 else []

    async def _stage(
        self,
        job: Callable[[Disk, list[tuple[BlockKey, IoVec]], bool], list[group_commit.Outcome]],
        batch: list[tuple[BlockKey, IoVec]],
        group: bool,
    ) -> list[group_commit.Outcome]:
        """``job(disk, part, group)`` over ``batch`` cut into :meth:`_groups`, ``max_concurrency`` at
        a time: each block written to its temporary file (and renamed, without ``group``)."""
        parts = self._groups(batch)
        done = await bounded_gather(
            self.max_concurrency, [self._run(job, self.disk, batch[a:b], group) for a, b in parts]
        )
        return [outcome for chunk in done for outcome in chunk]

    @staticmethod
    def _groups(items: Sequence[tuple[BlockKey, IoVec]], most: int = GROUP_BLOCKS) -> list[tuple[int, int]]:
        """``items`` cut into runs (start, end) of at most ``most`` blocks and :data:`GROUP_BYTES`
        bytes: one executor job each."""
        bounds: list[tuple[int, int]] = []
        start = total = 0
        for n, (_, iov) in enumerate(items):
            total += iov[0].nbytes if len(iov) == 1 else iov_len(iov)
            if n + 1 - start >= most or total >= GROUP_BYTES:
                bounds.append((start, n + 1))
                start, total = n + 1, 0
        if start < len(items):
            bounds.append((start, len(items)))
        return bounds

    # -- removal and the rest of the interface --------------------------------------------------------
    async def delete(self, keys: Sequence[BlockKey]) -> int:
        present = [k for k in keys if k in self._index]
        singles = [k for k in present if not isinstance(self._forget(k), PackedStamp)]
        paths = [path for k in singles for path in self.layout.file_paths_of(k)]
        if paths:
            await self._run(files.unlink_all, self.disk, paths)
        await self._retire()
        return len(present)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        for key, entry in self._index.items():
            if namespace is None or key.namespace == namespace:
                yield BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)

    def stats(self) -> TierStats:
        s = self._stats
        s.blocks, s.bytes = len(self._index), self._index.bytes + self._packs.dead_bytes
        if self._packs.packs or self.pack_max_block_bytes:
            s.extra["pack_files"] = float(len(self._packs.packs))
            s.extra["pack_dead_bytes"] = float(self._packs.dead_bytes)
        for name in INDEX_STATS:
            s.extra.pop(name, None)
        s.extra.update(self.recovery.figures())  # start-up progress: an operator sees re-adoption advance
        if self.disk.skipped:
            s.extra["skipped_files"] = float(sum(self.disk.skipped.values()))
        s.extra.update(self.snapshots.figures())
        return TierStats(**{f: getattr(s, f) for f in s.__slots__})

    def eviction_candidates(self) -> Iterator[bytes]:
        """Keys in the order :meth:`evict` would take them (an admission policy's victims)."""
        return (key for key, _ in self.eviction_order(self._index.oldest(), self._index.get))

    async def evict(self, nbytes: int) -> int:
        victims: list[BlockKey] = []
        freed = 0
        for key, entry in self.eviction_order(self._index.oldest(), self._index.get):
            if freed >= nbytes:
                break
            victims.append(block_key(key))
            freed += entry.size
        self._stats.evictions += len(victims)
        await self.delete(victims)
        return freed

    async def info(self, key: BlockKey) -> BlockInfo | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        try:
            if isinstance(entry, PackedStamp):
                offset = entry.pack.offset_of(key)
                if offset is None:
                    raise FileNotFoundError(errno.ENOENT, "not in its pack")
                header = await self._run(files.read_packed_header, self.disk, entry.pack, offset, key)
            else:
                header = await self._run(files.read_header, self.disk, self.layout.path_of(key), key)
        except (OSError, CorruptBlock):
            return BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)
        return BlockInfo(
            key=key,
            size=entry.size,
            tier=self.name,
            stored_at=header.created_ns / 1e9,
            checksum=header.checksum,
        )

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        entry = self._index.get(key)
        if entry is None:
            return MISSING
        scratch = [memoryview(bytearray(entry.size))]
        if isinstance(entry, PackedStamp):
            packed = (await self._fetch([(key, scratch)], {0: entry}, False))[0]
            if isinstance(packed, CorruptBlock) and not quarantine:
                self._stats.corrupt += 1
                return failed(f"corrupt block in {self.name}: {packed}")
            return await self._read_result(key, packed, entry.size, packed=True) or failed("not read")
        try:
            await self._run(files.read_file, self.disk, key, scratch)
        except FileNotFoundError:
            self._forget(key)
            return MISSING
        except CorruptBlock as exc:
            if quarantine:
                await self._quarantine(key, str(exc))
            else:
                self._stats.corrupt += 1
            return failed(f"corrupt block in {self.name}: {exc}")
        except OSError as exc:
            return failed(f"{self.name} read error: {exc.strerror or exc}")
        return OK

    # -- the index ------------------------------------------------------------------------------------
    def _remember(self, key: BlockKey, entry: Entry) -> None:
        self._index.add(key, entry.size, entry.stored_at)

    def _forget(self, key: BlockKey, *, tombstone: bool = True) -> Stamp | None:
        """Drop ``key`` from the index; a packed block dies in its pack (its header zeroed on disk at
        the next :meth:`_retire` unless not ``tombstone``). The entry it had, if any."""
        stamp = self._index.forget(key)
        if isinstance(stamp, PackedStamp):
            self._packs.kill(stamp, key, tombstone=tombstone)
        return stamp

    def _unindex(self, key: bytes) -> Stamp | None:
        """Drop ``key`` as adoption does (a file found gone or torn): not a change adoption keeps."""
        stamp = self._index.pop(key)
        if isinstance(stamp, PackedStamp):
            self._packs.kill(stamp, key, tombstone=False)
        return stamp

    async def _quarantine(self, key: BlockKey, reason: str) -> None:
        self._forget(key)
        await self._run(files.quarantine_key, self.disk, key, reason)

    async def _retire(self) -> None:
        """Do the disk work removals of packed blocks left: tombstones, and unlinks of emptied packs."""
        if self._packs.pending:
            await self._run(files.apply_retired, self.disk, self._packs.take())

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the executor (bounded by the profile's ``timeout_s``, if any)."""
        work = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        if self.profile.timeout_s is None:
            return await work
        try:
            return await asyncio.wait_for(work, self.profile.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.kind} operation timed out after {self.profile.timeout_s:g}s") from None
