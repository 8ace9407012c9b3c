"""The Cache's batch copy (``copy_all``: merged ``memmove`` runs, split over two
threads when large) moves exactly the bytes the plain segment-by-segment copy moves, whatever the
segmentation: blocks side by side (runs merge), apart (they do not), empty segments, blocks below the
run threshold, and batches large enough to be split between two threads (a run cut in the middle).
Each test runs twice: with the compiled helper (one ``copy_pairs`` call) and without it (a build
with no C compiler: ``memmove`` runs and slice assignments)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from ucm_protocol.native import native
from ucm_server.store import copying
from ucm_server.store.copying import RUN_COPY_MIN, SPLIT_COPY_BYTES, IoVec, copy_all, copy_iov
from ucm_server.store.io_classes import ClassedExecutor, IoClass
from ucm_server.store.spans import copy_spans


@pytest.fixture(autouse=True, params=["helper", "no helper"])
def helper(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a daemon copies: with the compiled helper where it is built, without it elsewhere."""
    if request.param == "no helper":
        monkeypatch.setattr(copying, "native", None)
    elif native is None:
        pytest.skip("the compiled helper is not built here (no C compiler at install)")


def _cut(view: memoryview, pos: int, size: int, rng: random.Random) -> tuple[list[memoryview], int]:
    segs: list[memoryview] = []
    left = size
    while left:
        n = min(left, rng.choice([1, 4096, 65536, 1 << 20, left]))
        segs.append(view[pos : pos + n])
        pos, left = pos + n, left - n
        if rng.random() < 0.2:
            segs.append(view[pos:pos])  # an empty segment
    return segs, pos


@pytest.mark.parametrize("seed", range(40))
def test_copy_all_moves_the_same_bytes_as_copy_iov(seed: int) -> None:
    rng = random.Random(seed)
    total = 3 * SPLIT_COPY_BYTES
    src = bytearray(rng.randbytes(total))
    fast, slow = bytearray(total), bytearray(total)
    pairs_fast: list[tuple[IoVec, IoVec]] = []
    pairs_slow: list[tuple[IoVec, IoVec]] = []
    spos = dpos = 0
    while True:
        size = rng.choice([100, RUN_COPY_MIN - 1, RUN_COPY_MIN, 1 << 20, 3 << 20])
        if spos + size > total or dpos + size + 4096 > total:
            break
        s, spos_next = _cut(memoryview(src), spos, size, rng)
        d, _ = _cut(memoryview(fast), dpos, size, random.Random(seed * 7 + dpos))
        d2, dpos_next = _cut(memoryview(slow), dpos, size, random.Random(seed * 7 + dpos))
        pairs_fast.append((d, s))
        pairs_slow.append((d2, s))
        spos = spos_next + (4096 if rng.random() < 0.3 else 0)
        dpos = dpos_next + (4096 if rng.random() < 0.3 else 0)
    copy_all(pairs_fast)
    for d, s in pairs_slow:
        copy_iov(d, s)
    assert fast == slow
    assert any(fast)


@pytest.mark.parametrize("readonly_source", [False, True])
def test_single_segment_blocks_copy_exactly_from_writable_and_read_only_memory(readonly_source: bool) -> None:
    """The one-segment fast path (addresses through ctypes, or numpy for read-only memory such as a
    client's bytes) moves exactly each block's bytes, and nothing next to them."""
    rng = random.Random(3)
    sizes = [1, RUN_COPY_MIN - 1, RUN_COPY_MIN, 1 << 20, 1 << 20, 5 << 20, 7]
    total = sum(sizes) + 4096 * len(sizes)
    raw = rng.randbytes(total)
    src = memoryview(raw) if readonly_source else memoryview(bytearray(raw))
    assert src.readonly is readonly_source
    dst = bytearray(b"\xee" * total)
    expected = bytearray(dst)
    pairs: list[tuple[IoVec, IoVec]] = []
    pos = 0
    for size in sizes:
        pairs.append(([memoryview(dst)[pos : pos + size]], [src[pos : pos + size]]))
        expected[pos : pos + size] = raw[pos : pos + size]
        pos += size + (4096 if size % 2 else 0)  # some blocks apart, some side by side
    copy_all(pairs)
    assert dst == expected
    assert dst != bytearray(b"\xee" * total)  # negative control: the copy did something


@pytest.mark.parametrize("by_spans", [False, True])
def test_a_background_copy_is_held_between_its_pieces_while_a_load_runs(by_spans: bool) -> None:
    """A dump's copy (``copy_all`` in a BACKGROUND job of a classed pool, or ``copy_spans`` of the
    same blocks by offsets) stops before each piece of about SPLIT_COPY_BYTES while a load runs,
    then copies every byte once the load ended; the same copy in a load's job is never held."""
    pool = ClassedExecutor(2, background_hold_s=30)
    load_gate, load_started = threading.Event(), threading.Event()
    block = SPLIT_COPY_BYTES // 2
    src = bytearray(random.Random(5).randbytes(3 * block))
    dst = bytearray(len(src))
    pairs: list[tuple[IoVec, IoVec]] = [
        ([memoryview(dst)[i * block : (i + 1) * block]], [memoryview(src)[i * block : (i + 1) * block]])
        for i in range(3)
    ]

    def load() -> None:
        load_started.set()
        assert load_gate.wait(30)

    try:
        running = pool.submit_as(IoClass.LOAD, load)
        assert load_started.wait(30)
        side = bytearray(len(src))
        side_pairs = [([memoryview(side)[: len(src)]], [memoryview(src)])]
        pool.submit_as(IoClass.LOAD, copy_all, side_pairs).result(30)  # a load's copy: not held
        assert side == src
        if by_spans:
            at = [i * block for i in range(3)]
            spans = (memoryview(dst), at, memoryview(src), at, [block] * 3)
            dump = pool.submit_as(IoClass.BACKGROUND, copy_spans, *spans)
        else:
            dump = pool.submit_as(IoClass.BACKGROUND, copy_all, pairs)
        deadline = time.monotonic() + 30
        while pool.held_background != 1:
            assert time.monotonic() < deadline, "the background copy was never held"
            time.sleep(0.001)
        assert not dump.done() and not any(dst), "bytes moved while a load ran"
        load_gate.set()
        running.result(30)
        dump.result(30)
        assert dst == src
    finally:
        load_gate.set()
        pool.shutdown()
