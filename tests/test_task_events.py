"""Finished tasks pushed on the session stream: a wait for a task that already ended needs no call.

Proved with a real fault: once the result has arrived, the daemon is frozen (SIGSTOP); a ``Wait``
call could not be answered, yet ``wait`` and ``check`` return at once with the task's real result.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockState, SharedBuffer, UcmClient
from ucm_server import task_events
from ucm_server.task_events import TaskEvents
from ucm_server.tasks import TaskKind, TaskManager
from ucm_server.testing.daemon import DaemonProcess


@contextmanager
def frozen(daemon: DaemonProcess) -> Iterator[None]:
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


@pytest.mark.slow
def test_wait_and_check_of_a_finished_task_need_no_call(
    daemon: DaemonProcess, client: UcmClient, shm: SharedBuffer
) -> None:
    region = client.register(shm)
    shm.buf[: 4 * 4096] = os.urandom(4 * 4096)
    stored = client.dump(NS, blocks_in(region, 4, 4096))
    assert client.wait(stored, 10).ok
    missing_one = client.load(NS, blocks_in(region, 5, 4096, offset=8 * 4096))  # block 4 was never stored
    time.sleep(0.5)  # the result travels on the session stream
    with frozen(daemon):
        started = time.monotonic()
        checked = client.check(missing_one)
        waited = client.wait(missing_one, 5)
        assert time.monotonic() - started < 1.0  # a call to a frozen daemon would have hung
    assert checked == waited
    assert waited.done and waited.states == [BlockState.OK] * 4 + [BlockState.MISSING]
    assert bytes(shm.buf[8 * 4096 : 12 * 4096]) == bytes(shm.buf[: 4 * 4096])
    again = client.wait(missing_one, 5)  # repeatable: answered by the daemon this time
    assert again.states == waited.states


@pytest.mark.slow
def test_a_waiter_is_woken_by_the_pushed_result(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    task = client.dump(NS, blocks_in(region, 64, 64 << 10))
    result = client.wait(task, 10)  # registered before the task ended, woken by its event
    assert result.ok and len(result.states) == 64


@pytest.mark.slow
def test_results_are_dropped_with_the_session(tmp_path: Path) -> None:
    """Task ids restart with a restarted daemon: a result kept from before must never answer after."""
    d = DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "64MiB"])
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        first = c.dump(NS, blocks_in(region, 1, 4096))
        time.sleep(0.5)  # its result is kept, never waited for
        d.stop()
        d.start()
        c.register(buf)  # reconnects; the region is registered again
        second = c.dump(NS, blocks_in(region, 3, 4096))
        assert second == first  # the same id, another task
        assert len(c.wait(second, 10).states) == 3


def test_a_session_that_does_not_read_its_events_stops_getting_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's side, in process: the backlog is bounded, and the stream says once that it stopped."""
    monkeypatch.setattr(task_events, "BACKLOG", 3)

    async def main() -> None:
        events, tasks = TaskEvents(), TaskManager(retention_s=60)
        tasks.on_finish.append(events.publish)
        events.open("s")

        async def nothing(task: object) -> None:
            return None

        for _ in range(3):
            tasks.submit(TaskKind.LOAD, "s", 1, nothing)
        await asyncio.sleep(0.05)
        batch, stopped = await events.next("s", 1.0)
        assert [t.task_id for t in batch] == [1, 2, 3] and not stopped
        for _ in range(4):  # one more than the backlog holds
            tasks.submit(TaskKind.LOAD, "s", 1, nothing)
        await asyncio.sleep(0.05)
        assert await events.next("s", 0.1) == ([], True)
        assert await events.next("s", 0.1) == ([], False)  # said once; from now on heartbeats only
        await tasks.shutdown(1.0)

    asyncio.run(main())
