"""A task's copy lane (:mod:`ucm_server.store.copy_lane`): its copies run one at a time in the order
queued, each waiter gets its own result or exception, and no waiter is left waiting for good."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ucm_server.store.copy_lane import CopyLane, current_lane, lane_for_task, run_copy


class _Recorder:
    """Copies that note when they start and end, and how many ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0
        self.order: list[int] = []

    def copy(self, n: int, seconds: float = 0.002) -> int:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(seconds)
        with self.lock:
            self.active -= 1
            self.order.append(n)
        return n * 10


def test_a_lanes_copies_run_one_at_a_time_in_the_order_queued() -> None:
    rec = _Recorder()

    async def main() -> list[int]:
        lane = CopyLane()
        with ThreadPoolExecutor(4) as pool:
            return await asyncio.gather(*(lane.run(pool, rec.copy, n) for n in range(12)))

    assert asyncio.run(main()) == [n * 10 for n in range(12)]
    assert rec.order == list(range(12))
    assert rec.most == 1


def test_a_failed_copy_reaches_its_waiter_and_the_later_ones_still_run() -> None:
    rec = _Recorder()

    def bad() -> None:
        raise ValueError("span 3: 65536 bytes at offset 9 are outside the 16-byte source")

    async def main() -> tuple[int, BaseException | None, int]:
        lane = CopyLane()
        with ThreadPoolExecutor(2) as pool:
            first = asyncio.ensure_future(lane.run(pool, rec.copy, 1))
            failed = asyncio.ensure_future(lane.run(pool, bad))
            last = asyncio.ensure_future(lane.run(pool, rec.copy, 2))
            await asyncio.wait([first, failed, last])
            return first.result(), failed.exception(), last.result()

    first, error, last = asyncio.run(main())
    assert (first, last) == (10, 20)
    assert isinstance(error, ValueError) and "outside the 16-byte source" in str(error)


def test_a_cancelled_waiter_does_not_stop_its_copy_or_the_next() -> None:
    rec = _Recorder()

    async def main() -> int:
        lane = CopyLane()
        with ThreadPoolExecutor(2) as pool:
            gone = asyncio.ensure_future(lane.run(pool, rec.copy, 1, 0.05))
            await asyncio.sleep(0.01)
            gone.cancel()
            return await lane.run(pool, rec.copy, 2)

    assert asyncio.run(main()) == 20
    assert rec.order == [1, 2]  # the cancelled waiter's copy ran all the same, before the next


def test_copies_queued_when_the_executor_drops_the_lanes_job_fail_instead_of_waiting_for_good() -> None:
    release = threading.Event()

    async def main() -> BaseException | None:
        lane = CopyLane()
        pool = ThreadPoolExecutor(1)
        busy = pool.submit(release.wait, 5)  # the only worker is taken: the lane's job stays queued
        waiter = asyncio.ensure_future(lane.run(pool, time.sleep, 0))
        await asyncio.sleep(0.01)
        pool.shutdown(wait=False, cancel_futures=True)
        release.set()
        busy.result(5)
        try:
            await asyncio.wait_for(waiter, 5)
        except RuntimeError as exc:
            return exc
        return None

    error = asyncio.run(main())
    assert error is not None and "shut down" in str(error)


def test_a_lane_refused_by_a_shut_executor_raises_and_stays_usable() -> None:
    async def main() -> int:
        lane = CopyLane()
        closed = ThreadPoolExecutor(1)
        closed.shutdown()
        with pytest.raises(RuntimeError):
            await lane.run(closed, time.sleep, 0)
        with ThreadPoolExecutor(1) as pool:
            return await lane.run(pool, int, "7")

    assert asyncio.run(main()) == 7


def test_run_copy_uses_the_tasks_lane_only_inside_it() -> None:
    seen: list[CopyLane | None] = []

    async def chunk(pool: ThreadPoolExecutor) -> int:
        seen.append(current_lane.get())
        return await run_copy(pool, int, "3")

    async def main() -> list[int]:
        with ThreadPoolExecutor(2) as pool:
            outside = await chunk(pool)
            with lane_for_task() as lane:
                inside = await asyncio.ensure_future(chunk(pool))  # a chunk's task inherits the lane
            assert seen == [None, lane]
            after = await chunk(pool)
        return [outside, inside, after]

    assert asyncio.run(main()) == [3, 3, 3]
    assert seen[2] is None
