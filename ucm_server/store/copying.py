"""Copying a block's bytes between iovecs: the daemon's copy engine.

Bytes move through *iovecs*: a sequence of memoryviews whose concatenation is the block, so a block
whose layers sit apart in a client's memory is copied straight to and from those places. A batch
becomes a few long runs (merged where blocks continue each other on both sides), copied in one call
of the compiled helper where it is built: split over two threads for big batches, with
non-temporal stores for batches larger than the cache (without the helper: ``memmove`` runs and
slice assignments). A Load's copy can go segment by segment across its blocks so the client may use
the first layers early (:func:`copy_in_order`). Every tier and the pipeline copy through here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ucm_protocol.native import native
from ucm_server.store.io_classes import may_yield, yield_to_loads

IoVec = Sequence[memoryview]
"""A block's bytes as an ordered list of memory segments (scatter/gather)."""


def iov_len(iov: IoVec) -> int:
    if len(iov) == 1:  # the usual block: one segment (a third of the generator's cost)
        return iov[0].nbytes
    return sum(m.nbytes for m in iov)


def copy_iov(dst: IoVec, src: IoVec) -> None:
    """Copy ``src`` into ``dst`` (equal total length) segment by segment, splitting where they differ."""
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        n = min(d.nbytes - doff, s.nbytes - soff)
        d[doff : doff + n] = s[soff : soff + n]
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0


RUN_COPY_MIN = 256 << 10
"""Blocks at least this large are copied as address runs (:func:`copy_all`); smaller ones as slices."""


def copy_all(pairs: Sequence[tuple[IoVec, IoVec]]) -> None:
    """Copy each ``(dst, src)`` pair of a batch, large blocks as few, long ``memmove`` runs.

    Where consecutive blocks continue each other on both sides (a client's KV blocks side by side,
    the arena's pages allocated in order), their copies merge into one: one long copy runs at memcpy
    speed (the C library switches to non-temporal stores for long copies), while a slice assignment
    per 64 KiB page costs a Python step each and keeps the cache busy. Where the compiled helper is
    built, the whole batch is one ``copy_pairs`` call: the runs merged in C, the GIL released for
    every byte, a batch of :data:`SPLIT_COPY_BYTES` or more copied by two threads of its own (no
    Python thread to wake, which waited for the GIL while the event loop worked), and one of
    :data:`STREAM_COPY_BYTES` or more with non-temporal stores. Without it,
    ``ctypes.memmove`` (which also releases the GIL) copies blocks from :data:`RUN_COPY_MIN` on, with
    addresses from the very memoryviews (:func:`_address`), within their bounds, and slice
    assignments the smaller ones.
    """
    if not may_yield():
        _copy_batch(pairs, STREAM_COPY_BYTES)
        return
    # Background work (a dump's copy): pieces of about SPLIT_COPY_BYTES, held between them while
    # loads run (:func:`~ucm_server.store.io_classes.yield_to_loads`), each copied the way the
    # whole batch would be (past the cache when the batch is large enough), with or without the helper.
    sizes = [iov_len(dst) for dst, _ in pairs]
    stream = 1 if sum(sizes) >= STREAM_COPY_BYTES else 0
    for start, stop in byte_pieces(sizes, SPLIT_COPY_BYTES):
        yield_to_loads()
        _copy_batch(pairs[start:stop], stream)


