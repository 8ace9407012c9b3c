"""Daemon-owned staging memory: where bytes that come from or go to a client's region stop first.

A client can write to its registered memory at any moment, from any process or thread. So nothing
the daemon decides about a stored block may rest on bytes in client memory: a checksum computed over
a destination the client (or a second, racing load into the same bytes) is changing would quarantine
a good file, and a block promoted into the Cache from such bytes would be served to every later
reader under the wrong key. The pipeline therefore reads lower-tier blocks into memory of its own
(a Cache reservation when the block is promoted, otherwise a slot of this pool), verifies them there,
and only then copies them to the client; a dump that does not land in the Cache is copied here once,
and its checksum and its stored bytes both come from that one copy.

The pool is an :class:`~ucm_server.store.arena.Arena` of ``capacity`` bytes (faulted in on first use,
then reused, so a copy into it runs at memcpy speed) shared by all requests. A batch takes all the pages
it needs at once or waits for them, so two requests never hold part of what each needs; a batch larger
than the pool is cut into groups by :meth:`StagingPool.groups`, and a single block larger than the
pool gets a one-off mapping of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

from ucm_server.store.arena import Arena, Extent
from ucm_server.store.base import IoVec, copy_all

DEFAULT_CAPACITY = 256 << 20
PAGE_SIZE = 64 << 10
"""Allocation unit: 4 KiB aligned, so blocks staged here can still be written with ``O_DIRECT``."""


@dataclass(slots=True)
class Staged:
    """Pages held for a batch of blocks: ``iovs[i]`` is block ``i``'s daemon-owned memory."""

    iovs: list[list[memoryview]]
    extents: list[list[Extent]] = field(default_factory=list)
    maps: list[mmap.mmap] = field(default_factory=list)


class StagingPool:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.capacity = max(page_size, capacity // page_size * page_size)
        self._arena: Arena | None = None  # mapped at first use: most daemons stage nothing for a while
        self._freed: asyncio.Event | None = None
        self.waits = 0
        """How many times a batch had to wait for pages (a pool too small for the load shows here)."""

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            self._arena = Arena(self.capacity, self.page_size)
        return self._arena

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_size))

    def groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices of ``sizes`` cut into consecutive groups that each fit the pool at once."""
        out: list[list[int]] = []
        group: list[int] = []
        pages = 0
        limit = self.capacity // self.page_size
        for i, size in enumerate(sizes):
            need = self.pages_for(size) if size <= self.capacity else 0  # oversized: its own mapping
            if group and pages + need > limit:
                out.append(group)
                group, pages = [], 0
            group.append(i)
            pages += need
        if group:
            out.append(group)
        return out

    async def take(self, sizes: Sequence[int]) -> Staged:
        """Memory for blocks of ``sizes`` (one group of :meth:`groups`), waiting until it is free."""
        arena = self.arena
        fits = [s for s in sizes if s <= self.capacity]
        need = sum(self.pages_for(s) for s in fits)
        while arena.free_pages < need:
            self.waits += 1
            if self._freed is None:
                self._freed = asyncio.Event()
            self._freed.clear()
            await self._freed.wait()
        staged = Staged(iovs=[])
        for size in sizes:
            if size > self.capacity:
                m = mmap.mmap(-1, size)
                staged.maps.append(m)
                staged.iovs.append([memoryview(m)])
                continue
            extents = arena.allocate(size)
            assert extents is not None  # counted above, and allocation happens on this thread only
            staged.extents.append(extents)
            staged.iovs.append(arena.views(extents, size))
        return staged

    def give(self, staged: Staged) -> None:
        """Return a batch's pages; its views must no longer be used."""
        for iov in staged.iovs:
            for view in iov:
                with contextlib.suppress(BufferError):  # a tier still holds an export: harmless
                    view.release()
        staged.iovs.clear()
        for extents in staged.extents:
            self.arena.free(extents)
        staged.extents.clear()
        for m in staged.maps:
            m.close()
        staged.maps.clear()
        if self._freed is not None:
            self._freed.set()

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def copy_pairs(pairs: Sequence[tuple[IoVec, IoVec]]) -> None:
    """Copy each ``(dst, src)`` pair (run in an executor: one hop for a whole batch)."""
    copy_all(pairs)


def copy_and_clear(pairs: Sequence[tuple[IoVec, IoVec]], clear: list[IoVec]) -> None:
    """Verified blocks to their destinations; zeroes where a failed block's bytes were read."""
    copy_pairs(pairs)
    for iov in clear:
        for seg in iov:
            seg[:] = bytes(seg.nbytes)
