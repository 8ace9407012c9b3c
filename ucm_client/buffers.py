"""Shared memory the daemon can copy into and out of directly.

A :class:`SharedBuffer` is a POSIX shared-memory object under ``/dev/shm`` created with mode 0600 (only
this user — and so the daemon running as this user — can open it), mapped into this process. Register
it with the client once; then Load/Dump name offsets in it and no KV byte crosses the socket.

The object is unlinked when the buffer is closed or garbage-collected, or at interpreter exit. A process
killed with ``kill -9`` leaves its object behind (the daemon has already unmapped it when the session
ended); ``ucm-admin`` lists such leftovers by their ``ucm-`` prefix.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "ucm-"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedBuffer:
    """``size`` bytes of owner-only shared memory, zero-filled."""

    def __init__(self, size: int, *, label: str = "") -> None:
        if size <= 0:
            raise ValueError(f"SharedBuffer size must be positive, got {size}")
        self.size = size
        self.label = label
        fname = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = str(SHM_DIR / fname)
        self.name = "/" + fname
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask says
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

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
        """Unmap and unlink. Views obtained from :meth:`array`/:meth:`torch` must be dropped first."""
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
        return f"SharedBuffer({self.name!r}, size={self.size})"