def byte_pieces(sizes: Sequence[int], most: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive runs of ``sizes``, each ending at the item that brings it
    to ``most`` bytes (the last run less): the pieces a background copy is held between."""
    bounds: list[tuple[int, int]] = []
    start = filled = 0
    for i, n in enumerate(sizes):
        filled += n
        if filled >= most:
            bounds.append((start, i + 1))
            start, filled = i + 1, 0
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


def _copy_batch(pairs: Sequence[tuple[IoVec, IoVec]], stream_bytes: int) -> None:
    """:func:`copy_all` of one batch, without holds: the compiled helper's one call (non-temporal
    stores from ``stream_bytes`` on, 0: never), or ``memmove`` runs and slice assignments."""
    if native is not None:
        native.copy_pairs(
            pairs if isinstance(pairs, list) else list(pairs),
            split_bytes=SPLIT_COPY_BYTES,
            stream_bytes=stream_bytes,
        )
        return
    runs: list[list[int]] = []
    for dst, src in pairs:
        if len(dst) == 1 and len(src) == 1 and (n := dst[0].nbytes) == src[0].nbytes:
            if n < RUN_COPY_MIN:  # one segment on each side (the usual block): no walk
                dst[0][:] = src[0]
                continue
            pieces = [(_address(dst[0]), _address(src[0]), n, 0)]
        elif iov_len(dst) < RUN_COPY_MIN:
            copy_iov(dst, src)
            continue
        else:
            pieces = _pieces(dst, src)
        for d, s, n, _ in pieces:
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
                last[2] += n
            else:
                runs.append([d, s, n])
    _memmove_runs(runs)


def copy_in_order(pairs: Sequence[tuple[IoVec, IoVec]], report: Callable[[int], None]) -> None:
    """Copy each ``(dst, src)`` pair of a batch segment by segment of the destinations: segment 0 of
    every block, ``report(1)``, then segment 1 of every block, ``report(2)``, and so on (a block with
    fewer segments is complete from its last one on). A Load's client can so read the first
    segments of every block (vLLM's first layers) while later ones are still copied
    (:mod:`ucm_server.load_progress`). The first round is split over two threads like any large
    copy (the reader waits for it, its core idle); later rounds run on this thread alone, in
    order, while the reader computes on the other core: a split there would take that core.

    With the compiled helper, each round is one ``copy_pairs`` call, with non-temporal stores once
    the batch is :data:`STREAM_COPY_BYTES` or more, as :func:`copy_all` copies: the copy then runs
    while vLLM computes on the same two cores, and on 62 MiB of KV (31 blocks of 8 layers) the
    rounds took 4.1 ms streamed against 6.5-7.5 ms of ``memmove`` runs."""
    if native is not None:
        _copy_in_order_native(pairs, report)
        return
    walks = [_walk(dst, src) for dst, src in pairs]  # each block's pieces, walked one round at a time
    pending = [next(walk, None) for walk in walks]
    segment = 0
    while any(piece is not None for piece in pending):
        runs: list[list[int]] = []
        for i, walk in enumerate(walks):
            piece = pending[i]
            while piece is not None and piece[3] == segment:
                d, s, n, _ = piece
                last = runs[-1] if runs else None
                if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
                    last[2] += n
                else:
                    runs.append([d, s, n])
                piece = next(walk, None)
            pending[i] = piece
        if segment == 0:
            _memmove_runs(runs, FIRST_ROUND_SPLIT_BYTES)
        else:
            _memmove_all(runs)
        segment += 1
        report(segment)


def _copy_in_order_native(pairs: Sequence[tuple[IoVec, IoVec]], report: Callable[[int], None]) -> None:
    """:func:`copy_in_order` through the compiled helper: round ``k`` pairs destination segment
    ``k`` of every block with the source bytes at the same place of the block."""
    assert native is not None
    stream = 1 if sum(iov_len(dst) for dst, _ in pairs) >= STREAM_COPY_BYTES else 0
    rounds = max((len(dst) for dst, _ in pairs), default=0)
    sources = [_flat(src) for _, src in pairs]
    starts = [0] * len(pairs)
    for segment in range(rounds):
        batch: list[tuple[IoVec, IoVec]] = []
        for i, (dst, _) in enumerate(pairs):
            if segment >= len(dst) or not (n := dst[segment].nbytes):
                continue
            batch.append(([dst[segment]], _source_views(sources[i], starts[i], n)))
            starts[i] += n
        native.copy_pairs(
            batch, split_bytes=FIRST_ROUND_SPLIT_BYTES if segment == 0 else 0, stream_bytes=stream
        )
        del batch
        report(segment + 1)


def _flat(src: IoVec) -> list[tuple[int, memoryview]]:
    """``(offset in the block, view)`` of each non-empty source segment."""
    out: list[tuple[int, memoryview]] = []
    at = 0
    for view in src:
        if view.nbytes:
            out.append((at, view))
            at += view.nbytes
    return out


def _source_views(flat: list[tuple[int, memoryview]], start: int, n: int) -> list[memoryview]:
    """The source's bytes ``[start, start + n)`` as views of its segments (usually one)."""
    views: list[memoryview] = []
    end = start + n
    for at, view in flat:
        if at + view.nbytes <= start:
            continue
        if at >= end:
            break
        views.append(view[max(start - at, 0) : min(end - at, view.nbytes)])
    return views


SPLIT_COPY_BYTES = 8 << 20
"""A batch at least this large is copied by two threads, each half of the bytes (GIL released)."""
STREAM_COPY_BYTES = 16 << 20
"""A batch at least this large is copied with non-temporal stores by the compiled helper: the C
library's ``memcpy`` (``rep movsb`` on these CPUs) reads each destination line before writing it,
which for a batch larger than the cache is wasted traffic. Measured against numpy's copy of the
same bytes, 256 blocks of 64 KiB to scattered pages: 0.88x with ``memcpy``, 1.09x streamed at
16 MiB; 1.03x and 1.42x at 64 MiB (1.74x on two threads). At 4 MiB the cache wins (1.57x against
1.10x), so smaller batches keep ``memcpy``."""
FIRST_ROUND_SPLIT_BYTES = 1 << 20
""":func:`copy_in_order`'s first round is split from this size on: its reader waits for it."""
_helper: ThreadPoolExecutor | None = None


def _memmove_runs(runs: list[list[int]], split_bytes: int = SPLIT_COPY_BYTES) -> None:
    """Copy the runs; a batch of ``split_bytes`` or more in two halves at once, this thread and one
    helper thread (a ``memmove`` releases the GIL: where memory bandwidth allows, two cores copy
    faster than one)."""
    total = sum(n for _, _, n in runs)
    if total < split_bytes:
        _memmove_all(runs)
        return
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="ucm-copy")
    first, *rest = _cut(runs, total - total // 2)
    other = _helper.submit(_memmove_all, [run for part in rest for run in part])
    _memmove_all(first)
    other.result()


def _cut(runs: list[list[int]], most: int) -> list[list[list[int]]]:
    """``runs`` in consecutive parts of ``most`` bytes (the last one less), a run split where a
    part ends."""
    parts: list[list[list[int]]] = [[]]
    room = most
    for d, s, n in runs:
        done = 0
        while n - done > room:
            if room:
                parts[-1].append([d + done, s + done, room])
                done += room
            parts.append([])
            room = most
        if n > done:
            parts[-1].append([d + done, s + done, n - done])
            room -= n - done
    return [part for part in parts if part]


def _memmove_all(runs: list[list[int]]) -> None:
    for d, s, n in runs:
        ctypes.memmove(d, s, n)


def _address(view: memoryview) -> int:
    """The first byte's address: through ctypes for a writable view (a sixth of numpy's cost, which
    adds up at two views per block), through numpy for a read-only one (ctypes refuses those)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _pieces(dst: IoVec, src: IoVec) -> list[tuple[int, int, int, int]]:
    """``(dst address, src address, length, dst segment index)`` pieces of one copy, split where the
    segments differ (as :func:`copy_iov` walks them)."""
    return list(_walk(dst, src))


def _walk(dst: IoVec, src: IoVec) -> Iterator[tuple[int, int, int, int]]:
    """:func:`_pieces` one at a time, in destination order (an ordered copy starts on the first
    segments before the walk has reached the last ones)."""
    di = si = doff = soff = 0
    daddr = saddr = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        if d.nbytes == 0:
            di += 1
            continue
        if s.nbytes == 0:
            si += 1
            continue
        if doff == 0:
            daddr = _address(d)
        if soff == 0:
            saddr = _address(s)
        n = min(d.nbytes - doff, s.nbytes - soff)
        yield (daddr + doff, saddr + soff, n, di)
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0
