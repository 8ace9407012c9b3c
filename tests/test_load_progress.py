"""A Load's progress word (``LoadRequest.progress``) against a real daemon process.

The daemon copies a Load's blocks segment by segment and counts, in 8 bytes of the client's own
memory, the leading segments of every block that are in place; ``LOAD_PROGRESS_DONE`` once the task
ended. The checks: every count seen holds (those segments' bytes are there when it is read), the
word ends DONE, a block read from disk is never counted early, and a bad word is refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.blocks import NS

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import InvalidArgument
from ucm_client.load_progress import LOAD_PROGRESS_DONE, ProgressWords
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_server.store import copying
from ucm_server.store.copying import copy_in_order
from ucm_server.testing.daemon import DaemonProcess

LAYERS, BLOCKS, PAGE = 8, 24, 256 << 10
"""vLLM's CPU layout: layer ``l``'s page of block ``b`` at ``(l * BLOCKS + b) * PAGE``."""


def _layer_major(region: int, blocks: int = BLOCKS) -> list[BlockIO]:
    return [
        BlockIO(
            key_digest("progress", b),
            tuple(Segment(region, (layer * BLOCKS + b) * PAGE, PAGE) for layer in range(LAYERS)),
        )
        for b in range(blocks)
    ]


def _segments_in_place(dst: SharedBuffer, src: SharedBuffer, k: int) -> bool:
    """The last bytes of segment ``k - 1`` of every block arrived (segments are copied in order,
    so the last bytes of a segment arrive last)."""
    layer = k - 1
    return all(
        dst.buf[end - 64 : end] == src.buf[end - 64 : end]
        for end in ((layer * BLOCKS + b + 1) * PAGE for b in range(BLOCKS))
    )


def _load_watching(
    client: UcmClient, blocks: list[BlockIO], dst: SharedBuffer, src: SharedBuffer
) -> list[int]:
    """Load with a progress word and read it in a tight loop until DONE; every count seen is
    checked against the bytes at once. Returns the distinct values seen, in order."""
    words = ProgressWords(4)
    words.region = client.register(words.buffer)
    index = words.take()
    assert index is not None
    future = client.load_nowait(NS, blocks, progress=words.segment(index))
    seen = [words.read(index)]
    late: list[int] = []
    while seen[-1] != LOAD_PROGRESS_DONE:
        value = words.read(index)
        if value != seen[-1]:
            seen.append(value)
            if value != LOAD_PROGRESS_DONE and not _segments_in_place(dst, src, value):
                late.append(value)
    result = client.wait(future.result(10), 30)
    assert result.ok, result.reasons
    assert not late, f"counts {late} were seen before their segments' bytes"
    return seen


def _raw_load(client: UcmClient, request: pb.LoadRequest) -> pb.TaskHandle:
    async def call() -> pb.TaskHandle:
        return await client.aio.kv.Load(request, metadata=client.aio._metadata())

    return client._run(call())


@pytest.fixture
def daemon(tmp_path: Path) -> DaemonProcess:
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "128MiB"]) as d:
        yield d


@pytest.mark.slow
def test_counts_hold_for_every_block_and_the_word_ends_done(daemon: DaemonProcess) -> None:
    size = LAYERS * BLOCKS * PAGE
    with UcmClient(daemon.target) as client, SharedBuffer(size) as src, SharedBuffer(size) as dst:
        src.buf[:] = os.urandom(size)
        assert client.wait(client.dump(NS, _layer_major(client.register(src))), 30).ok
        seen = _load_watching(client, _layer_major(client.register(dst)), dst, src)
        assert bytes(dst.buf) == bytes(src.buf)
    counts = [v for v in seen if v not in (0, LOAD_PROGRESS_DONE)]
    assert counts == sorted(counts) and all(1 <= k <= LAYERS for k in counts), seen
    assert seen[-1] == LOAD_PROGRESS_DONE


@pytest.mark.slow
def test_the_daemon_says_it_took_the_word_and_an_old_request_gets_none(daemon: DaemonProcess) -> None:
    """``TaskHandle.progress`` is how a client tells this daemon from an older one (which ignores
    the field: the client then writes DONE itself)."""
    with UcmClient(daemon.target) as client, SharedBuffer(1 << 20) as buf:
        region = client.register(buf)
        server_region = client.aio._server_ids()[region]
        blocks = pb.BlockBatch(
            namespace=NS, keys=[key_digest("x")], region_ids=[server_region], offsets=[0], lengths=[4096]
        )
        word = pb.Segment(region_id=server_region, offset=8192, length=8)
        assert _raw_load(client, pb.LoadRequest(blocks=blocks, progress=word)).progress
        assert not _raw_load(client, pb.LoadRequest(blocks=blocks)).progress


@pytest.mark.slow
def test_blocks_read_from_disk_are_never_counted_early(tmp_path: Path) -> None:
    """Negative control: after a restart the Cache is empty and every block comes from Posix,
    read and checksummed whole; the word must go from 0 straight to DONE."""
    size = LAYERS * BLOCKS * PAGE
    d = DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "128MiB"])
    with SharedBuffer(size) as src, SharedBuffer(size) as dst:
        src.buf[:] = os.urandom(size)
        with d, UcmClient(d.target) as client:
            assert client.wait(client.dump(NS, _layer_major(client.register(src)), wait_durable=True), 60).ok
        with d.start(), UcmClient(d.target) as client:
            seen = _load_watching(client, _layer_major(client.register(dst)), dst, src)
            assert bytes(dst.buf) == bytes(src.buf)
    assert set(seen) <= {0, LOAD_PROGRESS_DONE} and seen[-1] == LOAD_PROGRESS_DONE, seen


@pytest.mark.parametrize(
    ("offset", "length", "error"),
    [
        (1 << 20, 4, r"length is 4; the progress word is 8 bytes"),
        ((1 << 20) + 4, 8, r"offset 1048580 is not a multiple of 8"),
        (8, 8, r"overlaps the Load's segment 0"),
        ((2 << 20) - 4, 8, r"is not a multiple of 8"),
        (2 << 20, 8, r"past region"),
    ],
)
def test_a_bad_word_is_refused_naming_what_is_wrong(
    daemon: DaemonProcess, offset: int, length: int, error: str
) -> None:
    with UcmClient(daemon.target) as client, SharedBuffer(2 << 20) as buf:
        region = client.register(buf)
        blocks = [BlockIO(key_digest("x"), (Segment(region, 0, 4096),))]
        with pytest.raises(InvalidArgument, match=error):
            client.load(NS, blocks, progress=Segment(region, offset, length))
        # the client wrote DONE into a refused word it names well (a waiter on it stops waiting)
        # and left every malformed one alone
        done = int.from_bytes(buf.buf[offset : offset + 8], "little") == LOAD_PROGRESS_DONE
        assert done == (length == 8 and offset % 8 == 0 and offset + 8 <= buf.size)


@pytest.mark.parametrize("helper", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("scale", [1, 1024], ids=["small", "streamed"])
def test_copy_in_order_copies_segment_k_of_every_block_before_reporting_k(
    helper: bool, scale: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's ordered copy: at ``report(k)`` segments ``< k`` of every block are in place and
    no segment ``>= k`` has been touched (blocks of unequal segment counts, split sources). With the
    compiled helper and without it; and at 1024 times the size, past ``STREAM_COPY_BYTES``, where
    the helper copies with non-temporal stores."""
    if helper and copying.native is None:
        pytest.skip("the compiled helper is not built here (setup.py build_ext)")
    if not helper:
        monkeypatch.setattr(copying, "native", None)
    shapes = [[n * scale for n in block] for block in [[3000, 0, 7000], [100, 200], [4096] * 5]]
    assert (sum(map(sum, shapes)) >= copying.STREAM_COPY_BYTES) == (scale > 1)
    src_blocks = [[bytearray(os.urandom(n)) for n in block] for block in shapes]
    dst_blocks = [[bytearray(n) for n in block] for block in shapes]
    pairs = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        whole = memoryview(bytearray(b"".join(src)))  # the source as two pieces, split elsewhere
        cut = len(whole) // 3
        pairs.append(([memoryview(d) for d in dst], [whole[:cut], whole[cut:]]))
    reported: list[int] = []

    def report(k: int) -> None:
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            for j, (s, d) in enumerate(zip(src, dst, strict=True)):
                assert (d == s) if j < k else (d == bytearray(len(d))), (k, j)
        reported.append(k)

    copy_in_order(pairs, report)
    assert reported == [1, 2, 3, 4, 5]
    assert dst_blocks == src_blocks


