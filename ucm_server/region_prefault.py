"""Fault a registered region's page tables in, in the background, so the first Load into it is a memcpy.

The daemon maps client memory at registration; until it touches a page, its first write there costs a
page fault. A fresh vLLM process loading a 4,000-token prefix (62 MiB of KV) paid ~16,000 of them in
the daemon, three times the copy itself (benchmarks/e2e_vllm.py shows the faults per warm request).

The client has allocated every page already (the daemon registers nothing else, see
:mod:`ucm_server.client_memory`), so populating the daemon's page tables (``MADV_POPULATE_WRITE``)
allocates nothing: it only maps pages that exist. Each step is taken under the memory's lock, with
the memory checked before and after: memory found with holes (punched since registration, which
the step would have allocated on the daemon's account) stops the work and is reported, and the
table then drops and releases it. One thread works through regions in steps, at the daemon's own
priority (:mod:`ucm_server.page_populate` says why), and stops on a region that was unregistered
meanwhile; a kernel without ``MADV_POPULATE_WRITE`` (< 5.14) turns it off with one log line.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from ucm_server.page_populate import POPULATE_STEP, populate_write

log = logging.getLogger(__name__)


class Memory(Protocol):
    """What the prefaulter needs of a region's memory (:class:`ucm_server.client_memory.ClientMemory`)."""

    lock: threading.Lock
    closed: bool
    tampered: bool

    def holes(self) -> str | None: ...


_Item = tuple[memoryview, Memory, Callable[[], bool], Callable[[str], None]]


class RegionPrefaulter:
    """Populate regions' page tables in a background thread, one region after another."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.populated_bytes = 0
        """Bytes whose page tables were populated so far (all regions)."""
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(
        self, view: memoryview, memory: Memory, closing: Callable[[], bool], holes: Callable[[str], None]
    ) -> bool:
        """Queue the mapping behind ``view`` (of ``memory``); whether it was queued. ``closing`` says
        when the region was unregistered (stop early); ``holes`` is told why, when the memory is found
        with holes."""
        if not self.enabled or memory.holes() is not None:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ucm-region-prefault", daemon=True)
            self._thread.start()
        self._queue.put((view[:], memory, closing, holes))  # the slice keeps the mapping alive meanwhile
        return True

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            view, memory, closing, holes = item
            try:
                self._populate(view, memory, closing, holes)
            finally:
                view.release()

    def _populate(
        self, view: memoryview, memory: Memory, closing: Callable[[], bool], holes: Callable[[str], None]
    ) -> None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        for start in range(0, view.nbytes, POPULATE_STEP):
            length = min(POPULATE_STEP, view.nbytes - start)
            with memory.lock:  # never while the memory is released (punched and closed)
                if closing() or not self.enabled or memory.closed or memory.tampered:
                    return
                if (why := memory.holes()) is not None:
                    holes(why)
                    return
                if err := populate_write(address + start, length):
                    if err == errno.EINVAL:  # a kernel before 5.14 has no MADV_POPULATE_WRITE
                        log.info(
                            "client regions: not prefaulted (%s); pages fault in on first use",
                            os.strerror(err),
                        )
                        self.enabled = False
                    return  # EFAULT/ENOMEM: the client changed its memory; first use faults as before
                if (why := memory.holes()) is not None:  # this step may have refilled them: released
                    holes(why)
                    return
            self.populated_bytes += length
