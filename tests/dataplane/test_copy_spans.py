"""Copies by offsets (``copy_spans``): the usual Load and Dump moved between a client's region and the
Cache's arena with no view made per block, every span checked inside the compiled call.

The offsets and lengths come from a client's ring or request: hostile. Whatever checked them before,
the call itself refuses a span of length 0, one past either buffer's end (however the sum of offset
and length overflows), a value that is not an int in [0, 2**64), lists of different lengths, a
read-only destination, and then copies nothing at all, not even the good spans before the bad one.
The Python checks used without the helper refuse the same spans. Through the Cache, a span batch
stores and reads back the very bytes the per-block views do, and a bad span there fails the batch
with no block published and every page given back.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re

import numpy as np
import pytest
from support.dataplane import needs_native, ran_meanwhile

from ucm_protocol.keys import BlockKey
from ucm_protocol.native import native
from ucm_server.store import spans as spans_module
from ucm_server.store.cache import CacheTier
from ucm_server.store.copying import SPLIT_COPY_BYTES
from ucm_server.store.io_classes import ClassedExecutor, IoClass
from ucm_server.store.spans import SpanItems, copy_spans, keys_of

U64 = 1 << 64

BAD_SPANS = [  # (destination offsets, source offsets, lengths, what the error names), buffers of 4096
    ([0], [0], [0], "span 0 has length 0"),
    ([4090], [0], [7], "span 0: 7 bytes at offset 4090 are outside the 4096-byte destination"),
    ([0], [4096], [1], "span 0: 1 bytes at offset 4096 are outside the 4096-byte source"),
    ([U64 - 1], [0], [2], "outside the 4096-byte destination"),  # offset + length wraps to 1
    ([0], [U64 - 4096], [4096], "outside the 4096-byte source"),  # wraps to 0
    ([0], [0], [U64 - 1], "outside the 4096-byte destination"),
    ([0], [0], [1 << 63], "outside the 4096-byte destination"),
    ([0, 100, 200], [0, 100, 4000], [10, 10, 97], "span 2: 97 bytes at offset 4000"),  # the last one bad
]
NOT_INTS = [
    ([-1], [0], [1], "span 0: the destination offset is not an integer"),
    ([0], [U64], [1], "span 0: the source offset is not an integer"),
    ([0], [0], [1.0], "span 0: the length is not an integer"),
    ([0, 0], [0, 0], [1, "1"], "span 1: the length is not an integer"),
]


def _buffers() -> tuple[bytearray, bytearray]:
    return bytearray(4096), bytearray(os.urandom(4096))


@needs_native
@pytest.mark.parametrize(("dst_at", "src_at", "lengths", "error"), BAD_SPANS + NOT_INTS)
def test_the_compiled_call_refuses_a_bad_span_and_copies_nothing(
    dst_at: list[int], src_at: list[int], lengths: list[int], error: str
) -> None:
    dst, src = _buffers()
    good = ([1000], [1000], [16])  # a good span first: it is not copied either
    error = re.sub(r"^span (\d+)", lambda m: f"span {int(m[1]) + 1}", error)
    with pytest.raises(ValueError, match=re.escape(error)):
        native.copy_spans(dst, good[0] + dst_at, src, good[1] + src_at, good[2] + lengths)
    assert dst == bytearray(4096)


@pytest.mark.parametrize(("dst_at", "src_at", "lengths", "error"), BAD_SPANS)
def test_the_python_checks_refuse_the_same_spans(
    dst_at: list[int], src_at: list[int], lengths: list[int], error: str
) -> None:
    """Without the helper (no C compiler at install) :func:`copy_spans` checks in Python: a
    memoryview's slice clamps a bad span silently, so these checks are all that stands."""
    dst, src = _buffers()
    with pytest.raises(ValueError, match=error.rsplit(" are ", maxsplit=1)[-1]):
        spans_module._check(memoryview(dst), dst_at, memoryview(src), src_at, lengths)
    assert dst == bytearray(4096)


@needs_native
def test_the_compiled_call_refuses_what_is_not_two_buffers_and_three_lists() -> None:
    dst, src = _buffers()
    with pytest.raises(ValueError, match="2 destination offsets and 1 source offsets for 1 lengths"):
        native.copy_spans(dst, [0, 1], src, [0], [1])
    with pytest.raises(TypeError, match="lists or tuples of ints"):
        native.copy_spans(dst, np.zeros(1, np.uint64), src, [0], [1])
    with pytest.raises(BufferError):  # a read-only destination
        native.copy_spans(bytes(4096), [0], src, [0], [1])
    with pytest.raises(ValueError, match="split_bytes and stream_bytes must be 0 or more"):
        native.copy_spans(dst, [0], src, [0], [1], split_bytes=-1)
    assert dst == bytearray(4096)
    assert native.copy_spans(dst, [], src, [], []) == 0


