"""A pipeline of tiers (``"Cache|Posix"``, ``"Cache|Posix|DS3FS"``...): one store made of several.

Reads go top-down; a block found lower is promoted into the top tier, so the next read is served
from memory. Client memory is never trusted (:mod:`ucm_server.store.staging`): a block to promote
is read into the Cache pages it is promoted into, verified there, and only then copied to the caller;
a block read straight into the caller's memory is never judged by what it holds there (a mismatch
means "read it again into the staging pool", where a mismatch is corruption); a write the Cache
does not hold is copied into staging first, so its checksum and its stored bytes come from one
copy. Callers that pass
memory of the daemon's own (``owned=True``: the GPU path's pinned buffers, the byte-streaming RPCs,
scratch buffers) skip the extra copy. Writes land in the top tier and reach
the lower tiers either in the background (write-back, the default: the Cache keeps a lease on the
block until every lower tier has it, so it cannot be evicted before it is safe) or before the write
completes (write-through). Write-back is a bounded backlog (:mod:`ucm_server.store.writeback`): a
dump first takes room in it, waiting a little when it is full (backpressure), and on a saturated
node is written through or kept in the Cache only, as configured; so the Cache never fills with
blocks awaiting write-down. A write the top tier cannot take anyway goes straight down instead of
failing. ``durable=True`` on a write waits until the block is in the last persistent tier.
A pin is held where the block durably lives (:mod:`ucm_server.store.pin_home`): the Cache learns
which of its blocks are safe below, and a pinned block is never left in the Cache alone (a
saturated node's ``cache-only`` overflow writes it through).

Lookups answer from the local tiers' in-memory indexes; only keys they all miss are asked of shared
tiers (whose contents other nodes change), in one batch per tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, cast

from ucm_protocol.keys import BlockKey, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.admitting import cache_only
from ucm_server.store.base import MISSING, OK, BlockInfo, BlockResult, EvictionRules, Tier, failed
from ucm_server.store.copying import IoVec, iov_len
from ucm_server.store.leasing import Leasing, leasing_of
from ucm_server.store.promotion import Promotions
from ucm_server.store.shared_answers import SharedAnswers
from ucm_server.store.spans import keys_of
from ucm_server.store.staging import StagingPool, copy_and_clear, copy_pairs
from ucm_server.store.write_stamps import WriteStamps
from ucm_server.store.writeback import Backlog, Overflow, WriteBackFigures, WriteBackQueue

if TYPE_CHECKING:
    from ucm_server.store.admitting import Admission
    from ucm_server.store.cache import Lease, Reservation

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_back: bool = True,
        flushers: int = 4,
        shared_lookup_ttl_s: float = 2.0,
        staging: StagingPool | None = None,
        executor: Executor | None = None,
        writeback_max_bytes: int = 0,
        writeback_wait_s: float = 1.0,
        writeback_overflow: Overflow = "write-through",
        flush_batch: int = 4,
        rules: EvictionRules | None = None,
    ) -> None:
        """``writeback_max_bytes``: Cache bytes that may await write-down at once (0: half the
        Cache); a dump waits up to ``writeback_wait_s`` for room, then ``writeback_overflow``
        decides (:mod:`ucm_server.store.writeback`). A flusher writes up to ``flush_batch`` queued
        blocks in one batch. ``rules``: the daemon's retention rules, which every tier's eviction
        follows where it can (pins, priorities)."""
        if not tiers:
            raise ValueError("a pipeline needs at least one tier")
        self.tiers = list(tiers)
        self.rules = rules
        if rules is not None:
            for t in self.tiers:
                t.use_rules(rules)
        self.top = self.tiers[0]
        self.leasing: Leasing | None = leasing_of(self.top)
        """The top tier when it can lease (the Cache): write-back, promotion in place, GPU copies."""
        if self.leasing is not None:  # a pinned block safe in a tier below that holds pins may leave it
            self.leasing.pins_below = any(not t.pin_gap for t in self.tiers[1:])
        self.write_back = write_back and self.leasing is not None and len(self.tiers) > 1
        self.staging = staging or StagingPool()
        self._executor = executor
        capacity = self.leasing.arena.capacity if self.leasing is not None else 0
        self.backlog = Backlog(writeback_max_bytes or max(capacity // 2, 1))
        self.writeback_wait_s = writeback_wait_s
        self.writeback_overflow: Overflow = writeback_overflow
        self.queue = WriteBackQueue(self.backlog, self._write_down, flushers=flushers, batch=flush_batch)
        """The blocks awaiting their write-down, and the flushers writing them."""
        self._skipped = 0
        self._through = 0
        self.shared_answers = SharedAnswers(shared_lookup_ttl_s)
        self.stamps = WriteStamps()
        self.promotions = Promotions(self)
        self.admission: Admission | None = None
        """The tier boundaries' admission policies (:func:`ucm_server.store.admitting.install_admission`)."""

    @property
    def spec(self) -> str:
        return "|".join(t.kind for t in self.tiers)

    @property
    def pending_writeback(self) -> int:
        return self.queue.pending

    def writeback_figures(self) -> WriteBackFigures:
        """The write-back queue now (no await: the metrics scrape thread calls it through the snapshot)."""
        b = self.backlog
        return WriteBackFigures(
            queue_depth=self.queue.pending,
            bytes_pending=max(b.used, 0),
            max_bytes=b.limit if self.write_back else 0,
            waiting=b.waiting,
            backpressure_waits=b.waits,
            backpressure_wait_s=b.wait_s,
            skipped=self._skipped,
            written_through=self._through,
            written=self.queue.written,
            failed=self.queue.failed,
        )

    def pin_gaps(self) -> list[str]:
        """``"<tier>: why"`` for each tier whose eviction does not hold this daemon's pins."""
        return [f"{t.name}: {t.pin_gap}" for t in self.tiers if t.pin_gap]

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if name in (t.name, t.kind):
                return t
        raise KeyError(name)

    async def open(self) -> None:
        for t in self.tiers:
            await t.open()
        if self.write_back:
            self.queue.start()

    async def close(self) -> None:
        """Finish every pending write-back, then close the tiers (bottom first)."""
        await self.queue.stop()
        for t in reversed(self.tiers):
            await t.close()
        self.staging.close()

    async def drain(self) -> None:
        """Wait until every queued write-back has ended."""
        await self.queue.drain()

    # -- lookups --------------------------------------------------------------------------------------
    async def lookup(
        self, keys: Sequence[BlockKey], digests: Sequence[bytes] | None = None
    ) -> list[int | None]:
        """Each key's size where stored, else None. ``digests``: the keys' digests, every key of one
        namespace (keys :func:`~ucm_protocol.keys.make_keys` built): a local first tier is then
        asked through its per-namespace map, no key cut in two (a Load's size check of 4,096 keys:
        ~0.7 ms of slicing)."""

        def ask(tier: Tier, todo: list[int]) -> Awaitable[list[int | None]]:
            asked = [keys[i] for i in todo]
            return self.shared_answers.lookup(tier, asked) if tier.shared else tier.lookup(asked)

        order = self._lookup_order()
        if order[0].shared:
            return await self._fill([None] * len(keys), order, ask)
        # A local first tier is asked for the keys as they are: the usual all-hit batch (a Load's
        # size check) then costs its index's one pass, not four Python passes over the keys.
        if digests is not None and keys:
            sizes = list(await order[0].lookup_digests(keys[0].namespace, digests))
        else:
            sizes = list(await order[0].lookup(keys))
        return await self._fill(sizes, order[1:], ask) if None in sizes else sizes

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        """The Lookup RPC's path: local per-namespace maps first, shared tiers only for the misses."""
        return (await self.lookup_presence(namespace, digests))[0]

    async def lookup_presence(
        self, namespace: Namespace, digests: Sequence[bytes]
    ) -> tuple[list[int | None], bool]:
        """:meth:`lookup_digests` and whether the first tier found every key, decided once here
        (the engine's answer needs it too: a second pass cost ~8 µs per 2,048 keys)."""

        def ask(tier: Tier, todo: list[int]) -> Awaitable[list[int | None]]:
            if tier.shared:
                return self.shared_answers.lookup(tier, [BlockKey(namespace, digests[i]) for i in todo])
            return tier.lookup_digests(namespace, [digests[i] for i in todo])

        order = self._lookup_order()
        first = order[0]  # local: its per-namespace map takes the request's digests as they are
        sizes = await (
            first.lookup_digests(namespace, digests)
            if not first.shared
            else ask(first, list(range(len(digests))))
        )
        # The common all-hit case stays in C end to end: ``all`` (a truth test per size, a third of
        # the cost of comparing each with None) decides it, stored sizes being > 0; a 0 falls back.
        complete = bool(all(sizes) or None not in sizes)
        if not complete:
            sizes = await self._fill(sizes, order[1:], ask)
        if self.admission is not None:  # the blocks found are used again (ucm_server.store.admitting)
            self.admission.looked_up(namespace, digests, sizes)
        return sizes, complete

    def _lookup_order(self) -> list[Tier]:
        return sorted(self.tiers, key=lambda t: t.shared)  # local indexes first

    @staticmethod
    async def _fill(
        sizes: list[int | None],
        tiers: Sequence[Tier],
        ask: Callable[[Tier, list[int]], Awaitable[list[int | None]]],
    ) -> list[int | None]:
        """Ask each tier in turn only about the keys no earlier tier had."""
        for tier in tiers:
            todo = [i for i, s in enumerate(sizes) if s is None]
            if not todo:
                break
            for i, size in zip(todo, await ask(tier, todo), strict=True):
                sizes[i] = size
        return sizes

    # -- reads ----------------------------------------------------------------------------------------
    def _stamp(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` were just written or deleted: no running read promotes its older copy, and no
        shared tier's cached answer about them is used again."""
        keys = list(keys)
        self.stamps.stamp(keys)
        self.shared_answers.forget(keys, self.tiers)

    async def read_many(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        *,
        owned: bool = False,
        report: Callable[[int], None] | None = None,
    ) -> list[BlockResult]:
        """Read a batch into ``items``' iovecs; ``owned``: they are daemon memory no client can write.
        Blocks a prefetch is promoting are waited for, then read from memory, not read twice.
        ``report``: a Load's progress word; called only when the top tier copies the whole batch
        segment by segment from memory (``Leasing.read_in_order``), otherwise never."""
        if self.promotions.inflight:
            await self.promotions.wait_for(keys_of(items))
        started = self.begin_read()
        try:
            got = None
            if report is not None and self.leasing is not None:
                got = await self.leasing.read_in_order(items, report)
            if got is None:
                got = await self._read_many(items, started, owned)
        finally:
            self.end_read(started)
        if self.admission is not None:  # the blocks read are used again (ucm_server.store.admitting)
            self.admission.read(list(keys_of(items)), got)
        return got

    def begin_read(self) -> int:
        """Mark a read that may promote as begun; returns its stamp (see :meth:`unwritten_since`)."""
        return self.stamps.begin_read()

    def end_read(self, started: int) -> None:
        self.stamps.end_read(started)

    def unwritten_since(self, key: BlockKey, started: int) -> bool:
        """Nobody wrote or deleted ``key`` since the read stamped ``started`` began."""
        return self.stamps.unwritten_since(key, started)

    async def _read_many(
        self, items: Sequence[tuple[BlockKey, IoVec]], started: int, owned: bool
    ) -> list[BlockResult]:
        results: list[BlockResult] = [MISSING] * len(items)
        todo = list(range(len(items)))
        failures: dict[int, BlockResult] = {}
        for depth, tier in enumerate(self.tiers):
            if not todo:
                break
            batch = items if len(todo) == len(items) else [items[i] for i in todo]  # a span batch kept
            if owned or (depth == 0 and self.leasing is not None):  # no checksum over client memory
                got = await tier.read_many(batch)
            else:
                got = await self._read_staged(depth, batch, started)
            if len(todo) == len(items) and not (depth > 0 and owned) and got.count(OK) == len(got):
                return list(got)  # all found in one tier, nothing to promote: no per-block pass
            todo_next: list[int] = []
            promote: list[int] = []
            for i, r in zip(todo, got, strict=True):
                if r.ok:
                    results[i] = r
                    failures.pop(i, None)
                    if depth > 0 and owned:
                        promote.append(i)
                else:
                    if r.state is BlockState.FAILED:
                        failures[i] = r  # e.g. corrupt here: a lower tier may still hold a good copy
                    todo_next.append(i)
            if promote:
                await self.promotions.copy_up(depth, [items[i] for i in promote], started)
            todo = todo_next
        for i, r in failures.items():
            results[i] = r
        return results

    async def _read_staged(
        self, depth: int, batch: Sequence[tuple[BlockKey, IoVec]], started: int
    ) -> list[BlockResult]:
        """Read ``batch`` from the tier at ``depth`` through daemon memory, promoting as it goes.
        From the top tier nothing is promoted: the whole batch goes straight into the caller's
        memory in one call first (no staging groups: a 4 KiB block feels every per-block pass),
        and only the blocks whose bytes there did not match are read again through staging."""
        results: list[BlockResult] = [MISSING] * len(batch)
        todo: Sequence[int] = range(len(batch))
        if depth == 0:
            first = await self.tiers[0].read_checked_many(batch)
            if first.count(OK) == len(first):  # the usual case: every block read and checked
                return cast(list[BlockResult], first)
            todo = [i for i, r in enumerate(first) if r is None]
            for i, r in enumerate(first):
                if r is not None:
                    results[i] = r
        sizes = [iov_len(batch[i][1]) for i in todo]
        for group in self.staging.groups(sizes):
            got = await self._read_group(depth, [batch[todo[i]] for i in group], started, direct=depth > 0)
            for i, r in zip(group, got, strict=True):
                results[todo[i]] = r
        return results

    async def _read_group(
        self, depth: int, batch: list[tuple[BlockKey, IoVec]], started: int, *, direct: bool = True
    ) -> list[BlockResult]:
        """One group of :meth:`_read_staged`. A block to promote is read into the Cache pages
        reserved for it, verified there, copied to the caller, and only then published. Any other
        block is read straight into the caller's memory where the tier can check it there without
        deciding anything from it (:meth:`Tier.read_checked`: the one-copy path of a Posix-only
        daemon); one whose bytes there do not match, or whose tier cannot, is read again into the
        staging pool, verified there (a mismatch there is corruption), and copied. ``direct``
        False: the caller read them straight already, so every block not promoted is staged."""
        tier = self.tiers[depth]
        top = self.leasing if depth > 0 else None
        reservations: dict[int, Reservation] = {}
        if top is not None:
            promote = {
                j: iov_len(dest)
                for j, (key, dest) in enumerate(batch)
                if self.stamps.unwritten_since(key, started) and not top.holds(key)
            }
            top.make_room(list(promote.values()))  # one eviction walk for the group
            for j, size in promote.items():
                reservation = top.reserve(batch[j][0], size)
                if reservation is not None:
                    reservations[j] = reservation
        got: list[BlockResult | None] = [None] * len(batch)
        unpromoted = [j for j in range(len(batch)) if j not in reservations]
        if unpromoted and direct:  # straight into the caller's memory where the tier checks it there
            checked = await tier.read_checked_many([batch[j] for j in unpromoted])
            for j, r in zip(unpromoted, checked, strict=True):
                got[j] = r
        bounced = [j for j in unpromoted if got[j] is None]
        if not reservations and not bounced:
            return [r for r in got if r is not None]
        staged = await self.staging.take([iov_len(batch[j][1]) for j in bounced])
        try:
            mine: list[IoVec] = [[] for _ in batch]
            for j, reservation in reservations.items():
                assert top is not None
                mine[j] = top.views(reservation)
            for j, iov in zip(bounced, staged.iovs, strict=True):
                mine[j] = iov
            todo = [*reservations, *bounced]
            for j, r in zip(todo, await tier.read_many([(batch[j][0], mine[j]) for j in todo]), strict=True):
                got[j] = r
            ok = [j for j in todo if (r := got[j]) is not None and r.ok]
            # A block read straight into the caller's memory that then failed here: none of the
            # bytes that first read left there may stay (copies from zeroed staging pages).
            unread = [j for j in bounced if not (r := got[j]) or not r.ok]
            if ok or unread:
                pairs = [(batch[j][1], mine[j]) for j in ok]
                await self._run(copy_and_clear, pairs, [batch[j][1] for j in unread])
                await self._promote_between(depth, [(batch[j][0], mine[j]) for j in ok], started)
            for j in ok:
                reservation = reservations.pop(j, None)
                if reservation is None:
                    continue
                assert top is not None
                key = batch[j][0]
                if self.stamps.unwritten_since(key, started) and not top.holds(key):
                    top.commit(reservation, below=not tier.pin_gap)  # nobody wrote, deleted or promoted it
                else:
                    top.abort(reservation)
            return [r if r is not None else failed("not read") for r in got]
        finally:
            for reservation in reservations.values():  # failed reads, or an error on the way
                assert top is not None
                top.abort(reservation)
            self.staging.give(staged)

    async def _promote_between(self, depth: int, items: list[tuple[BlockKey, IoVec]], started: int) -> None:
        """Promotion into memory tiers above ``depth`` other than a top Cache (which publishes the
        reservation the block was read into), from the daemon-owned copy just verified."""
        first = 1 if self.leasing is not None else 0
        if any(not t.persistent for t in self.tiers[first:depth]):
            await self.promotions.copy_up(depth, items, started, first=first)

    async def _run(self, fn: Callable[..., None], *args: object) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- writes ---------------------------------------------------------------------------------------
    async def write_many(
        self, items: Sequence[tuple[BlockKey, IoVec]], *, durable: bool = False, owned: bool = False
    ) -> list[BlockResult]:
        """Store a batch from ``items``' iovecs; ``owned``: they are daemon memory no client can write."""
        if self.admission is not None:  # the admission policy at the daemon's door
            return await self.admission.write(items, durable, lambda some: self._store(some, durable, owned))
        return await self._store(items, durable, owned)

    async def _store(
        self, items: Sequence[tuple[BlockKey, IoVec]], durable: bool, owned: bool
    ) -> list[BlockResult]:
        if not owned and self.leasing is None:  # no Cache copy: checksum a copy of ours
            return await self._staged_writes(items, lambda mine: self._write_many(mine, durable, True))
        return await self._write_many(items, durable, owned)

    async def _write_many(
        self, items: Sequence[tuple[BlockKey, IoVec]], durable: bool, owned: bool
    ) -> list[BlockResult]:
        self._stamp(keys_of(items))
        if len(self.tiers) == 1:
            return await self.top.write_many(items)
        # Room in the write-back backlog first (backpressure), so the Cache never fills with blocks
        # awaiting write-down; None: the node is saturated and writeback_overflow decides.
        keep = cache_only.get() and not durable  # the client asked to keep this dump in the Cache only
        want_room = self.write_back and not keep
        room = await self._admit([iov_len(src) for _, src in items], durable) if want_room else None
        try:
            top_results = await self.top.write_many(items)
        except BaseException:
            if room:
                self.backlog.give(room)
            raise
        results = list(top_results)
        direct: list[int] = [i for i, r in enumerate(top_results) if not r.ok]
        waits: list[tuple[int, asyncio.Future[BlockResult]]] = []
        skipped: list[BlockKey] = []
        if self.write_back or (keep and self.leasing is not None):
            assert self.leasing is not None
            for i, r in enumerate(top_results):
                if not r.ok:
                    continue
                key = items[i][0]
                if room is None:  # saturated (never for a durable dump: it waits for room), or kept
                    if (self.writeback_overflow == "write-through" and not keep) or self._pinned(key):
                        direct.append(i)  # a pinned block is never left in the Cache alone
                        self._through += 1
                    else:
                        skipped.append(key)
                    continue
                lease = self.leasing.lease(key)
                if lease is None:  # evicted already by a concurrent writer; write it down directly
                    direct.append(i)
                    continue
                nbytes = self._cache_bytes(lease.size)
                room -= nbytes
                fut = self.queue.enqueue(key, lease, nbytes)
                if durable:
                    waits.append((i, fut))
            if room:  # taken for blocks the top tier refused
                self.backlog.give(room)
        else:
            direct = list(range(len(items)))
        # Client memory may change under us: what goes below comes from the Cache's copy (taken now,
        # before any await) or from a staging copy, never from the client's region. The Cache's copy
        # held also learns when it is safe below.
        held: dict[int, Lease] = {}
        if self.leasing is not None:
            for i in direct:
                lease = self.leasing.lease(items[i][0]) if top_results[i].ok else None
                if lease is not None:
                    held[i] = lease
        try:
            if direct:
                refused = [items[i][0] for i in direct if not top_results[i].ok]
                if refused:  # an older version may still sit in the top tier: it must not shadow this one
                    await self.top.delete(refused)
                for i in direct:  # and an older write-back must not land below after this one:
                    if top_results[i].ok:  # superseded in the Cache, queued ones end now
                        self.queue.drop_queued(items[i][0])
                    await self.queue.settle(items[i][0])  # those under way are waited for
                lower = await self._write_direct(items, direct, held, owned)
                # What the lower tiers say decides: stored there is stored (even if the top refused it),
                # and a write-through that fails below has failed.
                for i, r in zip(direct, lower, strict=True):
                    results[i] = r
                    if r.ok and i in held:
                        held[i].written_down()
        finally:
            for lease in held.values():
                lease.release()
        if skipped:
            await self._skip(skipped, saturated=not keep)
        for i, fut in waits:
            r = await asyncio.shield(fut)
            if not r.ok:
                results[i] = r
        return results

    def _cache_bytes(self, size: int) -> int:
        """What a block of ``size`` bytes holds of the Cache: whole pages."""
        assert self.leasing is not None
        arena = self.leasing.arena
        return arena.pages_for(size) * arena.page_size

    async def _admit(self, sizes: Sequence[int], durable: bool) -> int | None:
        """Backlog room for a batch (all of it or none): the bytes taken, or ``None`` when the node
        stayed saturated for ``writeback_wait_s``. A durable batch waits as long as it takes."""
        nbytes = sum(self._cache_bytes(size) for size in sizes)
        ok = await self.backlog.take(nbytes, None if durable else self.writeback_wait_s)
        return nbytes if ok else None

    async def _skip(self, keys: Sequence[BlockKey], *, saturated: bool = True) -> None:
        """Blocks admitted to the Cache only (``cache-only`` on a saturated node): an older version
        below must not come back once the Cache evicts this one, so it goes (after any write-back of
        it already under way), and queued write-backs of older versions are dropped."""
        if saturated:
            self._skipped += len(keys)
        for key in keys:
            self.queue.drop_queued(key)
            await self.queue.settle(key)
        for tier in self.tiers[1:]:
            sizes = await tier.lookup(keys)
            present = [k for k, size in zip(keys, sizes, strict=True) if size is not None]
            if present:
                try:
                    await tier.delete(present)
                except Exception:  # logged: the older copy may come back after an eviction
                    log.exception("dropping older copies of %d skipped blocks: %s", len(present), tier.name)

    async def _write_direct(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        direct: list[int],
        held: dict[int, Lease],
        owned: bool,
    ) -> list[BlockResult]:
        """Write ``items[direct]`` below the top: from ``held`` Cache copies, the caller's memory
        when it is ``owned``, else through staging."""
        if owned:
            return await self._write_down([items[i] for i in direct])
        out: dict[int, BlockResult] = {}
        cached = [i for i in direct if i in held]
        if cached:
            got = await self._write_down([(items[i][0], held[i].iov) for i in cached])
            out.update(zip(cached, got, strict=True))
        copied = [i for i in direct if i not in held]
        if copied:
            got = await self._staged_writes([items[i] for i in copied], self._write_down)
            out.update(zip(copied, got, strict=True))
        return [out[i] for i in direct]

    def _pinned(self, key: BlockKey) -> bool:
        return self.rules is not None and self.rules.pinned(key)

    async def _staged_writes(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        write: Callable[[list[tuple[BlockKey, IoVec]]], Awaitable[list[BlockResult]]],
    ) -> list[BlockResult]:
        """Copy client blocks into staging (one copy each, group by group) and ``write`` that copy."""
        results: list[BlockResult] = [MISSING] * len(items)
        sizes = [iov_len(src) for _, src in items]
        for group in self.staging.groups(sizes):
            staged = await self.staging.take([sizes[i] for i in group])
            try:
                pairs = list(zip(group, staged.iovs, strict=True))
                await self._run(copy_pairs, [(mine, items[i][1]) for i, mine in pairs])
                got = await write([(items[i][0], mine) for i, mine in pairs])
            finally:
                self.staging.give(staged)
            for i, r in zip(group, got, strict=True):
                results[i] = r
        return results

    async def flow_down(self, keys: Sequence[BlockKey], *, durable: bool = False) -> list[BlockResult]:
        """Send blocks just committed to the top Cache tier (``Leasing.reserve``/``commit``, the GPU
        path) to the lower tiers, exactly as :meth:`write_many` does after its own top-tier write.

        Call it right after the commit, with no await in between, so the blocks are still cached."""
        self._stamp(keys)
        results: list[BlockResult] = [OK] * len(keys)
        if len(self.tiers) == 1:
            return results
        assert self.leasing is not None
        leases: list[tuple[int, Lease]] = []
        for i, key in enumerate(keys):
            lease = self.leasing.lease(key)
            if lease is None:
                results[i] = failed("the block left the Cache before it could be written down")
            else:
                leases.append((i, lease))
        if cache_only.get() and not durable:  # the client asked to keep this dump in the Cache only
            for _, lease in leases:
                lease.release()
            await self._skip([keys[i] for i, _ in leases], saturated=False)
            return results
        if durable and self.admission is not None:  # every admission boundary takes it
            self.admission.insist(keys)
        room: int | None = None
        if self.write_back:
            try:
                room = await self._admit([lease.size for _, lease in leases], durable)
            except BaseException:
                for _, lease in leases:
                    lease.release()
                raise
            if room is None and self.writeback_overflow == "cache-only":
                skipped = [(i, lease) for i, lease in leases if not self._pinned(keys[i])]
                leases = [(i, lease) for i, lease in leases if self._pinned(keys[i])]  # written through
                for _, lease in skipped:
                    lease.release()
                await self._skip([keys[i] for i, _ in skipped])
                if not leases:
                    return results
            if room is None:
                self._through += len(leases)
        if room is None:  # write-through, or a saturated node whose policy is write-through
            try:
                for i, _ in leases:  # an older write-back must not land below after this one
                    await self.queue.settle(keys[i])
                lower = await self._write_down([(keys[i], lease.iov) for i, lease in leases])
                for (i, lease), r in zip(leases, lower, strict=True):
                    results[i] = r
                    if r.ok:
                        lease.written_down()
            finally:
                for _, lease in leases:
                    lease.release()
            return results
        waits: list[tuple[int, asyncio.Future[BlockResult]]] = []
        for i, lease in leases:
            fut = self.queue.enqueue(keys[i], lease, self._cache_bytes(lease.size))
            if durable:
                waits.append((i, fut))
        for i, fut in waits:
            r = await asyncio.shield(fut)
            if not r.ok:
                results[i] = r
        return results

    async def _write_down(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Write to every tier below the top; a block fails if any of them fails it."""
        results: list[BlockResult] = [OK] * len(items)
        for tier in self.tiers[1:]:
            for i, r in enumerate(await tier.write_many(items)):
                if not r.ok and results[i].ok:
                    results[i] = failed(f"{tier.name}: {r.reason}")
        return results

    # -- other operations -------------------------------------------------------------------------------
    async def delete(self, keys: Sequence[BlockKey]) -> int:
        # The top tier first, so queued write-backs see their block superseded and skip; then wait
        # for write-backs already under way, so none lands below after we delete there.
        present = await self.lookup(keys)
        self._stamp(keys)
        await self.top.delete(keys)
        for k in keys:
            await self.queue.settle(k)
        for t in self.tiers[1:]:
            await t.delete(keys)
        return sum(s is not None for s in present)

    async def prefetch(self, keys: Sequence[BlockKey]) -> list[BlockResult]:
        """Bring blocks from lower tiers into the top tier (a no-op for those already there); a load
        of them meanwhile waits for it (:mod:`ucm_server.store.promotion`)."""
        return await self.promotions.prefetch(keys)

    async def list_blocks(
        self, namespace: Namespace | None = None, tier: str = ""
    ) -> AsyncIterator[BlockInfo]:
        tiers = [self.tier(tier)] if tier else self.tiers
        for t in tiers:
            async for info in t.list_blocks(namespace):
                yield info
