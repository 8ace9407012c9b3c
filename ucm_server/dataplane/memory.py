"""Shared memory the daemon makes for its clients: a memfd of a fixed size, mapped, then sealed.

``F_SEAL_SHRINK | F_SEAL_GROW`` keep the size, so neither side's mapping can lose pages under it
(a SIGBUS); ``F_SEAL_SEAL`` keeps the seals. ``read_only`` adds ``F_SEAL_FUTURE_WRITE`` (Linux
5.1+): the daemon's own mapping, made before, keeps writing; nobody can map it writable or
``write()`` it any more, whoever opens it, also through ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(
    name: str, size: int, fill: Callable[[mmap.mmap], None], *, read_only: bool
) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes, mapped read-write here, ``fill``-ed (its header), then sealed: the
    descriptor and the mapping (the caller closes both). ``name`` starts ``ucmd-``: the daemon's own
    memory, told apart in ``/proc/<pid>/maps`` from the client memory it maps (``ucm-``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fill(mapped)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | (F_SEAL_FUTURE_WRITE if read_only else 0))
        except BaseException:
            mapped.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd, mapped
