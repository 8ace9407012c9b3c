"""A task's chunks moved two at a time (:func:`ucm_server.movers.overlapped`), and what must not change.

Overlap lets the event loop look up, lease and allocate one chunk while the previous one is copied in
a worker thread. What a client sees must stay as with one chunk after another: a stop honoured
between chunks, no chunk still touching client memory once the task has ended (also after a
failure), the later copy of a key named twice in one Dump is the one stored, and every byte lands.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from support.blocks import NS

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_server.chunks import CHUNK_BLOCKS
from ucm_server.movers import overlapped
from ucm_server.tasks import Task, TaskKind

BOUNDS = [(i * 10, i * 10 + 10) for i in range(6)]


def _task() -> Task:
    return Task(task_id=1, kind=TaskKind.LOAD, session_id="s", nblocks=60)


def test_every_chunk_moves_with_at_most_width_in_flight() -> None:
    async def go() -> tuple[list[tuple[int, int]], int]:
        moved: list[tuple[int, int]] = []
        live = most = 0

        async def move(start: int, stop: int) -> None:
            nonlocal live, most
            live += 1
            most = max(most, live)
            await asyncio.sleep(0.001 * (6 - start // 10))  # later chunks end first
            moved.append((start, stop))
            live -= 1

        await overlapped(_task(), move, BOUNDS, 2)
        return moved, most

    moved, most = asyncio.run(go())
    assert sorted(moved) == BOUNDS
    assert most == 2


def test_a_stop_starts_no_further_chunk_and_waits_for_those_started() -> None:
    async def go() -> tuple[list[int], list[int]]:
        task = _task()
        started: list[int] = []
        ended: list[int] = []

        async def move(start: int, stop: int) -> None:
            started.append(start)
            if start == 10:
                task.cancel_requested = True
            await asyncio.sleep(0.01)
            ended.append(start)

        await overlapped(task, move, BOUNDS, 2)
        return started, ended

    started, ended = asyncio.run(go())
    assert started == [0, 10]
    assert sorted(ended) == started  # returned only once both had ended


def test_a_failure_is_raised_only_after_the_other_chunk_in_flight_ended() -> None:
    async def go() -> list[int]:
        ended: list[int] = []

        async def move(start: int, stop: int) -> None:
            if start == 10:
                raise OSError("chunk 1 broke")
            await asyncio.sleep(0.02)
            ended.append(start)

        with pytest.raises(OSError, match="chunk 1 broke"):
            await overlapped(_task(), move, BOUNDS, 2)
        return ended

    assert asyncio.run(go()) == [0]  # chunk 0 finished copying first; nothing after chunk 1 started


def test_a_cancelled_runner_still_waits_for_its_chunks() -> None:
    async def go() -> list[int]:
        ended: list[int] = []

        async def move(start: int, stop: int) -> None:
            await asyncio.sleep(0.05)
            ended.append(start)

        runner = asyncio.ensure_future(overlapped(_task(), move, BOUNDS, 2))
        await asyncio.sleep(0.01)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        return ended

    assert sorted(asyncio.run(go())) == [0, 10]


@pytest.mark.slow
def test_many_chunks_round_trip_through_the_daemon(client: UcmClient) -> None:
    n, size = 3 * CHUNK_BLOCKS + 5, 4096
    with SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(n * size)
        keys = [key_digest("chunks", i) for i in range(n)]
        dump = [BlockIO(k, (Segment(rs, i * size, size),)) for i, k in enumerate(keys)]
        assert client.wait(client.dump(NS, dump), 60).ok
        load = [BlockIO(k, (Segment(rd, i * size, size),)) for i, k in enumerate(keys)]
        result = client.wait(client.load(NS, load), 60)
        assert result.ok and result.bytes_done == n * size
        assert bytes(dst.buf) == bytes(src.buf)


def test_a_key_named_twice_in_one_dump_keeps_its_later_copy_across_chunks(client: UcmClient) -> None:
    n, size = 2 * CHUNK_BLOCKS + 1, 4096
    with SharedBuffer(n * size) as src, SharedBuffer(size) as dst:
        rs, rd = client.register(src), client.register(dst)
        for i in range(n):
            src.buf[i * size : (i + 1) * size] = bytes([i % 251]) * size
        twice = key_digest("twice")
        keys = [key_digest("other", i) for i in range(n)]
        keys[CHUNK_BLOCKS] = keys[n - 1] = twice  # the second chunk, and the short last one
        dump = [BlockIO(k, (Segment(rs, i * size, size),)) for i, k in enumerate(keys)]
        assert client.wait(client.dump(NS, dump), 60).ok
        assert client.wait(client.load(NS, [BlockIO(twice, (Segment(rd, 0, size),))]), 30).ok
        assert bytes(dst.buf) == bytes([(n - 1) % 251]) * size
