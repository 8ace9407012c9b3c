"""A fixed-size host-memory arena carved into equal pages.

The Cache tier stores each block in whole pages of one big anonymous mapping instead of allocating a
``bytearray`` per block: memory that is reused stays faulted in (a copy into freshly allocated pages
runs at half of memcpy speed here), capacity is exact, and one mapping is what a GPU host pins once
with ``cudaHostRegister``. A block's pages need not be contiguous; copies go run by run.

First touch of a fresh page costs a page fault and zeroing: a copy into untouched arena memory ran
at ~1/8 of memcpy speed here (14 ms vs 1.7 ms per 32 MiB), and until the arena fills every stored
block pays that. :meth:`Arena.prefault` moves the cost out of the store path: a background thread
faults the arena in (:mod:`ucm_server.page_populate` says why at the daemon's own priority and in
small steps), lowest pages first, the order allocation hands them out.

Not thread-safe: allocation happens on the event loop; only the byte copies run in threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence

from ucm_server.page_populate import POPULATE_STEP, populate_write

log = logging.getLogger(__name__)


Extent = tuple[int, int]
"""``(first, npages)``: ``npages`` consecutive pages starting at page ``first``.

A plain tuple: every stored block builds one. A named tuple's ``__new__`` (a Python frame) cost
~0.2 µs of the event loop per 64 KiB block, a frozen dataclass's ``__init__`` ~2 µs, as much as half
its copy; and a tuple of ints leaves the garbage collector's sight at its first collection, where
the index's long-lived entries are otherwise walked by every full one."""


class Arena:
    def __init__(self, capacity: int, page_size: int) -> None:
        self.page_size = page_size
        self.npages = capacity // page_size
        self.capacity = self.npages * page_size
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.memory = memoryview(self._map)
        # The mapping's address, for device copies (the temporary ctypes view is released at once).
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._unpin: Callable[[int], None] | None = None
        self._prefaulter: threading.Thread | None = None
        self._closing = threading.Event()
        self.prefaulted = 0
        """Bytes faulted in by :meth:`prefault` so far (all of ``capacity`` once it is done)."""
        # Popping from the end hands out low pages first, so a fresh arena gives contiguous runs.
        self.free_list = list(range(self.npages - 1, -1, -1))
        """Free page numbers, the next to hand out last (the Cache pops single pages itself)."""

    @property
    def free_pages(self) -> int:
        return len(self.free_list)

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_size))

    def allocate(self, nbytes: int) -> list[Extent] | None:
        """Pages for ``nbytes``, as few runs as the free list allows; ``None`` if not enough free."""
        n = self.pages_for(nbytes)
        if n > len(self.free_list):
            return None
        pages = self.free_list[-n:]
        del self.free_list[-n:]
        low = min(pages)
        if max(pages) - low == n - 1:  # n distinct pages spanning n: one run (the usual case)
            return [(low, n)]
        pages.sort()
        extents: list[Extent] = []
        start = prev = pages[0]
        for p in pages[1:]:
            if p != prev + 1:
                extents.append((start, prev - start + 1))
                start = p
            prev = p
        extents.append((start, prev - start + 1))
        return extents

    def free(self, extents: Sequence[Extent]) -> None:
        for first, npages in extents:
            if npages == 1:
                self.free_list.append(first)
            else:
                self.free_list.extend(range(first + npages - 1, first - 1, -1))

    def views(self, extents: Sequence[Extent], nbytes: int) -> list[memoryview]:
        """The block's bytes as memoryviews into the arena, trimmed to ``nbytes``."""
        out: list[memoryview] = []
        left = nbytes
        for first, npages in extents:
            start = first * self.page_size
            n = min(left, npages * self.page_size)
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

    def runs(self, extents: Sequence[Extent], nbytes: int) -> list[tuple[int, int]]:
        """The block's bytes as (address, length) runs, trimmed to ``nbytes`` (for device copies)."""
        out: list[tuple[int, int]] = []
        left = nbytes
        for first, npages in extents:
            n = min(left, npages * self.page_size)
            out.append((self.address + first * self.page_size, n))
            left -= n
        return out

    def prefault(self) -> None:
        """Start faulting the whole arena in, in the background; returns at once."""
        if self._prefaulter is None:
            self._prefaulter = threading.Thread(target=self._fault_in, name="ucm-arena-prefault", daemon=True)
            self._prefaulter.start()

    @property
    def prefault_pending(self) -> int:
        """Bytes the background prefault has still to fault in: 0 once it is done, gave up (a
        kernel without ``MADV_POPULATE_WRITE``) or was never started. Its page faults are the
        daemon's own work, so on a busy host it can run for a while."""
        running = self._prefaulter is not None and self._prefaulter.is_alive()
        return self.capacity - self.prefaulted if running else 0

    def _fault_in(self) -> None:
        for start in range(0, self.capacity, POPULATE_STEP):
            if self._closing.is_set():
                return
            length = min(POPULATE_STEP, self.capacity - start)
            if err := populate_write(self.address + start, length):
                reason = os.strerror(err)  # EINVAL: a kernel before 5.14
                log.info("cache arena: not prefaulted (%s); pages fault in on first use", reason)
                return
            self.prefaulted = start + length
        log.debug("cache arena: %d bytes faulted in", self.capacity)

    def close(self) -> None:
        self._closing.set()
        if self._prefaulter is not None:
            self._prefaulter.join()
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            with contextlib.suppress(Exception):  # shutting down: the mapping goes either way
                unpin(self.address)
        self.memory.release()
        try:
            self._map.close()
        except BufferError:
            pass  # views handed out earlier are still referenced; the mapping goes with the last one
