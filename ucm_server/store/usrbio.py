"""The hf3fs USRBIO binding as the DS3FS tier uses it: one job, batched file I/O through 3FS io rings.

USRBIO (``hf3fs_fuse.io``) moves bytes between files on a 3FS mount and a shared-memory iovec that the
3FS FUSE daemon has mapped too, through io rings: files are registered by fd, a batch of reads or
writes is prepared on a ring and submitted at once. This module holds that state (the iovec, one read
and one write ring) and nothing of the tier: which files to open (confined to the tier's root), the
block format and the index stay in :mod:`ucm_server.store.ds3fs`, which passes openers in.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ucm_server.store.copying import copy_iov

log = logging.getLogger(__name__)

__all__ = ["Usrbio"]


class Usrbio:
    """USRBIO state for one tier: a shared-memory iovec registered with the 3FS FUSE daemon and one
    read and one write ring. Calls are serialised (one batch uses the whole iovec)."""

    def __init__(self, h3io: Any, mount: Path, buffer_bytes: int, entries: int) -> None:
        from multiprocessing.shared_memory import SharedMemory

        self._h3io = h3io
        self.lock = threading.RLock()
        self._shm = SharedMemory(size=buffer_bytes, create=True)
        try:
            self._iov = h3io.make_iovec(self._shm, str(mount), 0, -1)
        finally:
            self._shm.unlink()  # the FUSE daemon holds its own mapping now; nothing left in /dev/shm
        self._buf = self._shm.buf
        self._read_ring = h3io.make_ioring(str(mount), entries, True, 0)
        self._write_ring = h3io.make_ioring(str(mount), entries, False, 0)

    def close(self) -> None:
        with self.lock:
            del self._read_ring, self._write_ring, self._iov
            self._buf = None
            try:
                self._shm.close()
            except BufferError:  # the binding may still hold a view; the mapping goes with the process
                log.debug("USRBIO shared memory still referenced at close")

    def _open_registered(
        self,
        path: Path,
        opener: Callable[[Path], int],
        fds: list[int | None],
        errs: list[OSError | None],
    ) -> None:
        """Open ``path`` and register its fd with the binding, appending (fd, None), or (None, the
        error) when it cannot be opened, so one bad file fails only its own slot of the batch."""
        try:
            fd = opener(path)
        except OSError as exc:
            fds.append(None)
            errs.append(exc)
            return
        self._h3io.register_fd(fd)
        fds.append(fd)
        errs.append(None)

    def read(
        self, paths: Sequence[Path], sizes: Sequence[int], opener: Callable[[Path], int]
    ) -> list[tuple[memoryview, OSError | None]]:
        """Read whole files (opened by ``opener``: the tier's confined open) into consecutive slices
        of the iovec with one submit."""
        with self.lock:
            fds: list[int | None] = []
            errs: list[OSError | None] = []
            for p in paths:
                self._open_registered(p, opener, fds, errs)
            try:
                offsets = self._submit(self._read_ring, fds, sizes, True, errs)
            finally:
                self._release(fds)
            assert self._buf is not None
            return [(self._buf[o : o + s], e) for o, s, e in zip(offsets, sizes, errs, strict=True)]

    def write(
        self,
        paths: Sequence[Path],
        blobs: Sequence[Sequence[memoryview]],
        *,
        durable: bool,
        create: Callable[[Path], int],
    ) -> list[OSError | None]:
        """Create each file (by ``create``: the tier's confined create) and write its blob through
        the ring with one submit, then fsync."""
        with self.lock:
            assert self._buf is not None
            fds: list[int | None] = []
            errs: list[OSError | None] = []
            sizes: list[int] = []
            off = 0
            for p, blob in zip(paths, blobs, strict=True):
                n = sum(m.nbytes for m in blob)
                copy_iov([self._buf[off : off + n]], blob)
                off += n
                sizes.append(n)
                self._open_registered(p, create, fds, errs)
            try:
                self._submit(self._write_ring, fds, sizes, False, errs)
                for i, maybe_fd in enumerate(fds):
                    if maybe_fd is not None and errs[i] is None and durable:
                        try:
                            os.fsync(maybe_fd)
                        except OSError as exc:
                            errs[i] = exc
            finally:
                self._release(fds)
            return errs

    def _submit(
        self,
        ring: Any,
        fds: Sequence[int | None],
        sizes: Sequence[int],
        for_read: bool,
        errs: list[OSError | None],
    ) -> list[int]:
        offsets: list[int] = []
        off = 0
        prepared = 0
        for i, (fd, size) in enumerate(zip(fds, sizes, strict=True)):
            offsets.append(off)
            if fd is not None:
                ring.prepare(self._iov[off : off + size], for_read, fd, 0, userdata=i)
                prepared += 1
            off += size
        if prepared:
            for done in ring.submit().wait(min_results=prepared):
                i = int(done.userdata)
                if done.result < 0:
                    errs[i] = OSError(-done.result, os.strerror(-done.result))
                elif done.result != sizes[i]:
                    errs[i] = OSError(
                        f"short {'read' if for_read else 'write'}: {done.result} of {sizes[i]} bytes"
                    )
        return offsets

    def _release(self, fds: Sequence[int | None]) -> None:
        for fd in fds:
            if fd is not None:
                self._h3io.deregister_fd(fd)
                os.close(fd)
