"""A fixed-size host-memory arena carved into equal pages.

The Cache tier stores each block in whole pages of one big anonymous mapping instead of allocating a
``bytearray`` per block: memory that is reused stays faulted in (a copy into freshly allocated pages
runs at half of memcpy speed here), capacity is exact, and one mapping is what a GPU host pins once
with ``cudaHostRegister``. A block's pages need not be contiguous; copies go run by run.

Not thread-safe: allocation happens on the event loop; only the byte copies run in threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Extent:
    """``npages`` consecutive pages starting at page ``first``."""

    first: int
    npages: int


class Arena:
    def __init__(self, capacity: int, page_size: int, *, prefault: bool = False) -> None:
        self.page_size = page_size
        self.npages = capacity // page_size
        self.capacity = self.npages * page_size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self._map = mmap.mmap(-1, self.capacity, flags=flags)
        self.memory = memoryview(self._map)
        # The mapping's address, for device copies (the temporary ctypes view is released at once).
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._unpin: Callable[[int], None] | None = None
        # Popping from the end hands out low pages first, so a fresh arena gives contiguous runs.
        self._free = list(range(self.npages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_size))

    def allocate(self, nbytes: int) -> list[Extent] | None:
        """Pages for ``nbytes``, as few runs as the free list allows; ``None`` if not enough free."""
        n = self.pages_for(nbytes)
        if n > len(self._free):
            return None
        pages = sorted(self._free[-n:])
        del self._free[-n:]
        extents: list[Extent] = []
        start = prev = pages[0]
        for p in pages[1:]:
            if p != prev + 1:
                extents.append(Extent(start, prev - start + 1))
                start = p
            prev = p
        extents.append(Extent(start, prev - start + 1))
        return extents

    def free(self, extents: list[Extent]) -> None:
        for e in extents:
            self._free.extend(range(e.first + e.npages - 1, e.first - 1, -1))

    def views(self, extents: list[Extent], nbytes: int) -> list[memoryview]:
        """The block's bytes as memoryviews into the arena, trimmed to ``nbytes``."""
        out: list[memoryview] = []
        left = nbytes
        for e in extents:
            start = e.first * self.page_size
            n = min(left, e.npages * self.page_size)
            out.append(self.memory[start : start + n])
            left -= n
        return out

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def pin(self, register: Callable[[int, int], None], unregister: Callable[[int], None]) -> None:
        """Page-lock the whole arena once (``cudaHostRegister``) so GPU copies DMA straight into pages.

        ``unregister`` runs at :meth:`close`, before the mapping goes. Pinning faults in every page, so
        it takes a while for a large arena: call it from a worker thread.
        """
        if self._unpin is None:
            register(self.address, self.capacity)
            self._unpin = unregister

    def runs(self, extents: list[Extent], nbytes: int) -> list[tuple[int, int]]:
        """The block's bytes as (address, length) runs, trimmed to ``nbytes`` (for device copies)."""
        out: list[tuple[int, int]] = []
        left = nbytes
        for e in extents:
            n = min(left, e.npages * self.page_size)
            out.append((self.address + e.first * self.page_size, n))
            left -= n
        return out

    def close(self) -> None:
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            with contextlib.suppress(Exception):  # shutting down: the mapping goes either way
                unpin(self.address)
        self.memory.release()
        try:
            self._map.close()
        except BufferError:
            pass  # views handed out earlier are still referenced; the mapping goes with the last one
