"""One task's memory copies, run one after another by one worker thread that never waits in between.

A Dump moves its blocks a chunk at a time (:func:`ucm_server.movers.overlapped`): the event loop
allocates and publishes chunks while their bytes are copied in the executor. With each chunk's
copy an executor job of its own, two chunks' copies ran at once on two background threads (which
run at a lower priority: on two cores they shared the one the loop left), ended together, and then
waited together while the loop published both and prepared the next two; and each copy started
only once an idle worker had woken up. Traced on 4,096 blocks of 64 KiB (16 chunks): no copy was
running for 4.3 of the task's 25 ms.

A :class:`CopyLane` instead queues the task's copies: one executor job drains the queue, copy after
copy, handing each result back to the loop as it ends, while the loop keeps the queue fed with the
next chunks. The job ends when the queue is empty, so no thread waits on a lane. Each task has its
own lane (:func:`lane_for_task`): two clients' tasks still copy side by side. Measured in eight
alternating pairs, Dump of 4,096 x 64 KiB went from 0.66-0.74x to 0.69-0.85x of memcpy. Only a
Dump of small blocks takes a lane (:meth:`ucm_server.movers.HostMover.run`): 1 MiB blocks' copies
are split over two threads already, and in a lane their Dump fell from 1.07-1.19x to 0.92-0.99x;
a Load's copies run at full priority, and two at once got more of the memory bandwidth than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_Copy = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class CopyLane:
    """Copies run in the order queued, by one executor job at a time (see the module)."""

    __slots__ = ("_draining", "_lock", "_queue")

    def __init__(self) -> None:
        self._queue: deque[_Copy] = deque()
        self._lock = threading.Lock()
        self._draining = False
        """A job is draining the queue (it looks again under the lock before it ends)."""

    async def run(self, executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the lane, after the copies queued before it; its result or exception.
        A waiter cancelled meanwhile does not stop the copy (as with ``run_in_executor``)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._queue.append((fn, args, done, loop))
            start = not self._draining
            self._draining = True
        if start:
            try:
                drained = loop.run_in_executor(executor, self._drain)
            except BaseException:  # refused (shutting down): nothing was queued before this copy
                with self._lock:
                    self._queue.clear()
                    self._draining = False
                raise
            drained.add_done_callback(self._drained)
        return await done

    def _drained(self, drained: asyncio.Future[None]) -> None:
        """The drain job ended; one that never ran (the executor shut down and dropped it) fails
        the copies still queued, so no waiter waits for good."""
        if not drained.cancelled() and drained.exception() is None:
            return
        with self._lock:
            left, self._draining = list(self._queue), False
            self._queue.clear()
        for _, _, done, _ in left:
            if not done.done():
                done.set_exception(RuntimeError("the copy executor shut down before this copy ran"))

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                fn, args, done, loop = self._queue.popleft()
            try:
                result = fn(*args)
            except BaseException as exc:  # delivered to the waiter, as an executor job's would be
                _deliver(loop, done, None, exc)
            else:
                _deliver(loop, done, result, None)


def _deliver(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], result: Any, exc: BaseException | None
) -> None:
    def settle() -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(settle)


current_lane: ContextVar[CopyLane | None] = ContextVar("ucm_copy_lane", default=None)
"""The lane of the task whose chunk is running here (None outside a task: a copy of its own)."""


@contextlib.contextmanager
def lane_for_task() -> Iterator[CopyLane]:
    """A lane for the copies of the task running in this context (its chunks inherit it)."""
    lane = CopyLane()
    token = current_lane.set(lane)
    try:
        yield lane
    finally:
        current_lane.reset(token)


async def run_copy(executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` off the loop: in the current task's lane, else as one executor job."""
    lane = current_lane.get()
    if lane is not None:
        return await lane.run(executor, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
