"""Results of finished tasks pushed by the daemon on the session stream (``AttachRequest.task_events``).

Waiting for a task that has already ended then costs no round trip: the result is here. This matters
where a client waits for many small tasks in a row on a latency path, such as the connector's
per-layer loads with ``use_layerwise``. Everything falls back to the ``Wait``/``Check`` calls when
the result is not here: a task of another session, events stopped by the daemon, or a reconnect
(task ids restart with a restarted daemon, so what was kept is dropped then).

Only tasks this client submitted and has not seen end yet are waited for here (``expect``); for any
other id (a task whose result was dropped to stay within ``keep``, or of another session) ``wait``
returns at once so the caller asks the daemon, instead of waiting out its timeout for an event that
already came.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from ucm_client.types import TaskResult

__all__ = ["FinishedTasks"]

KEEP = 4096
"""Pushed results kept for tasks nobody has waited for yet (oldest dropped first)."""
EXPECT = 1 << 16
"""Submitted, still running tasks remembered (beyond that the oldest are asked of the daemon)."""


class FinishedTasks:
    """Pushed results by task id, and the waiters for tasks still running. Event-loop confined."""

    def __init__(self) -> None:
        self.enabled = False
        """True while pushed events can be relied on (session open, daemon still sending them)."""
        self.keep = KEEP
        """How many results to keep for tasks nobody waited on yet (oldest dropped first)."""
        self._results: OrderedDict[int, TaskResult] = OrderedDict()
        self._waiters: dict[int, asyncio.Future[TaskResult | None]] = {}
        self._running: OrderedDict[int, None] = OrderedDict()
        """Tasks this client submitted whose result has not been pushed yet."""

    def reset(self, *, enabled: bool) -> None:
        """Forget everything (a new or lost session); pending waiters return None (ask the daemon)."""
        self.enabled = enabled
        self._results.clear()
        self._running.clear()
        waiters, self._waiters = self._waiters, {}
        for future in waiters.values():
            if not future.done():
                future.set_result(None)

    def expect(self, task_id: int) -> int:
        """Note a task just submitted (its result may already be here: the push can beat the reply)."""
        if self.enabled and task_id not in self._results:
            self._running[task_id] = None
            while len(self._running) > EXPECT:
                self._running.popitem(last=False)
        return task_id

    def deliver(self, result: TaskResult) -> None:
        self._running.pop(result.task_id, None)
        self._results[result.task_id] = result
        self._results.move_to_end(result.task_id)
        while len(self._results) > self.keep:
            self._results.popitem(last=False)
        future = self._waiters.pop(result.task_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def peek(self, task_id: int) -> TaskResult | None:
        return self._results.get(task_id)

    def take(self, task_id: int) -> TaskResult | None:
        return self._results.pop(task_id, None)

    async def wait(self, task_id: int, timeout_s: float) -> TaskResult | None:
        """The task's pushed result within ``timeout_s``; None if it did not come (ask the daemon).

        None at once for a task not expected to push anything now: one that ended long ago (its
        result dropped), one of another session, or one submitted before a reconnect.
        """
        result = self.take(task_id)
        if result is not None or not self.enabled or timeout_s <= 0 or task_id not in self._running:
            return result
        future = self._waiters.get(task_id)
        if future is None:
            future = self._waiters[task_id] = asyncio.get_running_loop().create_future()
        try:  # shielded: on a timeout the future stays for a later wait; ``deliver`` removes it
            result = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return None
        self._results.pop(task_id, None)
        return result
