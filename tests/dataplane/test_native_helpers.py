"""The compiled helper's per-block work: copies and checksums equal to the Python ones, without the GIL.

``copy_pairs`` (what ``copy_all`` uses for blocks below ``RUN_COPY_MIN``) moves every byte, any
segment split on either side, and refuses a pair whose sides differ in length before copying
anything. ``xxh3_64`` is ``xxhash.xxh3_64_intdigest`` of the concatenated segments. Both let another
thread run while they work: the point of having them (two cores, one GIL).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import xxhash
from support.dataplane import needs_native, ran_meanwhile

from ucm_protocol.native import native

pytestmark = needs_native
needs_xxh3 = pytest.mark.skipif(
    native is None or not hasattr(native, "xxh3_64"),
    reason="the helper was built without XXH3 (setup.py without UCM_HAVE_XXHASH)",
)


def test_a_built_helper_has_xxh3_and_the_record_reader() -> None:
    """xxHash's header ships with UCM, so wherever the helper builds it checksums and reads packed
    records without the GIL; it used to depend on a system package, and a machine without one ran the
    Python reader with no sign but skipped tests."""
    assert native is not None
    assert hasattr(native, "xxh3_64") and hasattr(native, "read_records")


def _split(view: memoryview, cuts: list[int]) -> list[memoryview]:
    edges = [0, *cuts, len(view)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


def test_copy_pairs_moves_every_byte_whatever_the_segments() -> None:
    rng = np.random.default_rng(4)
    src = rng.integers(0, 255, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = memoryview(src), memoryview(dst)
    pairs = [
        ([d[0:4096]], [s[0:4096]]),
        (_split(d[4096:12288], [100, 5000]), _split(s[4096:12288], [3, 4, 8000])),
        (_split(d[12288:12800], [0, 0, 512]), [s[12288:12800]]),  # empty segments on the way
        ([d[20000 : 20000 + 300_000]], _split(s[20000 : 20000 + 300_000], [7, 150_000])),
    ]
    assert native.copy_pairs(pairs) == 4096 + 8192 + 512 + 300_000
    for lo, hi in ((0, 12800), (20000, 320_000)):
        assert (dst[lo:hi] == src[lo:hi]).all()
    assert not dst[12800:20000].any() and not dst[320_000:].any()


def test_copy_pairs_refuses_unequal_sides_before_copying() -> None:
    src, dst = bytearray(os.urandom(8192)), bytearray(8192)
    s, d = memoryview(src), memoryview(dst)
    with pytest.raises(ValueError, match="pair 1: 4096 bytes of destination for 4095 of source"):
        native.copy_pairs([([d[:4096]], [s[:4096]]), ([d[4096:]], [s[4096:8191]])])
    assert dst == bytearray(8192)  # not even the good first pair
    with pytest.raises(BufferError):  # a read-only destination
        native.copy_pairs([([memoryview(bytes(4))], [s[:4]])])
    with pytest.raises(TypeError, match="pair 0 is not a"):
        native.copy_pairs([[[d[:4]], [s[:4]]]])


@needs_xxh3
def test_xxh3_equals_xxhash() -> None:
    for size in (0, 1, 16, 240, 241, 4095, 65536, 1 << 20, (1 << 20) + 7):
        data = os.urandom(size)
        assert native.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), size
        view = memoryview(data)
        assert native.xxh3_64([view[: size // 3], view[size // 3 : size // 2], view[size // 2 :]]) == (
            xxhash.xxh3_64_intdigest(data)
        ), size


@needs_xxh3
def test_xxh3_of_many_blocks_at_once() -> None:
    """A batch of small blocks hashed in one call, which lets other threads run meanwhile: xxhash
    holds the GIL for each small block (it lets go only for large inputs)."""
    blocks = [os.urandom(4096 + i) for i in range(64)]
    views = [[memoryview(b)[:100], memoryview(b)[100:]] if i % 2 else b for i, b in enumerate(blocks)]
    assert native.xxh3_64_many(views) == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert native.xxh3_64_many([]) == []
    many = [memoryview(os.urandom(64 << 10))] * 8192  # 512 MiB of 64 KiB blocks
    assert ran_meanwhile(lambda: native.xxh3_64_many(many)) > 0


@pytest.mark.parametrize("split", [0, 8 << 20])  # one thread; two, the second one not Python's
def test_copy_pairs_lets_other_threads_run(split: int) -> None:
    size = 64 << 10
    src, dst = np.ones(4096 * size, np.uint8), np.zeros(4096 * size, np.uint8)
    s, d = memoryview(src), memoryview(dst)
    pairs = [([d[i * size : (i + 1) * size]], [s[i * size : (i + 1) * size]]) for i in range(4096)]
    native.copy_pairs(pairs)  # pages touched

    def slices() -> None:
        d[:] = s  # one slice assignment: the GIL held throughout, as for each block before

    assert ran_meanwhile(slices) == 0
    dst[:] = 0
    assert ran_meanwhile(lambda: native.copy_pairs(pairs * 3, split_bytes=split)) > 0
    assert (dst == 1).all()


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("split", [0, 1, 2, 4097, 1 << 20, 8 << 20])
def test_copy_pairs_split_over_two_threads_moves_every_byte_once(split: int, stream: int) -> None:
    """A batch copied by two threads (cut anywhere: inside a run, at a block's edge, inside a merged
    run of blocks side by side), with non-temporal stores or not (runs of any length and alignment),
    moves exactly the bytes one thread's ``memmove`` moves, and nothing next to them."""
    rng = np.random.default_rng(split)
    total = 12 << 20
    src = rng.integers(0, 255, total, dtype=np.uint8)
    one, two = np.zeros_like(src), np.zeros_like(src)
    cuts = sorted(set(rng.integers(1, total - 1, 40).tolist()))
    spans = [(a, b) for a, b in itertools.pairwise([0, *cuts, total]) if rng.random() < 0.8]  # some left out

    def pairs(dst: np.ndarray) -> list[tuple[list[memoryview], list[memoryview]]]:
        s, d = memoryview(src), memoryview(dst)
        return [
            ([d[a:b]], _split(s[a:b], [(b - a) // 3]) if (b - a) > 3 and i % 2 else [s[a:b]])
            for i, (a, b) in enumerate(spans)
        ]

    want = sum(b - a for a, b in spans)
    assert native.copy_pairs(pairs(one)) == want
    assert native.copy_pairs(pairs(two), split_bytes=split, stream_bytes=stream) == want
    assert (one == two).all()
    for a, b in spans:
        assert (two[a:b] == src[a:b]).all()


def test_copy_pairs_refuses_a_negative_split_or_stream_and_copies_nothing() -> None:
    src, dst = bytearray(os.urandom(4096)), bytearray(4096)
    with pytest.raises(ValueError, match="split_bytes and stream_bytes must be 0 or more"):
        native.copy_pairs([([memoryview(dst)], [memoryview(src)])], split_bytes=-1)
    with pytest.raises(ValueError, match="split_bytes and stream_bytes must be 0 or more"):
        native.copy_pairs([([memoryview(dst)], [memoryview(src)])], stream_bytes=-(1 << 62))
    with pytest.raises(TypeError):
        native.copy_pairs([([memoryview(dst)], [memoryview(src)])], split_bytes="8")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        native.copy_pairs([([memoryview(dst)], [memoryview(src)])], split_bytes=1 << 80)
    assert dst == bytearray(4096)
    assert native.copy_pairs([], split_bytes=1, stream_bytes=1) == 0  # nothing to copy, nothing split


def test_copy_pairs_streamed_moves_odd_lengths_and_alignments_exactly() -> None:
    """Non-temporal stores go 64 bytes at a time from a 16-byte-aligned destination: every
    head and tail length around that, and a source and destination that overlap (memmove's
    answer, not a torn one), copy exactly."""
    src = np.random.default_rng(9).integers(0, 255, 1 << 16, dtype=np.uint8)
    for d_at, s_at, n in itertools.product(
        [0, 1, 15, 16, 17, 63], [0, 3, 16], [0, 1, 15, 16, 63, 64, 65, 200]
    ):
        dst = np.zeros(1 << 16, np.uint8)
        assert (
            native.copy_pairs(
                [([memoryview(dst)[d_at : d_at + n]], [memoryview(src)[s_at : s_at + n]])], stream_bytes=1
            )
            == n
        )
        assert (dst[d_at : d_at + n] == src[s_at : s_at + n]).all()
        assert not dst[:d_at].any() and not dst[d_at + n :].any()
    buf = np.arange(4096, dtype=np.uint8)
    want = buf.copy()
    want[10:3010] = buf[0:3000]
    view = memoryview(buf)
    native.copy_pairs([([view[10:3010]], [view[0:3000]])], stream_bytes=1)
    assert (buf == want).all()
