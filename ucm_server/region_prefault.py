"""Fault a registered region's page tables in, in the background, so the first Load into it is a memcpy.

The daemon maps client memory at registration; until it touches a page, its first write there costs a
page fault. A fresh vLLM process loading a 4,000-token prefix (62 MiB of KV) paid ~16,000 of them in
the daemon, three times the copy itself (benchmarks/e2e_vllm.py shows the faults per warm request).

The client has allocated every page already (``SharedBuffer`` fallocates its memfd), so populating the
daemon's page tables (``MADV_POPULATE_WRITE``) allocates nothing: it only maps pages that exist. A
region with unallocated pages (memory its owner never allocated) is left alone, so the daemon never
allocates a client's memory on its behalf. One thread at the lowest CPU priority works through regions
in steps and stops on a region that was unregistered meanwhile; a kernel without
``MADV_POPULATE_WRITE`` (< 5.14) turns it off with one log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
STEP = 16 << 20
"""Bytes populated per ``madvise`` call: a region going away is noticed between steps."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def fully_allocated(fd: int, size: int) -> bool:
    """Whether every page of ``fd`` (at least ``size`` bytes long) is allocated: its blocks cover the
    whole file. (``SEEK_HOLE`` cannot tell: shmem reports fallocated, never-written pages as holes.)"""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_size >= size and st.st_blocks * 512 >= st.st_size


class RegionPrefaulter:
    """Populate regions' page tables in a background thread, one region after another."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.populated_bytes = 0
        """Bytes whose page tables were populated so far (all regions)."""
        self._queue: queue.SimpleQueue[tuple[memoryview, Callable[[], bool]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, view: memoryview, fd: int, closing: Callable[[], bool]) -> bool:
        """Queue the mapping behind ``view`` (``fd`` is the memfd it maps, still open); whether it was
        queued. ``closing`` says when the region was unregistered (stop early)."""
        if not self.enabled or not fully_allocated(fd, view.nbytes):
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ucm-region-prefault", daemon=True)
            self._thread.start()
        self._queue.put((view[:], closing))  # the slice keeps the mapping alive while it is populated
        return True

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # Linux: a thread id names one thread; lowest priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (item := self._queue.get()) is not None:
            view, closing = item
            try:
                self._populate(view, closing)
            finally:
                view.release()

    def _populate(self, view: memoryview, closing: Callable[[], bool]) -> None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        for start in range(0, view.nbytes, STEP):
            if closing() or not self.enabled:
                return
            length = min(STEP, view.nbytes - start)
            if _libc.madvise(address + start, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if err == 22:  # EINVAL: a kernel before 5.14 has no MADV_POPULATE_WRITE
                    log.info(
                        "client regions: not prefaulted (%s); pages fault in on first use", os.strerror(err)
                    )
                    self.enabled = False
                return  # EFAULT/ENOMEM: the client changed its memory; first use faults as before
            self.populated_bytes += length
