"""The Posix tier's capacity as a bound: room reserved by each write before it writes.

Write-back writes one dump down in concurrent groups, and several clients dump at once. If each
checked the free room and evicted only what it alone needed, one writer's eviction would be counted
as room by the next, and the tier would end above its capacity (a 20-block dump into a full
40-block tier left 52). So a write reserves the bytes it needs first: it evicts beside what the tier
holds *and* what other writes have reserved, and gives its reservation back as its blocks enter the
index (or fail), with no await in between. What the tier holds never exceeds its capacity. A write
that finds the room reserved by writes in flight waits for one to land (its blocks can then be
evicted) instead of failing; only blocks the retention rules keep (pins) make a write fail for room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class Room:
    """Reservations against one tier's ``capacity`` (bytes; the caller skips all this at 0)."""

    def __init__(
        self, capacity: int, held: Callable[[], int], evict: Callable[[int], Awaitable[int]]
    ) -> None:
        """``held()``: the bytes the tier holds now; ``evict(n)``: evict ``n`` bytes or more, the
        bytes it freed."""
        self.capacity = capacity
        self._held = held
        self._evict = evict
        self.reserved = 0
        """Bytes of writes in flight that room was made for."""
        self._waiters: list[asyncio.Future[None]] = []

    async def reserve(self, size: int) -> int:
        """Reserve room for ``size`` more bytes, evicting what must go; how many of them got room:
        all unless the retention rules keep what would have to go (pinned blocks are never evicted).
        The caller gives them back (:meth:`release`) as its blocks enter the index, or fail."""
        while True:
            self.reserved += size
            over = self._held() + self.reserved - self.capacity
            if over <= 0:
                return size
            freed = await self._evict(over)
            if freed >= over:
                return size
            if self.reserved > size:  # others' writes hold the rest: wait for one to land
                self.release(size)
                landed = asyncio.get_running_loop().create_future()
                self._waiters.append(landed)
                await landed
                continue
            short = min(size, over - freed)
            self.release(short)
            return size - short

    def release(self, nbytes: int) -> None:
        """Give back reserved room; writes waiting for room look again."""
        self.reserved -= nbytes
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def admit(self, sizes: list[int], todo: list[int]) -> tuple[list[int], int]:
        """The blocks of ``todo`` (indexes into ``sizes``) there is room for, in order, and the bytes
        reserved for them; the rest did not fit."""
        room = await self.reserve(min(self.capacity, sum(sizes[i] for i in todo)))
        fits: list[int] = []
        for i in todo:
            if sizes[i] <= room:
                room -= sizes[i]
                fits.append(i)
        self.release(room)  # what no block of the batch took
        return fits, sum(sizes[i] for i in fits)

    def full(self, name: str, size: int) -> str:
        """Why a block of ``size`` bytes was refused."""
        free = max(0, self.capacity - self._held() - self.reserved)
        return (
            f"{name} is full: {size} bytes needed, {free} free of {self.capacity} "
            "and the rest is pinned or being written"
        )
