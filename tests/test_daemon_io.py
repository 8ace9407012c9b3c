"""Block I/O through a real daemon process: round trips, lookups, tasks, the slow path."""

from __future__ import annotations

import os

import pytest
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import UcmError


@pytest.mark.slow
def test_round_trip_bytes_identical(client: UcmClient) -> None:
    n, size = 32, 256 << 10
    with SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(n * size)
        result = client.wait(client.dump(NS, blocks_in(rs, n, size)), 30)
        assert result.ok, result.reasons
        assert result.bytes_done == n * size
        result = client.wait(client.load(NS, blocks_in(rd, n, size)), 30)
        assert result.ok, result.reasons
        assert bytes(dst.buf) == bytes(src.buf)


def test_multi_segment_blocks_scatter_and_gather(client: UcmClient) -> None:
    """A block made of 3 separate pieces (like one block across 3 layers) comes back piece by piece."""
    with SharedBuffer(1 << 20) as src, SharedBuffer(1 << 20) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(1 << 20)
        pieces = [(0, 1000), (300_000, 70_000), (900_000, 5)]
        key = key_digest("multi")
        assert client.wait(
            client.dump(NS, [BlockIO(key, tuple(Segment(rs, o, n) for o, n in pieces))]), 10
        ).ok
        # Read it back into a different layout of the same total size.
        total = sum(n for _, n in pieces)
        assert client.wait(client.load(NS, [BlockIO(key, (Segment(rd, 10, total),))]), 10).ok
        expected = b"".join(bytes(src.buf[o : o + n]) for o, n in pieces)
        assert bytes(dst.buf[10 : 10 + total]) == expected


def test_lookup_reports_presence_and_hit_prefix(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 8, 4096)
    assert client.wait(client.dump(NS, blocks[:5]), 10).ok
    keys = [b.key for b in blocks]
    # key 6 stored too, after a gap: present but outside the prefix
    assert client.wait(client.dump(NS, [blocks[6]]), 10).ok
    result = client.lookup(NS, keys)
    assert result.present == [True] * 5 + [False, True, False]
    assert result.hit_prefix == 5
    other_ns = client.lookup(b"\x01" * 16, keys)
    assert other_ns.hit_prefix == 0 and not any(other_ns.present)


@pytest.mark.slow
def test_thousands_of_blocks_in_one_call(client: UcmClient) -> None:
    n, size = 4096, 1024
    with SharedBuffer(n * size) as buf:
        region = client.register(buf)
        buf.buf[:] = os.urandom(n * size)
        blocks = blocks_in(region, n, size)
        assert client.wait(client.dump(NS, blocks), 60).ok
        assert client.lookup(NS, [b.key for b in blocks]).hit_prefix == n


def test_missing_blocks_are_reported_per_block(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 4, 4096)
    assert client.wait(client.dump(NS, blocks[:2]), 10).ok
    result = client.wait(client.load(NS, blocks), 10)
    assert result.done and not result.ok
    assert result.states == [BlockState.OK, BlockState.OK, BlockState.MISSING, BlockState.MISSING]


def test_wait_can_be_called_repeatedly_and_check_agrees(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    task = client.dump(NS, blocks_in(region, 4, 4096))
    first = client.wait(task, 10)
    again = client.wait(task, 10)
    checked = client.check(task)
    assert first.ok and again.ok and checked.ok
    assert first.states == again.states == checked.states


def test_delete_removes_from_every_tier(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 3, 4096)
    assert client.wait(client.dump(NS, blocks, wait_durable=True), 10).ok
    assert client.delete(NS, [b.key for b in blocks[:2]]) == 2
    assert client.lookup(NS, [b.key for b in blocks]).present == [False, False, True]


def test_slow_path_put_and_get_bytes(client: UcmClient) -> None:
    items = [(key_digest("slow", i), os.urandom(10_000 + i)) for i in range(5)]
    result = client.put_blocks(NS, items)
    assert result.ok
    got = client.get_blocks(NS, [k for k, _ in items] + [key_digest("absent")])
    assert got[:5] == [d for _, d in items]
    assert got[5] is None


def test_prefetch_brings_blocks_back_into_cache(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 4, 64 << 10)
    assert client.wait(client.dump(NS, blocks, wait_durable=True), 10).ok
    client.aio  # noqa: B018 - the admin stub lives on the async client
    stats = client.stats()
    assert {t.name: t.blocks for t in stats.tiers}["Posix"] == 4
    result = client.wait(client.prefetch(NS, [b.key for b in blocks] + [key_digest("nope")]), 10)
    assert result.states == [BlockState.OK] * 4 + [BlockState.MISSING]


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.slow
def test_dump_reaches_the_disk(client: UcmClient, shm: SharedBuffer, daemon: object, durable: bool) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 4, 4096)
    assert client.wait(client.dump(NS, blocks, wait_durable=durable), 10).ok
    if durable:  # completed only once fsynced in Posix
        assert tiers_by_name(client)["Posix"].blocks == 4


