"""Vector reads and writes that finish: ``preadv``/``pwritev`` resumed after short transfers, at most
:data:`IOV_MAX` segments a call (block files and pack files both use them)."""

from __future__ import annotations

import errno
import operator
import os
from collections.abc import Callable

from ucm_server.store.copying import IoVec
from ucm_server.store.format import CorruptBlock

IOV_MAX = 1024
"""Most segments one ``preadv``/``pwritev`` call takes (Linux ``IOV_MAX``)."""
_NBYTES = operator.attrgetter("nbytes")


def pwritev_all(fd: int, iov: IoVec, offset: int) -> None:
    """``pwritev`` until every byte is written (it may write less than asked)."""
    vector_io(os.pwritev, fd, iov, offset, short="")


SHORT_READ = "file ended before the payload did"
"""What a read that reaches the end of its file first says (the compiled pack reader says it too)."""


def preadv_all(fd: int, iov: IoVec, offset: int) -> None:
    """``preadv`` until every byte is read; a file that ends first is corrupt."""
    vector_io(os.preadv, fd, iov, offset, short=SHORT_READ)


def vector_io(call: Callable[..., int], fd: int, iov: IoVec, offset: int, *, short: str) -> None:
    """Run ``call`` over ``iov`` at most :data:`IOV_MAX` segments at a time, resuming after short
    transfers. Linear in the number of segments: a cursor moves along the list (a block may have
    hundreds of thousands of segments; removing each from the front made it quadratic).

    The usual call (at most :data:`IOV_MAX` segments, all moved at once) costs one system call and
    one C-level byte count: no per-segment Python, which a pack's run of small records would pay."""
    moved = 0
    if len(iov) <= IOV_MAX:
        total = sum(map(_NBYTES, iov))
        if not total:
            return
        moved = call(fd, iov, offset)
        if moved == total:
            return
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in iov if v.nbytes]
    i, count, n = 0, len(views), moved
    offset += moved
    while True:  # the cursor passes what the last call moved, then the next call moves the rest
        while i < count and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if i < count and n:
            views[i] = views[i][n:]
        if i >= count:
            return
        n = call(fd, views[i : i + IOV_MAX], offset)
        if n == 0:
            if short:
                raise CorruptBlock(short)
            raise OSError(errno.EIO, "pwritev made no progress")
        offset += n
