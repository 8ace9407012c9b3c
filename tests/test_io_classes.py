"""I/O classes: a load is never queued behind background work, and background work still progresses.

The pool and the slots are exercised directly (threads held on events, no timing), then a real daemon
whose only tier holds one of its I/O threads per block (``LatencyInjectingTier`` with ``blocking``: a
test double for a disk whose calls block, which cannot be made on demand) shows the same end to end:
a Load submitted behind a deep queue of dumps overtakes it, and a dump completes under a steady
stream of Loads.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.store.io_classes import (
    ClassedExecutor,
    ClassedSlots,
    IoClass,
    current_class,
    io_class,
    may_yield,
    yield_to_loads,
)
from ucm_server.testing.daemon import DaemonProcess

WAIT_S = 30


def _held(
    executor: ClassedExecutor, cls: IoClass, gate: threading.Event, n: int, *, running: int | None = None
) -> list[Future[IoClass]]:
    """``n`` jobs of ``cls`` that run until ``gate`` opens; each returns the class it ran under.
    Returns once ``running`` of them (default all) have started: a thread started for a job takes
    it a moment later, and on a busy machine that moment outlasted the caller's next submissions."""
    started = threading.Semaphore(0)

    def job() -> IoClass:
        started.release()
        assert gate.wait(WAIT_S)
        return current_class.get()

    jobs = [executor.submit_as(cls, job) for _ in range(n)]
    for _ in range(n if running is None else running):
        assert started.acquire(timeout=WAIT_S), "a held job never started"
    return jobs