def test_lookup_keys_with_zero_bytes_packed_and_unpacked(client: UcmClient, shm: SharedBuffer) -> None:
    """The packed Lookup path builds index keys with numpy: keys that end in (or are all) zero bytes
    must be found exactly, unpacked requests (a malformed key among them) must agree, and a miss
    between hits must stop the hit prefix where it is."""
    region = client.register(shm)
    stored = [bytes(32), b"\x07" + bytes(31), os.urandom(30) + b"\x00\x00", os.urandom(32)]
    blocks = [BlockIO(k, (Segment(region, i * 4096, 4096),)) for i, k in enumerate(stored)]
    assert client.wait(client.dump(NS, blocks, wait_durable=True), 10).ok
    absent = b"\x07" + bytes(30) + b"\x01"  # one byte away from a stored key
    asked = [stored[0], stored[1], absent, stored[2], stored[3]]
    answer = client.lookup(NS, asked)
    assert answer.present == [True, True, False, True, True]
    assert answer.hit_prefix == 2
    assert client.lookup(NS, stored).hit_prefix == len(stored)
    with pytest.raises(Exception, match=r"keys\[1\]"):  # not packable: sent key by key, named
        client.lookup(NS, [stored[0], stored[1][:31]])


@pytest.mark.parametrize("n", [2, 2047, 5000])
def test_lookup_a_malformed_key_is_named_even_when_the_lengths_add_up(
    client: UcmClient, shm: SharedBuffer, n: int
) -> None:
    """The client packs keys only when each is exactly 32 bytes, checked per key in C
    (``ucm_client.types.packed_keys``), not by the joined length: a 31-byte key next to a 33-byte
    one (all zero bytes, so the join is 32 * n zero bytes, like well-formed zero keys) must be an
    error naming the first bad index, in any run of a batch, never a silent answer about other keys.
    The same batch with both keys fixed is answered (the control)."""
    region = client.register(shm)
    zero = bytes(32)
    assert client.wait(client.dump(NS, [BlockIO(zero, (Segment(region, 0, 4096),))]), 10).ok
    keys = [key_digest("malformed", i) for i in range(n)]
    bad = n - 2  # the last two keys: in the last power-of-two run of the batch
    keys[bad], keys[bad + 1] = bytes(31), bytes(33)
    with pytest.raises(UcmError, match=rf"keys\[{bad}\].*32 bytes"):
        client.lookup(NS, keys)
    keys[bad], keys[bad + 1] = zero, zero
    answer = client.lookup(NS, keys)
    assert answer.present == [False] * bad + [True, True]


def test_load_nowait_answers_in_a_future_and_a_refused_load_is_that_futures_error(
    client: UcmClient, shm: SharedBuffer
) -> None:
    """``load_nowait``: loads sent without waiting each load their own bytes once their task id
    arrives; one the daemon refuses (a region it never registered) raises from its own future only."""
    region = client.register(shm)
    size = 4096
    shm.buf[: 4 * size] = os.urandom(4 * size)
    expected = bytes(shm.buf[: 4 * size])
    assert client.wait(client.dump(NS, blocks_in(region, 4, size)), 10).ok
    shm.buf[: 4 * size] = bytes(4 * size)
    good_a, good_b = blocks_in(region, 2, size), blocks_in(region, 2, size, first=2, offset=2 * size)
    futures = [
        client.load_nowait(NS, blocks) for blocks in (good_a, blocks_in(region + 999, 2, size), good_b)
    ]
    with pytest.raises(UcmError, match=r"(?i)region"):
        futures[1].result(10)
    for future in (futures[0], futures[2]):
        assert client.wait(future.result(10), 10).ok
    assert bytes(shm.buf[: 4 * size]) == expected


def test_dump_nowait_answers_in_a_future_and_a_refused_dump_is_that_futures_error(
    client: UcmClient, shm: SharedBuffer
) -> None:
    """``dump_nowait`` (how the vLLM connector saves): dumps sent without waiting store their own
    bytes once their task id arrives; one the daemon refuses (a region it never registered) raises
    from its own future only, and stores nothing."""
    region = client.register(shm)
    size = 4096
    shm.buf[: 4 * size] = os.urandom(4 * size)
    expected = bytes(shm.buf[: 4 * size])
    good_a, good_b = (
        blocks_in(region, 2, size, first=70),
        blocks_in(region, 2, size, first=72, offset=2 * size),
    )
    refused = blocks_in(region + 999, 2, size, first=74)
    futures = [client.dump_nowait(NS, blocks) for blocks in (good_a, refused, good_b)]
    with pytest.raises(UcmError, match=r"(?i)region"):
        futures[1].result(10)
    for future in (futures[0], futures[2]):
        assert client.wait(future.result(10), 10).ok
    assert client.lookup(NS, [b.key for b in refused]).hit_prefix == 0
    shm.buf[: 4 * size] = bytes(4 * size)
    assert client.wait(client.load(NS, [*good_a, *good_b]), 10).ok
    assert bytes(shm.buf[: 4 * size]) == expected
