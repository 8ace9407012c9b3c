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
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Literal

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