class TestClassedExecutor:
    def test_a_load_overtakes_queued_background_work(self) -> None:
        pool = ClassedExecutor(4)
        gate = threading.Event()
        try:
            background = _held(pool, IoClass.BACKGROUND, gate, 40, running=3)
            load = pool.submit_as(IoClass.LOAD, lambda: sum(f.done() for f in background))
            # Background may hold at most max_workers - reserve threads: a thread is free for the load.
            assert load.result(WAIT_S) == 0, "the load waited for background work queued before it"
            figures = pool.figures()  # a quarter of the threads left to loads: 3 run, 37 wait
            assert figures[IoClass.BACKGROUND].running == 3 and figures[IoClass.BACKGROUND].queued == 37
        finally:
            gate.set()
            pool.shutdown()
        assert all(f.result(WAIT_S) is IoClass.BACKGROUND for f in background)

    @pytest.mark.slow
    def test_a_queued_load_takes_the_first_thread_freed_before_older_background_jobs(self) -> None:
        pool = ClassedExecutor(2, reserve=0)
        loads_gate, lower_gate, order = threading.Event(), threading.Event(), []
        lock = threading.Lock()

        def note(name: str) -> None:
            with lock:
                order.append(name)

        try:
            held = _held(pool, IoClass.LOAD, loads_gate, 2)  # the two load threads
            held += _held(pool, IoClass.PREFETCH, lower_gate, 1)  # the prefetch floor
            held += _held(pool, IoClass.BACKGROUND, lower_gate, 1)  # the background floor
            for i in range(5):
                pool.submit_as(IoClass.BACKGROUND, note, f"background-{i}")
            pool.submit_as(IoClass.LOAD, note, "load")  # every thread busy: it queues, last
            assert pool.figures()[IoClass.LOAD].queued == 1
            loads_gate.set()
            held[0].result(WAIT_S)
            held[1].result(WAIT_S)
            lower_gate.set()
            for f in held:
                f.result(WAIT_S)
        finally:
            pool.shutdown()
        assert order == ["load", *(f"background-{i}" for i in range(5))]

    def test_background_runs_under_a_steady_stream_of_loads(self) -> None:
        pool = ClassedExecutor(2)
        stop = threading.Event()
        loads = 0

        def load() -> None:
            nonlocal loads
            loads += 1
            time.sleep(0.001)
            if not stop.is_set():
                pool.submit_as(IoClass.LOAD, load)
                pool.submit_as(IoClass.LOAD, load)  # the queue of loads only grows

        try:
            pool.submit_as(IoClass.LOAD, load)
            while pool.figures()[IoClass.LOAD].queued < 50:
                time.sleep(0.001)
            background = pool.submit_as(IoClass.BACKGROUND, lambda: pool.figures()[IoClass.LOAD].queued)
            queued_loads = background.result(WAIT_S)
        finally:
            stop.set()
            pool.shutdown(cancel_futures=True)
        assert queued_loads > 0, "the background job ran only once no load was waiting"
        assert loads > 0

    def test_the_class_is_read_from_the_submitting_context(self) -> None:
        pool = ClassedExecutor(2)

        async def main() -> list[IoClass]:
            loop = asyncio.get_running_loop()
            seen = [await loop.run_in_executor(pool, current_class.get)]
            with io_class(IoClass.BACKGROUND):
                seen.append(await loop.run_in_executor(pool, current_class.get))
                task = asyncio.create_task(asyncio.sleep(0))  # a task created here inherits it
                await task
            with io_class(IoClass.PREFETCH):
                seen.append(await asyncio.create_task(_in_pool(pool)))
            return seen

        try:
            assert asyncio.run(main()) == [IoClass.LOAD, IoClass.BACKGROUND, IoClass.PREFETCH]
            assert pool.figures()[IoClass.BACKGROUND].completed == 1
        finally:
            pool.shutdown()

    def test_jobs_submitted_together_run_together(self) -> None:
        """Two jobs submitted back to back while one thread idles: the second gets a thread of its
        own (the idle one is told once), so two jobs that wait for each other both finish."""
        pool = ClassedExecutor(4)
        try:
            pool.submit(lambda: None).result(WAIT_S)  # one thread, idle now
            time.sleep(0.05)
            both = threading.Barrier(2, timeout=WAIT_S)
            first, second = pool.submit(both.wait), pool.submit(both.wait)
            assert {first.result(WAIT_S), second.result(WAIT_S)} == {0, 1}
        finally:
            pool.shutdown()

    def test_errors_and_shutdown_behave_as_a_thread_pool(self) -> None:
        pool = ClassedExecutor(2)
        failing = pool.submit(lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(WAIT_S)
        pool.shutdown()
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(print)
        with pytest.raises(ValueError, match="max_workers"):
            ClassedExecutor(0)
        with pytest.raises(ValueError, match="reserve"):
            ClassedExecutor(2, reserve=2)

    def test_background_work_is_held_between_its_units_while_a_load_runs(self) -> None:
        """A background job that was running when a load came is held at its next unit until the
        load ends (the hold bound is far away), then goes on; a load's own units are never held."""
        pool = ClassedExecutor(2, background_hold_s=WAIT_S)
        load_gate, first_unit_done = threading.Event(), threading.Event()
        try:
            background_started = threading.Event()

            def background() -> str:
                background_started.set()
                assert first_unit_done.wait(WAIT_S)
                yield_to_loads()  # between two units: a load runs now
                return "done"

            job = pool.submit_as(IoClass.BACKGROUND, background)
            assert background_started.wait(WAIT_S)
            load = _held(pool, IoClass.LOAD, load_gate, 1)[0]
            unheld = pool.submit_as(IoClass.LOAD, lambda: yield_to_loads() or "load not held")
            assert unheld.result(WAIT_S) == "load not held"
            first_unit_done.set()
            _until(lambda: pool.held_background == 1)
            assert not job.done(), "the background job went on while a load ran"
            load_gate.set()
            assert load.result(WAIT_S) is IoClass.LOAD
            assert job.result(WAIT_S) == "done"
            assert pool.held_background == 0
        finally:
            load_gate.set()
            first_unit_done.set()
            pool.shutdown()

    def test_held_background_work_goes_on_one_unit_per_bound_while_loads_never_end(self) -> None:
        """No starvation: a load that never ends holds background work ``background_hold_s`` a
        unit at most; with a bound of 0 it is never held mid-job."""
        for bound, units in ((0.02, 5), (0.0, 50)):
            pool = ClassedExecutor(2, background_hold_s=bound)
            load_gate = threading.Event()
            try:
                load = _held(pool, IoClass.LOAD, load_gate, 1)[0]

                def background(n: int = units) -> int:
                    for _ in range(n):
                        yield_to_loads()
                    return n

                assert pool.submit_as(IoClass.BACKGROUND, background).result(WAIT_S) == units
                assert not load.done(), "the load ended first: nothing was proven"
            finally:
                load_gate.set()
                pool.shutdown()

    def test_yield_to_loads_outside_a_classed_pool_returns_at_once(self) -> None:
        with io_class(IoClass.BACKGROUND):
            yield_to_loads()  # the event loop's thread, a plain pool's: nothing to hold for
        assert not may_yield()


def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


async def _in_pool(pool: ClassedExecutor) -> IoClass:
    return await asyncio.get_running_loop().run_in_executor(pool, current_class.get)


class TestClassedSlots:
    def test_a_freed_slot_goes_to_the_load_before_older_background_waiters(self) -> None:
        async def main() -> list[str]:
            slots, order = ClassedSlots(1), []
            release = asyncio.Event()

            async def hold(cls: IoClass, name: str) -> None:
                async with slots.hold(cls):
                    order.append(name)
                    await release.wait()

            first = asyncio.create_task(hold(IoClass.BACKGROUND, "background-0"))
            await asyncio.sleep(0)
            rest = [asyncio.create_task(hold(IoClass.BACKGROUND, f"background-{i}")) for i in (1, 2)]
            rest.append(asyncio.create_task(hold(IoClass.LOAD, "load")))
            await asyncio.sleep(0)
            release.set()
            await asyncio.gather(first, *rest)
            return order

        assert asyncio.run(main()) == ["background-0", "load", "background-1", "background-2"]

    def test_background_gets_a_slot_while_loads_keep_waiting(self) -> None:
        async def main() -> bool:
            slots = ClassedSlots(2)
            stop = asyncio.Event()

            async def loader() -> None:
                while not stop.is_set():
                    async with slots.hold(IoClass.LOAD):
                        await asyncio.sleep(0.001)

            loaders = [asyncio.create_task(loader()) for _ in range(6)]
            await asyncio.sleep(0.01)
            async with slots.hold(IoClass.BACKGROUND):
                still_loading = not stop.is_set()
            stop.set()
            await asyncio.gather(*loaders)
            return still_loading

        assert asyncio.run(asyncio.wait_for(main(), WAIT_S))

    def test_a_cancelled_waiter_gives_its_place_back(self) -> None:
        async def main() -> int:
            slots = ClassedSlots(1)
            async with slots.hold(IoClass.LOAD):
                waiter = asyncio.create_task(slots.hold(IoClass.LOAD).__aenter__())
                await asyncio.sleep(0)
                waiter.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter
            async with slots.hold(IoClass.LOAD):
                return slots.held

        assert asyncio.run(main()) == 1


# -- end to end: a real daemon ----------------------------------------------------------------------

SLOW = "ucm_server.testing.faults:LatencyInjectingTier"
NS = namespace_id(test="io-classes")
SIZE = 64 << 10
LOAD_BLOCKS = 16


@pytest.fixture
def slow_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """One tier (no Cache, so every Load and Dump goes to it): each block read holds an I/O thread
    20 ms, each write 50 ms; four I/O threads."""
    settings = {"root": str(tmp_path / "blocks"), "durable": False, "blocking": True}
    settings |= {"read_delay_s": 0.02, "write_delay_s": 0.05}
    env = {"UCM_TIER_SETTINGS": json.dumps({SLOW: settings})}
    args = ["--store-pipeline", SLOW, "--io-threads", "4", "--max-tasks-per-session", "64"]
    with DaemonProcess(tmp_path / "ucm", args=args, env=env) as d:
        yield d


def _blocks(region: int, keys: list[bytes], first: int = 0) -> list[BlockIO]:
    return [BlockIO(k, (Segment(region, (first + i) * SIZE, SIZE),)) for i, k in enumerate(keys)]


def _store_load_set(client: UcmClient, region: int) -> list[bytes]:
    keys = [key_digest("io-classes-load", i) for i in range(LOAD_BLOCKS)]
    r = client.wait(client.dump(NS, _blocks(region, keys)), WAIT_S)
    assert all(s is BlockState.OK for s in r.states)
    return keys


@pytest.mark.slow
def test_a_load_behind_a_deep_queue_of_dumps_completes_before_it(slow_daemon: DaemonProcess) -> None:
    dumps, per_dump = 8, 32  # 256 writes of 50 ms on 4 threads: 3.2 s of background work
    with UcmClient(slow_daemon.target) as client, SharedBuffer((LOAD_BLOCKS + per_dump) * SIZE) as buf:
        region = client.register(buf)
        load_keys = _store_load_set(client, region)
        tasks = []
        for d in range(dumps):
            keys = [key_digest("io-classes-dump", d, i) for i in range(per_dump)]
            tasks.append(client.dump(NS, _blocks(region, keys, LOAD_BLOCKS)))
        time.sleep(0.2)  # every dump task has queued its first writes in the pool
        loaded = client.wait(client.load(NS, _blocks(region, load_keys)), WAIT_S)
        done_before = sum(sum(s is BlockState.OK for s in client.check(t).states) for t in tasks)
        ends = [client.wait(t, WAIT_S) for t in tasks]
    assert all(s is BlockState.OK for s in loaded.states)
    assert all(all(s is BlockState.OK for s in r.states) for r in ends), "background work completes"
    # In arrival order the load would have waited for the 4 x 16 writes queued ahead of it (and
    # more): it overtook them, only the writes already running ended meanwhile.
    assert done_before < 32, f"{done_before} dumped blocks ended before the load did"


@pytest.fixture
def posix_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A real Posix tier alone, durable (group commit): a dump's writes are held between blocks
    while loads read (``io_background_hold_s``), for one block per 25 ms at most."""
    args = ["--store-pipeline", "Posix", "--io-threads", "4", "--max-tasks-per-session", "64"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d


def test_a_dump_completes_under_a_steady_stream_of_loads(slow_daemon: DaemonProcess) -> None:
    _dump_under_loads(slow_daemon)


@pytest.mark.slow
def test_a_dump_held_for_loads_between_its_blocks_still_completes(posix_daemon: DaemonProcess) -> None:
    _dump_under_loads(posix_daemon)


def _dump_under_loads(daemon: DaemonProcess) -> None:
    """Six clients load without pause; a dump submitted meanwhile completes while they go on."""
    with UcmClient(daemon.target) as setup, SharedBuffer(LOAD_BLOCKS * SIZE) as buf:
        load_keys = _store_load_set(setup, setup.register(buf))
    stop = threading.Event()
    loads_after_dump: list[int] = []
    failures: list[str] = []

    def loader(n: int) -> None:
        with (
            UcmClient(daemon.target, client_name=f"loader-{n}") as c,
            SharedBuffer(LOAD_BLOCKS * SIZE) as mine,
        ):
            blocks = _blocks(c.register(mine), load_keys)
            while not stop.is_set():
                r = c.wait(c.load(NS, blocks), WAIT_S)
                if not all(s is BlockState.OK for s in r.states):
                    failures.append(str(r.reasons))
                if dump_done.is_set():
                    loads_after_dump.append(n)

    dump_done = threading.Event()
    threads = [threading.Thread(target=loader, args=(n,)) for n in range(6)]  # 96 reads in flight
    for t in threads:
        t.start()
    try:
        with UcmClient(daemon.target) as client, SharedBuffer(16 * SIZE) as buf:
            region = client.register(buf)
            time.sleep(0.5)  # the loads keep every I/O thread busy
            keys = [key_digest("io-classes-starved", i) for i in range(16)]
            r = client.wait(client.dump(NS, _blocks(region, keys)), WAIT_S)
            dump_done.set()
        deadline = time.monotonic() + WAIT_S
        while not loads_after_dump and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT_S)
    assert r.done and all(s is BlockState.OK for s in r.states), "the dump starved behind the loads"
    assert loads_after_dump, "the loads stopped before the dump ended: nothing was proven"
    assert not failures
