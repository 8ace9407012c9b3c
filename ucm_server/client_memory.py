"""The memfd behind client regions: accepted only fully allocated, checked around every copy.

Shared memory is charged to whoever first touches a page. Were the daemon the first to touch a page
of a client's memfd (one never allocated, or one with holes punched after registration), the page
would be charged to the daemon's memory cgroup, and a client could make the daemon hold any amount
of memory until the kernel OOM-kills it. So:

- a memfd is accepted (at handover and again at registration, after mapping) only when every page
  of it is allocated: ``st_blocks`` covers ``st_size`` (``SEEK_DATA`` cannot tell: shmem reports
  fallocated, never-written pages as holes). The client allocates (``ucm_client.SharedBuffer`` runs
  ``posix_fallocate``), so its pages are charged to the client;
- the daemon keeps a descriptor of each memfd (one per memfd, however many regions map it) and
  checks it before and after each task copies through one of its regions, and between the steps of
  the background prefault: size unchanged, still fully allocated;
- memory found with holes (or resized) is *tampered*: its regions are refused (``FAILED_PRECONDITION``)
  and dropped, and once the last copy through them ends the daemon punches the whole memfd
  (``FALLOC_FL_PUNCH_HOLE``): pages its copies may have allocated meanwhile are freed, not left
  charged to it while the client keeps the memfd open.

What this cannot see: holes punched exactly ahead of a running copy, in the pages that copy writes
next and no others, so that the copy refills every one of them before the check after it. The
kernel offers no lock against punching short of ``F_SEAL_FUTURE_WRITE``, and that seal forbids any
new writable mapping, so a restarted daemon could never map the memory again (clients re-register
their memory after a restart). Each such race moves the charge of at most what that one copy wrote,
of the attacker's own registered memory, to the daemon.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
ALLOCATE = (
    "allocate all of the memory before handing it over (posix_fallocate, as ucm_client.SharedBuffer "
    "does): the daemon never allocates a client's memory, and keep it allocated while it is registered"
)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def unallocated(st: os.stat_result) -> str | None:
    """Why memory with this ``fstat`` is not fully allocated, or None when every page is."""
    have = st.st_blocks * 512
    if have < st.st_size:
        return f"only {have} of {st.st_size} bytes are allocated"
    return None


class ClientMemory:
    """One client memfd, mapped by one or more regions: the daemon's descriptor of it and its checks.

    ``lock`` keeps a prefault step (which faults pages in) and :meth:`release` (which may punch them
    and closes the descriptor) apart."""

    def __init__(self, fd: int, st: os.stat_result, *, pid: int, uid: int, session_id: str) -> None:
        self.fd = fd
        self.key = (st.st_dev, st.st_ino)
        self.size = st.st_size
        self.pid, self.uid = pid, uid
        self.session_id = session_id
        """The session that registered it first (counted against that session's share)."""
        self.regions: set[object] = set()
        self.tampered = False
        """Found with holes (or resized): refused from then on, released once no copy uses it."""
        self.dropped = False
        """The region table has dropped its regions (set on the event loop only)."""
        self.closed = False
        self.lock = threading.Lock()

    def holes(self) -> str | None:
        """Why the memory is not as registered now (resized, holes), or None."""
        if self.closed:
            return "it was released"
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"it cannot be checked ({exc.strerror})"
        if st.st_size != self.size:
            return f"its size changed from {self.size} to {st.st_size} bytes"
        return unallocated(st)

    def release(self) -> None:
        """Close the descriptor; first punch the whole memfd if it was tampered with (pages the
        daemon's copies allocated would otherwise stay charged to it)."""
        with self.lock:
            if self.closed:
                return
            if self.tampered:
                mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
                if _libc().fallocate(self.fd, mode, 0, max(self.size, 1)) != 0:
                    err = ctypes.get_errno()
                    log.warning(
                        "client memory of pid %d: releasing its pages failed (%s)", self.pid, os.strerror(err)
                    )
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.closed = True
