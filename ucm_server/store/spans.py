"""A batch of blocks that each lie in one span of one buffer, copied with no object made per block.

The usual Load or Dump names, for each block, one ``(offset, length)`` of one client region. As
``(key, iovec)`` items that batch costs a memoryview, a list and a tuple per block before any byte
moves, and on a 64 KiB block that Python work on the event loop cost about as much as the copy.
:class:`SpanItems` carries the batch as it came instead: the keys, the region's view and two lists
of ints. The Cache (:meth:`ucm_server.store.cache.CacheTier.read_many` and ``write_many``) sees that
and copies the whole batch with one :func:`copy_spans` call between the region and the arena's
pages, by offsets. Anything else that reads the items (another tier, an ordered copy, admission)
gets ordinary ``(key, [view])`` pairs, made as it asks for them.

Every span is checked against both buffers inside :func:`copy_spans` (in the compiled helper, or
here without it), whatever checked it before: one bad span refuses the batch with nothing copied.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import overload

from ucm_protocol.keys import BlockKey
from ucm_protocol.native import native
from ucm_server.store.copying import SPLIT_COPY_BYTES, STREAM_COPY_BYTES, IoVec, byte_pieces
from ucm_server.store.io_classes import may_yield, yield_to_loads

SPLIT_MIN_BLOCK_BYTES = 256 << 10
"""A span batch is split over two copy threads (:data:`SPLIT_COPY_BYTES`) only when its blocks are
this large on average. Smaller blocks each cost the event loop their bookkeeping while they are
copied, and on two cores a second copy thread takes the core the loop needs: measured on 4,096
blocks of 64 KiB, the daemon's other threads spent 10-14 us of CPU a block with the split and
5-6 without, the loop the same, and Dump and Load ended no later without it."""


def split_over_threads(lengths: Sequence[int]) -> bool:
    """Whether a batch of blocks of ``lengths`` is copied by two threads: its blocks are
    :data:`SPLIT_MIN_BLOCK_BYTES` or more on average."""
    return bool(lengths) and sum(lengths) >= SPLIT_MIN_BLOCK_BYTES * len(lengths)


class SpanItems(Sequence[tuple[BlockKey, IoVec]]):
    """Blocks ``keys[i]`` at ``lengths[i]`` bytes from ``offsets[i]`` of ``view`` (checked already
    against the region; :func:`copy_spans` checks them again)."""

    __slots__ = ("keys", "lengths", "offsets", "view")

    def __init__(
        self, keys: Sequence[BlockKey], view: memoryview, offsets: list[int], lengths: list[int]
    ) -> None:
        self.keys, self.view, self.offsets, self.lengths = keys, view, offsets, lengths

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> tuple[BlockKey, IoVec]: ...
    @overload
    def __getitem__(self, i: slice) -> SpanItems: ...
    def __getitem__(self, i: int | slice) -> tuple[BlockKey, IoVec] | SpanItems:
        if isinstance(i, slice):
            return SpanItems(self.keys[i], self.view, self.offsets[i], self.lengths[i])
        at = self.offsets[i]
        return self.keys[i], [self.view[at : at + self.lengths[i]]]

    def __iter__(self) -> Iterator[tuple[BlockKey, IoVec]]:
        view = self.view
        for key, at, n in zip(self.keys, self.offsets, self.lengths, strict=True):
            yield key, [view[at : at + n]]


def keys_of(items: Sequence[tuple[BlockKey, IoVec]]) -> Sequence[BlockKey]:
    """The keys of a batch, without making a span batch's views."""
    return items.keys if isinstance(items, SpanItems) else [key for key, _ in items]


def copy_spans(
    dst: memoryview, dst_offsets: list[int], src: memoryview, src_offsets: list[int], lengths: list[int]
) -> None:
    """Copy ``lengths[i]`` bytes from ``src_offsets[i]`` of ``src`` to ``dst_offsets[i]`` of ``dst``
    for every i, as :func:`~ucm_server.store.copying.copy_all` copies a batch: in one call of the
    compiled helper (two threads from :data:`SPLIT_COPY_BYTES` where the blocks are large, past the
    cache from :data:`STREAM_COPY_BYTES`), and background work in pieces with loads let in between. Every span
    is checked before anything is copied (``ValueError`` naming the first bad one)."""
    if not may_yield():
        _copy(dst, dst_offsets, src, src_offsets, lengths, STREAM_COPY_BYTES)
        return
    _check(dst, dst_offsets, src, src_offsets, lengths)  # the whole batch, before its first piece
    stream = 1 if sum(lengths) >= STREAM_COPY_BYTES else 0
    for start, stop in byte_pieces(lengths, SPLIT_COPY_BYTES):
        yield_to_loads()
        _copy(dst, dst_offsets[start:stop], src, src_offsets[start:stop], lengths[start:stop], stream)


def _copy(
    dst: memoryview,
    dst_offsets: list[int],
    src: memoryview,
    src_offsets: list[int],
    lengths: list[int],
    stream_bytes: int,
) -> None:
    if native is not None:
        native.copy_spans(
            dst,
            dst_offsets,
            src,
            src_offsets,
            lengths,
            split_bytes=SPLIT_COPY_BYTES if split_over_threads(lengths) else 0,
            stream_bytes=stream_bytes,
        )
        return
    _check(dst, dst_offsets, src, src_offsets, lengths)
    for d, s, n in zip(dst_offsets, src_offsets, lengths, strict=True):
        dst[d : d + n] = src[s : s + n]


def _check(
    dst: memoryview, dst_offsets: list[int], src: memoryview, src_offsets: list[int], lengths: list[int]
) -> None:
    """The compiled helper's checks, in Python: every span inside both buffers (a memoryview's
    slice would clamp a bad one silently), and the three lists of one length."""
    if not len(dst_offsets) == len(src_offsets) == len(lengths):
        raise ValueError(
            f"{len(dst_offsets)} destination offsets and {len(src_offsets)} source offsets "
            f"for {len(lengths)} lengths"
        )
    if not lengths or (
        min(lengths) > 0
        and min(dst_offsets) >= 0
        and min(src_offsets) >= 0
        and max(map(operator.add, dst_offsets, lengths)) <= dst.nbytes
        and max(map(operator.add, src_offsets, lengths)) <= src.nbytes
    ):  # every span inside both buffers, in C-level passes (a background copy checks its whole
        return  # batch in its own thread before its first piece, beside the event loop)
    for i, (d, s, n) in enumerate(zip(dst_offsets, src_offsets, lengths, strict=True)):
        if n <= 0:
            raise ValueError(f"span {i} has length {n}")
        for at, buf, side in ((d, dst, "destination"), (s, src, "source")):
            if at < 0 or at + n > buf.nbytes:
                raise ValueError(
                    f"span {i}: {n} bytes at offset {at} are outside the {buf.nbytes}-byte {side}"
                )