@needs_native
@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("split", [0, 1, 4097, 8 << 20])
def test_the_compiled_call_moves_each_span_and_nothing_next_to_it(split: int, stream: int) -> None:
    """Spans in order and shuffled, side by side on both sides (merged into one run) or not, copied
    by one thread or two, past the cache or not: each lands where the slices put it."""
    rng = np.random.default_rng(split + stream)
    total = 12 << 20
    src = rng.integers(0, 255, total, dtype=np.uint8)
    cuts = sorted(set(rng.integers(1, total - 1, 60).tolist()))
    pieces = [(a, b - a) for a, b in itertools.pairwise([0, *cuts, total]) if rng.random() < 0.8]
    shuffled = [pieces[i] for i in rng.permutation(len(pieces))]
    for order, moved in ((pieces, False), (pieces, True), (shuffled, True)):
        # where they were (spans side by side merge into runs), or side by side in another order
        by_place = [order[i] for i in rng.permutation(len(order))]
        place = dict(zip(by_place, itertools.accumulate([0] + [n for _, n in by_place]), strict=False))
        dst_at = [place[piece] if moved else piece[0] for piece in order]
        want, got = np.zeros_like(src), np.zeros_like(src)
        for d, (a, n) in zip(dst_at, order, strict=True):
            want[d : d + n] = src[a : a + n]
        src_at, lengths = [a for a, _ in order], [n for _, n in order]
        nbytes = native.copy_spans(got, dst_at, src, src_at, lengths, split_bytes=split, stream_bytes=stream)
        assert nbytes == sum(n for _, n in order)
        assert (got == want).all()


def test_a_background_copy_refuses_a_bad_span_before_its_first_piece() -> None:
    """Background work copies in pieces (loads let in between): the whole batch is checked before
    the first one, so a bad last span still leaves every byte where it was."""
    pool = ClassedExecutor(2)
    piece = SPLIT_COPY_BYTES // 2
    src, dst = memoryview(bytearray(os.urandom(3 * piece))), memoryview(bytearray(3 * piece))
    try:
        job = pool.submit_as(IoClass.BACKGROUND, copy_spans, dst, [0, piece, 2 * piece + 1], src,
                             [0, piece, 2 * piece], [piece] * 3)  # fmt: skip
        with pytest.raises(ValueError, match=r"span 2: .* outside the .*-byte destination"):
            job.result(30)
        assert not any(dst)
    finally:
        pool.shutdown()


@needs_native
def test_the_compiled_call_lets_other_threads_run() -> None:
    size = 64 << 10
    src, dst = np.ones(4096 * size, np.uint8), np.zeros(4096 * size, np.uint8)
    at = [i * size for i in range(4096)]
    native.copy_spans(dst, at, src, at, [size] * 4096)  # pages touched
    assert ran_meanwhile(lambda: native.copy_spans(dst, at * 3, src, at * 3, [size] * (3 * 4096))) > 0


def _keys(n: int, tag: int) -> list[BlockKey]:
    return [BlockKey(bytes(16), bytes([tag]) + i.to_bytes(15, "little")) for i in range(n)]


def test_span_items_are_the_views_they_stand_for() -> None:
    region = memoryview(bytearray(os.urandom(1 << 16)))
    keys = _keys(4, 1)
    items = SpanItems(keys, region, [0, 100, 5000, 9000], [100, 50, 4000, 1])
    assert len(items) == 4 and keys_of(items) is keys
    pairs = [(k, bytes(v[0])) for k, v in items]
    assert pairs == [(keys[0], bytes(region[:100])), (keys[1], bytes(region[100:150])),
                     (keys[2], bytes(region[5000:9000])), (keys[3], bytes(region[9000:9001]))]  # fmt: skip
    assert bytes(items[2][1][0]) == bytes(region[5000:9000])
    tail = items[1:3]
    assert isinstance(tail, SpanItems) and [bytes(v[0]) for _, v in tail] == [p[1] for p in pairs[1:3]]
    assert keys_of([(k, v) for k, v in items]) == keys


