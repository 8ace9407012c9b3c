"""Asynchronous tasks: submit returns an id at once, results are data.

A task is a batch of blocks to load, dump or prefetch. It runs on the event loop, handing copies and
disk work to the tiers' executors a chunk at a time. ``wait`` may be called any number of times and
never blocks past its timeout; ``cancel`` stops the task between chunks and returns only once the task
has stopped touching client memory, so the caller may reuse its buffers immediately. Finished tasks are
kept for ``retention_s`` so a late ``Check`` still answers; a session's tasks are cancelled and dropped
when the session ends.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ucm_protocol.errors import NotFound, PermissionDenied
from ucm_protocol.states import BlockState
from ucm_server import tracing
from ucm_server.store.base import OK, BlockResult
from ucm_server.store.io_classes import ClassedSlots, class_of_task, io_class

log = logging.getLogger(__name__)


class TaskKind(enum.IntEnum):  # values match ucm.v1.TaskKind
    LOAD = 1
    DUMP = 2
    PREFETCH = 3


class TaskState(enum.IntEnum):  # values match ucm.v1.TaskState
    RUNNING = 1
    DONE = 2
    CANCELLED = 3


@dataclass(slots=True)
class Task:
    task_id: int
    kind: TaskKind
    session_id: str
    nblocks: int
    states: bytearray = field(init=False)
    reasons: dict[int, str] = field(default_factory=dict)
    bytes_done: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    cancel_requested: bool = False
    state: TaskState = TaskState.RUNNING
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reports_progress: bool = False
    """A Load that took its client's progress word (``ucm_server.load_progress``)."""

    def __post_init__(self) -> None:
        self.states = bytearray([BlockState.PENDING]) * self.nblocks

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def record(self, index: int, result: BlockResult, nbytes: int = 0) -> None:
        self.states[index] = result.state
        if result.reason:
            self.reasons[index] = result.reason
        if result.ok:
            self.bytes_done += nbytes

    def record_many(self, start: int, results: list[BlockResult], sizes: Sequence[int]) -> None:
        """:meth:`record` for blocks ``start`` onwards (``sizes``: theirs). When every one is OK, the
        usual case, one slice of states and one sum instead of a call per block (a chunk of 256
        small blocks paid ~0.3 µs a block here)."""
        count = len(results)
        if results.count(OK) == count:  # identity first: C-level for the shared OK result
            self.states[start : start + count] = _OK_STATES * count
            self.bytes_done += sum(sizes[:count])
            return
        for i, r in enumerate(results):
            self.record(start + i, r, sizes[i])

    def finish(self) -> None:
        """Blocks never reached end CANCELLED (a search in C first: every block is usually done)."""
        states = self.states
        i = states.find(BlockState.PENDING)
        while i >= 0:
            states[i] = BlockState.CANCELLED
            i = states.find(BlockState.PENDING, i + 1)
        self.state = TaskState.CANCELLED if self.cancel_requested else TaskState.DONE
        self.finished = time.monotonic()
        self.done.set()


TaskBody = Callable[[Task], Awaitable[None]]
_OK_STATES = bytes([BlockState.OK])


