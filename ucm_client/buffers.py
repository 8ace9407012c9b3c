"""Shared memory the daemon can copy into and out of directly.

A :class:`SharedBuffer` is an anonymous ``memfd`` (nothing under ``/dev/shm``, nothing left behind when
the process ends), mapped into this process. Register it with the client once: the client passes the
file descriptor itself to the daemon over its Unix socket (``SCM_RIGHTS``); no other process can name
it. Then Load/Dump name offsets in it and no KV byte crosses the socket.

Two properties protect both sides:

- every page is allocated up front (``posix_fallocate``), so the memory is billed to this process's
  cgroup, not to the daemon's when it first writes a page, and a memory limit that is too small fails
  here, with :class:`SharedMemoryError` naming the size, instead of as a ``SIGBUS`` later. The daemon
  takes no other memory: a memfd with holes is refused, and one punched after registration is
  dropped (and its pages freed), so keep a registered buffer's pages allocated;
- the file is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then
  ``F_SEAL_SEAL``): nothing this process does to it can pull pages from under the daemon's mapping
  (which would crash the daemon with ``SIGBUS``). The daemon refuses memory without ``F_SEAL_SHRINK``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from ucm_client.errors import ArgumentTypeError, InvalidArgument
from ucm_protocol.errors import ResourceExhausted
from ucm_protocol.host import available_memory

if TYPE_CHECKING:
    import torch

PREFIX = "ucm-"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedMemoryError(ResourceExhausted, MemoryError):
    """The memory for a :class:`SharedBuffer` could not be allocated (a cgroup / container limit)."""


def _allocate(fd: int, size: int, label: str) -> None:
    """Allocate every page now, so a too-small limit fails here with a clear message.

    A size past the memory left is refused before a page is allocated: shared memory (a memfd) has no
    limit of its own, so the kernel would hand out pages until its OOM killer ends this process, the
    daemon, or anything else on the host (``ucm-admin bench --block-size 1TiB`` did exactly that)."""
    what = f" ({label})" if label else ""
    left = available_memory()
    if left is not None and size > left:
        raise SharedMemoryError(
            f"could not allocate {size} bytes ({size / 2**20:.1f} MiB) of shared memory for the KV "
            f"buffer{what}: only {max(left, 0)} bytes ({max(left, 0) / 2**20:.1f} MiB) of memory are "
            "available on this host or in this container; make the KV buffer smaller or free memory"
        )
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise SharedMemoryError(
            f"could not allocate {size} bytes ({size / 2**20:.1f} MiB) of shared memory for the KV "
            f"buffer{what}: {exc.strerror or exc}. The process's memory limit is too small for it: "
            "raise the memory limit of this process/container (cgroup memory.max, docker --memory, "
            "Kubernetes resources.limits.memory) or make the KV buffer smaller"
        ) from None


class SharedBuffer:
    """``size`` bytes of sealed, preallocated, zero-filled shared memory (a memfd)."""

    def __init__(self, size: int, *, label: str = "") -> None:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ArgumentTypeError(f"SharedBuffer size must be an integer, got {type(size).__name__}")
        if size <= 0:
            raise InvalidArgument(f"SharedBuffer size must be positive, got {size}")
        self.size = size
        self.label = label
        # Diagnostics only (it shows in /proc/<pid>/maps as /memfd:NAME); the daemon never sees names.
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            _allocate(fd, size, label)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ENOMEM:
                msg = f"could not map {size} bytes of shared memory: {exc.strerror}"
                raise SharedMemoryError(msg) from None
            raise
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        self.buf = memoryview(self._map)

    @property
    def path(self) -> str:
        """A path that opens this same memory (``/proc/<pid>/fd/<fd>``), for tools; "" once closed."""
        fd = self.fileno()
        return f"/proc/{os.getpid()}/fd/{fd}" if fd >= 0 else ""

    def fileno(self) -> int:
        """The memfd, which the client hands to the daemon; -1 once closed."""
        return self._fd if self._finalizer.alive else -1

    def array(self, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray[Any, Any]:
        """A numpy view (no copy) of the whole buffer, or of its first ``prod(shape)`` items."""
        arr = np.frombuffer(self._map, dtype=dtype)
        if shape is not None:
            n = int(np.prod(shape))
            arr = arr[:n].reshape(shape)
        return arr

    def torch(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D torch view (no copy) of the whole buffer; needs torch."""
        import torch

        t = torch.frombuffer(self._map, dtype=torch.uint8)
        return t if dtype is None else t.view(dtype)

    def close(self) -> None:
        """Unmap and close. Views obtained from :meth:`array`/:meth:`torch` must be dropped first.

        The daemon keeps its own mapping of a registered buffer until the region is unregistered or the
        session ends, so closing here never affects the daemon."""
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it does
        self._finalizer()

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        label = f", label={self.label!r}" if self.label else ""
        return f"SharedBuffer({self.name!r}, size={self.size}{label})"
