"""Finished-task events, pushed on the session stream of clients that ask for them.

A client that waits for a task with a ``Wait`` call pays a round trip (~0.5-0.8 ms here) even when
the task ended long ago; the connector waits once per attention layer with ``use_layerwise`` and
polls its saves every step. With ``AttachRequest.task_events`` the daemon sends each of the
session's tasks' final status on the ``Attach`` stream as it ends, and the client answers such waits
from memory.

The backlog per session is bounded: a client that stops reading its stream cannot make the daemon
hold finished tasks forever. On overflow the session's events stop for good, and the stream says so
once (``task_events_stopped``) so the client goes back to ``Wait``/``Check`` for everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ucm_server.tasks import Task

log = logging.getLogger(__name__)

BACKLOG = 8192
"""Finished tasks a session may have unsent before its events stop."""
BATCH = 256
"""Most task statuses in one stream message."""


class TaskEvents:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Task | None]] = {}
        self._stopped: set[str] = set()

    def open(self, session_id: str) -> None:
        self._queues[session_id] = asyncio.Queue(BACKLOG)

    def close(self, session_id: str) -> None:
        self._queues.pop(session_id, None)
        self._stopped.discard(session_id)

    def publish(self, task: Task) -> None:
        """``TaskManager.on_finish`` hook: queue the task for its session's stream, if it asked."""
        queue = self._queues.get(task.session_id)
        if queue is None:
            return
        try:
            queue.put_nowait(task)
        except asyncio.QueueFull:
            del self._queues[task.session_id]
            self._stopped.add(task.session_id)
            log.warning(
                "session %s: %d finished tasks not read from its stream; task events stop for it",
                task.session_id[:8],
                BACKLOG,
            )

    def poke(self, *_: object) -> None:
        """Send every session an event now (a heartbeat: the daemon's state changed, e.g. the
        ``store_saturated`` flag, :mod:`ucm_server.pressure`)."""
        for queue in self._queues.values():
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)

    async def next(self, session_id: str, timeout_s: float) -> tuple[list[Task], bool]:
        """Tasks that ended since the last call, waiting up to ``timeout_s`` for the first one (an
        empty list is a heartbeat); the flag is True exactly once, when the session's events stop."""
        if session_id in self._stopped:
            self._stopped.discard(session_id)
            return [], True
        queue = self._queues.get(session_id)
        if queue is None:
            await asyncio.sleep(timeout_s)
            return [], False
        try:
            first = await asyncio.wait_for(queue.get(), timeout_s)
        except TimeoutError:
            return [], False
        batch = [first]
        while len(batch) < BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        return [t for t in batch if t is not None], False