class TaskManager:
    def __init__(self, *, retention_s: float, max_running: int = 64) -> None:
        self.retention_s = retention_s
        self._tasks: dict[int, Task] = {}
        self._runners: dict[int, asyncio.Task[None]] = {}
        self._ids = itertools.count(1)
        self._slots = ClassedSlots(max_running)  # a Load never waits for a slot behind queued dumps
        self._queued = 0
        self._waiting: set[int] = set()
        """Tasks whose runner waits for a slot now: stopping one ends its wait at once."""
        self._active: dict[str, int] = {}  # running or queued tasks per session (the per-session cap)
        self.on_finish: list[Callable[[Task], None]] = []

    @property
    def running(self) -> int:
        return len(self._runners)

    @property
    def queued(self) -> int:
        return self._queued

    def active(self, session_id: str) -> int:
        """Tasks of ``session_id`` submitted and not yet finished."""
        return self._active.get(session_id, 0)

    def submit(
        self,
        kind: TaskKind,
        session_id: str,
        nblocks: int,
        body: TaskBody,
        release: Callable[[Task], None] | None = None,
    ) -> Task:
        """Run ``body`` when a slot is free. ``release`` (what the task holds: pinned regions) runs
        once when the task ends, also when it was cancelled while queued and ``body`` never ran: a
        release inside ``body`` was skipped then, and the client's memory stayed mapped for good."""
        self._reap()
        body = tracing.task_body(kind, body)  # inside its span when tracing is on (a child of the caller's)
        task = Task(task_id=next(self._ids), kind=kind, session_id=session_id, nblocks=nblocks)
        self._tasks[task.task_id] = task
        self._active[session_id] = self._active.get(session_id, 0) + 1
        self._queued += 1  # until it holds a slot: counted from now, not from its first step on the loop
        self._runners[task.task_id] = asyncio.create_task(
            self._run(task, body, release), name=f"ucm-task-{task.task_id}"
        )
        return task

    async def _run(self, task: Task, body: TaskBody, release: Callable[[Task], None] | None) -> None:
        queued = True
        self._waiting.add(task.task_id)
        try:
            with io_class(class_of_task(task.kind.name)):  # its disk and copy work, in the pools' order
                async with self._slots.hold():
                    self._queued -= 1
                    self._waiting.discard(task.task_id)
                    queued = False
                    if not task.cancel_requested:
                        await body(task)
        except asyncio.CancelledError:
            if not queued:
                raise
            # stopped while waiting for a slot (:meth:`_stop`): its body never ran
        except Exception as exc:  # a failure is data: every unfinished block fails with the reason
            log.exception("task %d failed", task.task_id)
            for i, s in enumerate(task.states):
                if s == BlockState.PENDING:
                    task.states[i] = BlockState.FAILED
                    task.reasons[i] = f"internal error: {exc}"
        finally:
            if queued:  # it never held a slot (stopped while waiting): no longer queued either
                self._queued -= 1
                self._waiting.discard(task.task_id)
            if release is not None:
                release(task)
            self._runners.pop(task.task_id, None)
            left = self._active.get(task.session_id, 1) - 1
            if left > 0:
                self._active[task.session_id] = left
            else:
                self._active.pop(task.session_id, None)
            task.finish()
            for hook in self.on_finish:
                hook(task)

    def get(self, task_id: int, session_id: str | None = None) -> Task:
        task = self._tasks.get(task_id)
        if task is None:
            raise NotFound(f"unknown task {task_id} (finished tasks are kept {self.retention_s:g}s)")
        if session_id is not None and task.session_id != session_id:
            raise PermissionDenied(f"task {task_id} belongs to another session")
        return task

    async def wait(self, task: Task, timeout_s: float, cancel_on_timeout: bool = False) -> Task:
        if timeout_s > 0 and not task.done.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(task.done.wait()), timeout_s)
            except TimeoutError:
                if cancel_on_timeout:
                    await self.cancel(task)
        return task

    async def cancel(self, task: Task) -> Task:
        """Ask the task to stop and wait until it has (it checks between chunks)."""
        if not task.done.is_set():
            self._stop(task)
            await task.done.wait()
        return task

    def _stop(self, task: Task) -> None:
        """Ask ``task`` to stop: a running one stops between chunks; one still waiting for a slot
        leaves the queue now, its body never run, instead of holding its caller until a running
        task ends and frees a slot only for it to give back unused."""
        task.cancel_requested = True
        runner = self._runners.get(task.task_id)
        if runner is not None and task.task_id in self._waiting:
            runner.cancel()

    async def release_session(self, session_id: str) -> int:
        mine = [t for t in self._tasks.values() if t.session_id == session_id]
        for t in mine:
            self._stop(t)
        await asyncio.gather(*(t.done.wait() for t in mine))
        for t in mine:
            self._tasks.pop(t.task_id, None)
        return len(mine)

    async def shutdown(self, grace_s: float) -> None:
        """Let running tasks finish for ``grace_s``, then cancel what is left."""
        pending = [t for t in self._tasks.values() if not t.done.is_set()]
        if not pending:
            return
        await asyncio.wait([asyncio.create_task(t.done.wait()) for t in pending], timeout=grace_s)
        for t in pending:
            self._stop(t)
        await asyncio.gather(*(t.done.wait() for t in pending))

    def _reap(self) -> None:
        cutoff = time.monotonic() - self.retention_s
        old = [tid for tid, t in self._tasks.items() if t.finished is not None and t.finished < cutoff]
        for tid in old:
            del self._tasks[tid]