@pytest.mark.slow
def test_a_load_cancelled_while_queued_still_reads_done(tmp_path: Path) -> None:
    """A Load whose body never ran (cancelled while 64 other Loads held every slot a Load may take)
    still ends its progress word at DONE, so a reader waiting on the word goes on to the task's result
    instead of spinning until its deadline, and the Cancel returns without waiting for a slot to free.
    The word of a queued, not yet cancelled Load reads 0 (control).

    The busy tasks are Loads: dumps cannot keep a Load waiting (a Load never queues behind them, see
    ``ucm_server.store.io_classes``), so with dumps the Load ran at once while the dumps beyond their
    share were the tasks counted queued."""
    from support.slow_tier import slow_daemon

    from ucm_client import BlockState

    size, busy_loads = 4096, 64
    # 8 s per block read: the 65 Load calls (sent without waiting for each answer) and the Stats and
    # Cancel calls are all made before the first busy Load ends, however slow a loaded machine makes
    # them (2 s was too short with five busy processes on two cores); writes are not slowed
    daemon = slow_daemon(tmp_path, 8.0, write_delay_s=0.0)
    with daemon as d, UcmClient(d.target, client_name="progress-queued") as c:
        with SharedBuffer((busy_loads + 1) * size) as buf:
            region = c.register(buf)
            stored = [BlockIO(key_digest("queued", 0), (Segment(region, 0, size),))]
            assert c.wait(c.dump(NS, stored), 60).ok
            words = ProgressWords(4)
            words.region = c.register(words.buffer)
            index = words.take()
            assert index is not None
            sent = [  # sent without waiting for each answer; they reach the daemon in this order
                c.load_nowait(NS, [BlockIO(stored[0].key, (Segment(region, (t + 1) * size, size),))])
                for t in range(busy_loads)
            ]
            sent.append(c.load_nowait(NS, stored, progress=words.segment(index)))
            *busy, queued = [future.result(30) for future in sent]
            stats = c.stats()
            assert stats.tasks_queued == 1, f"the Load was not queued ({stats.tasks_queued} queued)"
            assert words.read(index) == 0  # control: nothing ran, nothing written yet
            result = c.cancel(queued)
            assert result.states == [BlockState.CANCELLED] and result.bytes_done == 0, result
            # it left the queue at once: the Cancel did not wait for a busy Load to free a slot
            assert c.stats().tasks_running == busy_loads
            assert words.read(index) == LOAD_PROGRESS_DONE
            assert all(c.wait(t, 60).ok for t in busy)  # the Loads that held the slots were not disturbed
        assert d.healthy()
