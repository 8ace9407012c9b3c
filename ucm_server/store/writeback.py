"""The write-back backlog: a bounded budget of Cache bytes that may await their write-down at once.

Write-back keeps a lease on every block until the lower tiers have it, so an unbounded backlog lets a
burst of dumps lease the whole Cache: every later write is then refused by the Cache ("all blocks
leased") and goes straight to disk, which is where the seconds-long tail of a loaded node came from.
The backlog bounds what may be leased for write-back (``writeback_max_bytes``, counted in whole Cache
pages, half the Cache by default), so the rest of the Cache always stays evictable for new writes and
promotions.

A dump that finds the backlog full waits for room (backpressure, at most ``writeback_wait_s``; FIFO,
so a small block cannot overtake a large one forever). If there is still no room, the node is
saturated and ``writeback_overflow`` decides: ``cache-only`` admits the block to the Cache without
writing it down (counted as a skipped write-down; the dump was never promised durable), while
``write-through`` writes it below before the dump completes. A dump that asked for durability
(``wait_durable``) is never skipped: it waits for room as long as it takes, since it would wait for
the write-down anyway. Every figure is in :class:`WriteBackFigures` (Admin stats, Prometheus).

The blocks admitted wait in :class:`WriteBackQueue` until a flusher writes them below the top tier,
a few per batch; one key's versions land in the order they were written, and a version superseded in
the Cache before its turn is dropped unwritten.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import OK, BlockResult, IoVec, failed
from ucm_server.store.io_classes import IoClass, current_class

if TYPE_CHECKING:
    from ucm_server.store.cache import Lease

log = logging.getLogger(__name__)

Overflow = Literal["cache-only", "write-through"]
OVERFLOW_POLICIES: tuple[Overflow, ...] = ("cache-only", "write-through")


@dataclass(frozen=True, slots=True)
class WriteBackFigures:
    """The write-back queue at one instant (counters since start)."""

    queue_depth: int
    """Blocks queued or being written down now."""
    bytes_pending: int
    """Cache bytes (whole pages) those blocks hold."""
    max_bytes: int
    """The bound on ``bytes_pending`` (0: write-back off)."""
    waiting: int
    """Dumps waiting for room now (backpressure)."""
    backpressure_waits: int
    """Blocks that had to wait for room."""
    backpressure_wait_s: float
    """Seconds spent waiting for room, all blocks together."""
    skipped: int
    """Blocks kept in the Cache only because the node was saturated (``cache-only``)."""
    written_through: int
    """Blocks written down before their dump completed because the node was saturated (``write-through``)."""
    written: int
    """Blocks written down by write-back."""
    failed: int
    """Write-backs that failed below (logged)."""

    def as_extra(self) -> dict[str, float]:
        """The figures as ``TierStats.extra`` entries of the top tier (``writeback_*``)."""
        return {f"writeback_{name}": float(getattr(self, name)) for name in self.__slots__}


class Backlog:
    """A byte budget with FIFO waiters; all on the event loop thread, so no lock.

    A request larger than the whole budget is granted when nothing else is pending (it could never
    fit otherwise)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.waits = 0
        self.wait_s = 0.0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def try_take(self, n: int) -> bool:
        if not self._waiters and self._fits(n):
            self.used += n
            return True
        return False

    async def take(self, n: int, timeout_s: float | None) -> bool:
        """Room for ``n`` bytes, waiting at most ``timeout_s`` (``None``: as long as it takes)."""
        if self.try_take(n):
            return True
        if timeout_s is not None and timeout_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        self.waits += 1
        started = loop.time()
        try:
            await asyncio.wait([fut], timeout=timeout_s)
        except BaseException:  # cancelled: give back what may have been granted meanwhile
            self._forget(entry)
            raise
        finally:
            self.wait_s += loop.time() - started
        if fut.done():
            return True
        self._forget(entry)
        return False

    def _forget(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        n, fut = entry
        if fut.done():
            self.give(n)
            return
        fut.cancel()
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        self._grant()  # the head may have left: the next ones may fit now

    def give(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            self.used += n
            fut.set_result(None)


@dataclass(slots=True, eq=False)
class _Flush:
    key: BlockKey
    lease: Lease
    done: asyncio.Future[BlockResult]
    nbytes: int
    """Backlog bytes this job holds (whole Cache pages), given back when it ends."""


WriteDown = Callable[[Sequence[tuple[BlockKey, IoVec]]], Awaitable[list[BlockResult]]]


class WriteBackQueue:
    """The blocks awaiting their write-down (each holding its Cache lease and backlog bytes), the
    flushers that write them in batches below the top tier, and the order one key's versions land in:
    a later version waits for the earlier ones, a superseded one is dropped unwritten."""

    def __init__(self, backlog: Backlog, write_down: WriteDown, *, flushers: int, batch: int) -> None:
        self.backlog = backlog
        self._write_down = write_down
        self._nflushers = flushers
        self._batch = max(1, batch)
        self._jobs: deque[_Flush] = deque()
        self._queued: dict[BlockKey, list[_Flush]] = {}  # jobs not yet taken by a flusher, by key
        self._inflight: dict[BlockKey, list[asyncio.Future[BlockResult]]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._flushers: list[asyncio.Task[None]] = []
        self.pending = 0
        """Blocks queued or being written down now."""
        self.written = 0
        self.failed = 0

    def start(self) -> None:
        self._flushers = [asyncio.create_task(self._flusher()) for _ in range(self._nflushers)]

    async def stop(self) -> None:
        """Finish every pending write-back, then end the flushers."""
        await self.drain()
        self._closing = True
        self._wake.set()
        await asyncio.gather(*self._flushers, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until every queued write-back has ended."""
        while self.pending:
            await self._idle.wait()

    async def settle(self, key: BlockKey, before: asyncio.Future[BlockResult] | None = None) -> None:
        """Wait for the write-backs of ``key`` queued earlier (all of them, or those before ``before``)."""
        pending = self._inflight.get(key)
        if not pending:
            return
        earlier = pending[: pending.index(before)] if before in pending else list(pending)
        if earlier:
            await asyncio.gather(*(asyncio.shield(f) for f in earlier))

    def enqueue(self, key: BlockKey, lease: Lease, nbytes: int) -> asyncio.Future[BlockResult]:
        """Queue one block's write-back; it holds ``lease`` and ``nbytes`` of the backlog until done."""
        self.drop_queued(key)
        fut: asyncio.Future[BlockResult] = asyncio.get_running_loop().create_future()
        job = _Flush(key, lease, fut, nbytes)
        self._inflight.setdefault(key, []).append(fut)
        self._queued.setdefault(key, []).append(job)
        self._jobs.append(job)
        self.pending += 1
        self._idle.clear()
        self._wake.set()
        return fut

    def drop_queued(self, key: BlockKey) -> None:
        """Queued write-backs of older versions of ``key`` (superseded in the Cache) end now, as a
        flusher would end them, instead of holding backlog room until their turn comes."""
        jobs = self._queued.get(key)
        if not jobs:
            return
        keep = []
        for job in jobs:
            if job.lease.superseded:
                self._jobs.remove(job)
                self._finish(job, OK)
            else:
                keep.append(job)
        if keep:
            self._queued[key] = keep
        else:
            del self._queued[key]

    def _take_batch(self) -> list[_Flush]:
        """Up to ``flush_batch`` jobs from the front of the queue, distinct keys (one key's
        versions land in order: a second version waits for the next batch)."""
        batch: list[_Flush] = []
        keys: set[BlockKey] = set()
        while self._jobs and len(batch) < self._batch:
            job = self._jobs[0]
            if job.key in keys:
                break
            self._jobs.popleft()
            keys.add(job.key)
            queued = self._queued.get(job.key)
            if queued is not None:
                queued.remove(job)
                if not queued:
                    del self._queued[job.key]
            batch.append(job)
        return batch

    def _finish(self, job: _Flush, r: BlockResult) -> None:
        job.lease.release()
        self.backlog.give(job.nbytes)
        self.pending -= 1
        waiting = self._inflight.get(job.key, [])
        if job.done in waiting:
            waiting.remove(job.done)
        if not waiting:
            self._inflight.pop(job.key, None)
        if not job.done.done():
            job.done.set_result(r)
        if not self.pending:
            self._idle.set()

    async def _flusher(self) -> None:
        current_class.set(IoClass.BACKGROUND)  # nobody waits for a write-back: loads go first
        while True:
            if not self._jobs:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take_batch()
            results: dict[int, BlockResult] = {}
            interrupted: BlockResult = failed("write-back interrupted")
            try:
                for job in batch:
                    await self.settle(job.key, before=job.done)  # one key's versions land in order
                live = [job for job in batch if not job.lease.superseded]  # else the newer state wins
                if live:
                    got = await self._write_down([(job.key, job.lease.iov) for job in live])
                    for job, r in zip(live, got, strict=True):
                        results[id(job)] = r
                        if r.ok:
                            self.written += 1
                            job.lease.written_down()
                        else:
                            self.failed += 1
                            log.warning("write-back of %s failed: %s", job.key.hex(), r.reason)
                interrupted = OK  # superseded jobs
            except Exception as exc:  # a tier bug must not kill the flusher
                log.exception("write-back of %d blocks crashed", len(batch))
                interrupted = failed(f"write-back error: {exc}")
            finally:
                for job in batch:
                    self._finish(job, results.get(id(job), interrupted))
