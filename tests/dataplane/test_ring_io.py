"""Load and Dump through the session's ring, against a real daemon: what the RPC does, without it.

The bytes land, the results are the same (all OK answered from the ring; anything else through
``Check``), the refusals are the RPC's (same exception, same message), progress words work, and
whatever the ring cannot carry (a request larger than its arena, an argument the checked path must
name) goes by gRPC.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import struct
import threading
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.dataplane import needs_native

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_protocol.errors import UcmError
from ucm_protocol.wire import LOAD_PROGRESS_DONE
from ucm_server.testing.daemon import DaemonProcess

pytestmark = needs_native


def _via_ring(client: UcmClient, task_id: int) -> bool:
    return client._plane.owns(task_id)


def test_dump_and_load_through_the_ring(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    shm.buf[: 1 << 20] = os.urandom(1 << 20)
    blocks = blocks_in(region, 64, 16384)
    task = client.dump(NS, blocks)
    assert _via_ring(client, task)
    result = client.wait(task, 10)
    assert result.ok and result.bytes_done == 64 * 16384 and len(result.states) == 64
    back = blocks_in(region, 64, 16384, offset=4 << 20)
    task = client.load(NS, back)
    assert _via_ring(client, task)
    assert client.wait(task, 10).ok
    assert bytes(shm.buf[4 << 20 : (4 << 20) + (1 << 20)]) == bytes(shm.buf[: 1 << 20])
    assert client.check(task).ok  # answered again, from what the ring said


def test_blocks_of_several_segments(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    shm.buf[:65536] = os.urandom(65536)
    blocks = [
        BlockIO(key_digest("multi", i), tuple(Segment(region, i * 16384 + j * 4096, 4096) for j in range(4)))
        for i in range(4)
    ]
    assert _via_ring(client, task := client.dump(NS, blocks)) and client.wait(task, 10).ok
    back = [
        BlockIO(b.key, tuple(Segment(region, (1 << 20) + s.offset, s.length) for s in b.segments))
        for b in blocks
    ]
    assert client.wait(client.load(NS, back), 10).ok
    assert bytes(shm.buf[1 << 20 : (1 << 20) + 65536]) == bytes(shm.buf[:65536])


def test_missing_blocks_come_back_per_block(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    stored = blocks_in(region, 4, 4096)
    assert client.wait(client.dump(NS, stored), 10).ok
    asked = [*stored[:2], BlockIO(key_digest("absent"), (Segment(region, 1 << 20, 4096),)), stored[3]]
    task = client.load(NS, asked)
    assert _via_ring(client, task)
    result = client.wait(task, 10)
    assert result.done and not result.ok
    assert result.states == [BlockState.OK, BlockState.OK, BlockState.MISSING, BlockState.OK]


def _outcome(fn: object) -> tuple[str, str]:
    """The exception and its message (region ids differ between the two clients' sessions)."""
    try:
        fn()  # type: ignore[operator]
    except UcmError as exc:
        return type(exc).__name__, re.sub(r"region \d+", "region N", exc.message)
    return "ok", ""


def test_refusals_are_the_rpcs(tmp_path: Path) -> None:
    """The same mistakes through the ring and through gRPC: the same exception and message."""
    with (
        DaemonProcess(tmp_path / "d", args=["--max-block-bytes", "1MiB"]) as d,
        SharedBuffer(4 << 20) as buf,
        UcmClient(d.target) as ring,
        UcmClient(d.target, dataplane=False) as rpc,
    ):
        ids = {c: c.register(buf) for c in (ring, rpc)}
        cases = {
            "past the region": lambda c: c.dump(
                NS, [BlockIO(key_digest(1), (Segment(ids[c], 4 << 20, 4096),))]
            ),
            "too large": lambda c: c.dump(NS, [BlockIO(key_digest(1), (Segment(ids[c], 0, 2 << 20),))]),
            "zero length": lambda c: c.load(NS, [BlockIO(key_digest(1), (Segment(ids[c], 0, 0),))]),
            "empty": lambda c: c.dump(NS, []),
            "short key": lambda c: c.dump(NS, [BlockIO(b"short", (Segment(ids[c], 0, 4096),))]),
            "bad namespace": lambda c: c.dump(b"ns", [BlockIO(key_digest(1), (Segment(ids[c], 0, 4096),))]),
            "unknown handle": lambda c: c.dump(NS, [BlockIO(key_digest(1), (Segment(999, 0, 4096),))]),
            "overlapping loads": lambda c: c.load(
                NS, [BlockIO(key_digest(i), (Segment(ids[c], 0, 4096),)) for i in range(2)]
            ),
        }
        assert ring.wait(ring.dump(NS, blocks_in(ids[ring], 2, 4096)), 10).ok  # the channel is open
        for name, case in cases.items():
            through_ring = _outcome(lambda case=case: case(ring))
            through_rpc = _outcome(lambda case=case: case(rpc))
            assert through_ring == through_rpc, name
            assert through_ring[0] != "ok", name
        assert ring._plane.active


def test_nowait_submissions_and_their_refusals(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    futures = [
        client.dump_nowait(NS, blocks_in(region, 8, 4096, first=8 * i, offset=i * 32768)) for i in range(16)
    ]
    tasks = [f.result(10) for f in futures]
    assert all(client.wait(t, 10).ok for t in tasks)
    bad = client.load_nowait(NS, [BlockIO(key_digest(1), (Segment(region, 1 << 40, 4096),))])
    with pytest.raises(UcmError, match=r"past the end|beyond|outside"):
        bad.result(10)


def test_a_progress_word_through_the_ring(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = [
        BlockIO(key_digest("p", i), tuple(Segment(region, i * 8192 + j * 4096, 4096) for j in range(2)))
        for i in range(8)
    ]
    assert client.wait(client.dump(NS, blocks), 10).ok
    word = Segment(region, (8 << 20), 8)
    struct.pack_into("<Q", shm.buf, 8 << 20, 0)
    back = [
        BlockIO(b.key, tuple(Segment(region, (1 << 20) + s.offset, s.length) for s in b.segments))
        for b in blocks
    ]
    task = client.load(NS, back, progress=word)
    assert _via_ring(client, task)
    assert client.wait(task, 10).ok
    assert struct.unpack_from("<Q", shm.buf, 8 << 20)[0] == LOAD_PROGRESS_DONE


def test_a_request_larger_than_the_arena_goes_by_grpc(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "d", args=["--dataplane-ring-bytes", "64KiB"]) as d,
        UcmClient(d.target) as c,
        SharedBuffer(16 << 20) as buf,
    ):
        region = c.register(buf)
        small = c.dump(NS, blocks_in(region, 8, 4096))
        assert _via_ring(c, small) and c.wait(small, 10).ok
        big = blocks_in(region, 4096, 4096)  # a body of 229,392 bytes
        task = c.dump(NS, big)
        assert not _via_ring(c, task)
        assert c.wait(task, 30).ok
        assert c.lookup(NS, [b.key for b in big]).hit_prefix == 4096


def test_many_threads_share_one_ring(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    shm.buf[: 4 << 20] = os.urandom(4 << 20)

    def worker(i: int) -> bool:
        ok = True
        for round_ in range(10):
            blocks = blocks_in(region, 16, 4096, first=1000 * i + 16 * round_, offset=i * 65536)
            ok &= client.wait(client.dump(NS, blocks), 10).ok
            back = blocks_in(region, 16, 4096, first=1000 * i + 16 * round_, offset=(8 << 20) + i * 65536)
            ok &= client.wait(client.load(NS, back), 10).ok
        return ok

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(worker, range(8)))
    assert bytes(shm.buf[8 << 20 : (8 << 20) + 8 * 65536]) == bytes(shm.buf[: 8 * 65536])


def test_a_tcp_client_never_opens_a_channel() -> None:
    c = UcmClient("127.0.0.1:1")
    try:
        assert c._plane.channel() is None
    finally:
        c.close()


def test_the_ring_ends_with_its_session(client: UcmClient, shm: SharedBuffer, daemon: DaemonProcess) -> None:
    region = client.register(shm)
    assert client.wait(client.dump(NS, blocks_in(region, 2, 4096)), 10).ok
    ring = client._plane._channel.ring  # type: ignore[union-attr]
    client.close()
    assert ring.dead
    done = threading.Event()
    with UcmClient(daemon.target) as again:
        again.register(shm)
        assert again.lookup(NS, [b.key for b in blocks_in(region, 2, 4096)]).hit_prefix == 2
        done.set()
    assert daemon.healthy()


def test_a_load_of_many_chunks_lands_whole_and_one_bad_block_refuses_it_all(
    client: UcmClient, shm: SharedBuffer
) -> None:
    """A batch of the usual shape has its views made a chunk at a time as the task moves it: the
    blocks of every chunk land, and a block past the region in the last chunk still refuses the
    whole batch up front, nothing copied into the client's memory."""
    region = client.register(shm)
    n, size = 600, 4096  # three chunks
    shm.buf[: n * size] = os.urandom(n * size)
    assert client.wait(client.dump(NS, blocks_in(region, n, size)), 10).ok
    back = blocks_in(region, n, size, offset=8 << 20)
    shm.buf[8 << 20 : (8 << 20) + n * size] = bytes(n * size)
    bad = [*back[:-1], BlockIO(back[-1].key, (Segment(region, (16 << 20) - 100, size),))]
    with pytest.raises(UcmError, match=r"block 599: segment .* is outside region"):
        client.load(NS, bad)
    assert bytes(shm.buf[8 << 20 : (8 << 20) + n * size]) == bytes(n * size), "a refused load copied"
    task = client.load(NS, back)
    assert _via_ring(client, task) and client.wait(task, 10).ok
    assert bytes(shm.buf[8 << 20 : (8 << 20) + n * size]) == bytes(shm.buf[: n * size])