@pytest.mark.parametrize("page", [64 << 10, 16 << 10])  # one page a block; several, and scattered
def test_the_cache_stores_and_reads_a_span_batch_as_it_does_views(page: int) -> None:
    """A span batch and the same blocks as views store the same bytes and read them back the same,
    whether a block's pages are one run or several (then one span a run)."""
    n, size = 40, 48 << 10

    async def main() -> None:
        t = CacheTier(capacity=8 * n * (64 << 10), page_size=page)
        await t.open()
        if page < size:  # scatter the free pages: a block then takes runs from here and there
            taken = t.arena.allocate(page * 37)
            assert taken is not None
            t.arena.free(taken[::2] if len(taken) > 1 else [(taken[0][0], 1)])
        src = memoryview(bytearray(os.urandom(n * size)))
        at = [i * size for i in reversed(range(n))]
        by_span, by_view = _keys(n, 1), _keys(n, 2)
        assert all(r.ok for r in await t.write_many(SpanItems(by_span, src, at, [size] * n)))
        assert all(r.ok for r in await t.write_many(list(SpanItems(by_view, src, at, [size] * n))))
        for keys in (by_span, by_view):
            dst = memoryview(bytearray(n * size))
            assert all(r.ok for r in await t.read_many(SpanItems(keys, dst, at, [size] * n)))
            assert bytes(dst) == bytes(src)
            again = memoryview(bytearray(n * size))
            assert all(r.ok for r in await t.read_many(list(SpanItems(keys, again, at, [size] * n))))
            assert bytes(again) == bytes(src)
        await t.close()

    asyncio.run(main())


def test_a_span_batch_read_names_each_block_it_cannot_serve() -> None:
    """Blocks missing or of another size fail alone, as with views; the others are read."""

    async def main() -> None:
        t = CacheTier(capacity=1 << 22)
        src = memoryview(bytearray(os.urandom(3 * 4096)))
        keys = _keys(3, 1)
        await t.write_many(SpanItems(keys[:2], src, [0, 4096], [4096, 4096]))
        dst = memoryview(bytearray(3 * 4096))
        got = await t.read_many(SpanItems(keys, dst, [0, 4096, 8192], [4096, 100, 4096]))
        assert got[0].ok and not got[1].ok and "length mismatch" in got[1].reason and not got[2].ok
        assert bytes(dst[:4096]) == bytes(src[:4096]) and not any(dst[4096:])
        assert not any(e.leases for e in t._index.values())

    asyncio.run(main())


def test_a_span_batch_of_held_blocks_naming_one_twice_reads_both_and_holds_none_after() -> None:
    """The usual read (every block held at its length) leases each block once per place it is
    named, copies every place, counts every one a hit, and gives every lease back: the block is
    then replaced at once, its old pages freed."""

    async def main() -> None:
        t = CacheTier(capacity=1 << 22)
        src = memoryview(bytearray(os.urandom(2 * 4096)))
        a, b = _keys(2, 1)
        await t.write_many(SpanItems([a, b], src, [0, 4096], [4096, 4096]))
        dst = memoryview(bytearray(3 * 4096))
        got = await t.read_many(SpanItems([a, b, a], dst, [0, 4096, 8192], [4096, 4096, 4096]))
        assert [r.ok for r in got] == [True] * 3
        assert bytes(dst) == bytes(src) + bytes(src[:4096])
        assert not any(e.leases for e in t._index.values())
        assert t.stats().hits == 3
        free = t.arena.free_pages
        await t.write_many(SpanItems([a], src, [4096], [4096]))  # replaced: the old page comes back
        assert t.arena.free_pages == free

    asyncio.run(main())


def test_a_span_past_the_region_fails_the_batch_with_nothing_stored_or_held() -> None:
    """Were the request's checks ever wrong, the copy's own refuses the span: the Dump stores none of
    the batch and gives every page back, the Load copies nothing and holds no block."""

    async def main() -> None:
        t = CacheTier(capacity=1 << 22)
        await t.open()
        free = t.arena.free_pages
        src = memoryview(bytearray(os.urandom(4 * 4096)))
        keys = _keys(3, 1)
        with pytest.raises(ValueError, match="outside the 16384-byte source"):
            await t.write_many(SpanItems(keys, src, [0, 4096, 12289], [4096, 4096, 4096]))
        assert t.arena.free_pages == free and not t._index and await t.lookup(keys) == [None] * 3
        await t.write_many(SpanItems(keys, src, [0, 4096, 8192], [4096, 4096, 4096]))
        dst = memoryview(bytearray(8192))
        with pytest.raises(ValueError, match="outside the 8192-byte destination"):
            await t.read_many(SpanItems(keys, dst, [0, 4096, U64 - 1], [4096, 4096, 4096]))
        assert not any(dst) and not any(e.leases for e in t._index.values())

    asyncio.run(main())
