"""Populating page tables ahead of use (``MADV_POPULATE_WRITE``), without stalling the daemon.

The Cache arena and registered client regions are faulted in by background threads so the first
copy into them is a memcpy. ``madvise(MADV_POPULATE_WRITE)`` holds the process's address-space lock
(``mmap_lock``, shared) for the whole range it populates, and every ``mmap``/``munmap`` of the
daemon waits for it: the event loop mapping a client's region at ``RegisterRegion``, a thread
starting (its stack), the allocator growing. On a host whose CPUs were busy (six spinning processes
beside the daemon, as a CPU vLLM engine or a test run makes them) a populating thread at nice 19 held
that lock for seconds at a time, because it rarely got a CPU: ``RegisterRegion`` passed its 10 s
deadline and the daemon did not come up within 30 s, stuck in ``vm_mmap_pgoff`` behind
``faultin_page_range``. So populating runs at the daemon's own priority, in steps of
:data:`POPULATE_STEP`, so the lock is held for one small step at a time and writers get it between
steps. Measured on that host: the daemon came up in 2.1-2.3 s and five token callers registered in
0.3-0.7 s, where nice 19 in 64 MiB steps never came up and nice 10 stalled registrations 4-5 s.
"""

from __future__ import annotations

import ctypes
import mmap

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: fault pages in writable without touching their contents (Python 3.11 lacks the name)."""
POPULATE_STEP = 2 << 20
"""Bytes populated per call: 512 pages, well under a millisecond of the kernel's work, so the
address-space lock is never held long and a range going away is noticed between steps."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
"""``madvise`` through ctypes, which drops the GIL (``mmap.madvise`` holds it for the whole call)."""


def populate_write(address: int, length: int) -> int:
    """Fault ``length`` bytes at ``address`` in, writable; 0, or the ``errno`` of the refusal
    (``EINVAL``: a kernel before 5.14; ``EFAULT``/``ENOMEM``: the range is no longer mapped whole)."""
    if _libc.madvise(address, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()
