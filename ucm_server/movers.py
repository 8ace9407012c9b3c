"""How a Load's or Dump's bytes move: one small protocol, two movers, chosen per request.

The submit path (:mod:`ucm_server.submit`) checks a request once, the same way whatever memory it
names, then hands it to the :class:`Mover` for that memory and runs the mover's plan as a task:

- :class:`HostMover`: host regions (a client's memfds, mapped): every segment checked, one iovec per
  block, and the task's blocks moved a chunk at a time through the pipeline, where the tiers copy
  with ``memmove``/``preadv``; a Load's progress word is reported by its last chunk.
- :class:`~ucm_server.gpu.service.GpuService`: GPU memory reached by CUDA IPC; Cache pages leased or
  reserved and filled by ``cudaMemcpyAsync``, chunks queued on the device's streams.

A mover's :meth:`~Mover.prepare` validates and pins what the request names and nothing is copied
for a bad request; :meth:`~Mover.run` moves the blocks and tells one :data:`Settle` callback what
each chunk moved (the tenants' quota accounting, :meth:`ucm_server.quota.Quota.settle`), whichever
mover it is. (The client side has the same shape: ``ucm_client.vllm.kv_access``.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ucm_protocol.keys import BlockKey
from ucm_server.chunks import chunk_bounds
from ucm_server.gpu_region import GpuRegion
from ucm_server.load_progress import ProgressWord, progress_word
from ucm_server.regions import (
    Region,
    RegionTable,
    SegmentColumns,
    check_disjoint,
    check_segments,
    host_iovecs,
    single_segment_batch,
)
from ucm_server.store.base import BlockResult
from ucm_server.store.copy_lane import lane_for_task
from ucm_server.store.copying import IoVec, iov_len
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.spans import split_over_threads
from ucm_server.tasks import Task, TaskKind

T = TypeVar("T")

Settle = Callable[[TaskKind, Sequence[BlockKey], Sequence[int], Sequence[BlockResult]], Awaitable[None]]
"""``(kind, keys, sizes, results)`` of a chunk a task moved: told to the quota accounting."""

INLINE_SEGMENTS = 4096
"""Requests with more segments than this are validated in a worker thread, not on the event loop."""


class Plan(Protocol):
    """A validated request, ready to run."""

    @property
    def regions(self) -> set[Region] | set[GpuRegion]:
        """The regions it names, pinned until the task ends (the task unpins them)."""
        ...

    @property
    def sizes(self) -> list[int]:
        """Bytes of each block."""
        ...

    @property
    def reports_progress(self) -> bool:
        """A Load that took its client's progress word (:mod:`ucm_server.load_progress`)."""
        ...

    def done(self) -> None:
        """The task ended (whatever its outcome, also cancelled while queued)."""
        ...


class Mover(Protocol):
    """What the submit path needs of a kind of memory."""

    async def prepare(
        self,
        kind: TaskKind,
        session_id: str,
        columns: SegmentColumns,
        counts: list[int],
        progress: tuple[int, int, int] | None,
    ) -> Plan:
        """Check every segment (nothing is copied for a bad request) and pin the regions named."""
        ...

    async def run(
        self, task: Task, keys: Sequence[BlockKey], plan: Plan, durable: bool, settle: Settle
    ) -> None:
        """Move the task's blocks, recording each block's outcome on ``task``."""
        ...


class OffLoop:
    """Runs a request's validation inline when it is small, in a worker thread when it is large, so
    other clients are answered meanwhile (the caps bound its cost: linear in the segments)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    async def __call__(self, nsegments: int, fn: Callable[..., T], *args: object) -> T:
        if nsegments <= INLINE_SEGMENTS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


@dataclass(slots=True)
class HostPlan:
    regions: set[Region]
    items: Callable[[Sequence[BlockKey], int, int], Sequence[tuple[BlockKey, IoVec]]]
    """``(key, iovec)`` of blocks ``start`` to ``stop`` of the keys given (every segment of the batch
    checked already)."""
    sizes: list[int]
    word: ProgressWord | None = None
    """A Load's progress word (:mod:`ucm_server.load_progress`), when the client gave one."""

    @property
    def reports_progress(self) -> bool:
        return self.word is not None

    def done(self) -> None:
        if self.word is not None:
            self.word.done()


class HostMover:
    """Host regions: iovecs into the client's mapped memory, moved through the pipeline."""

    def __init__(
        self, pipeline: Pipeline, regions: RegionTable, off_loop: OffLoop, max_block_bytes: int
    ) -> None:
        self.pipeline = pipeline
        self.regions = regions
        self.off_loop = off_loop
        self.max_block_bytes = max_block_bytes

    async def prepare(
        self,
        kind: TaskKind,
        session_id: str,
        columns: SegmentColumns,
        counts: list[int],
        progress: tuple[int, int, int] | None,
    ) -> HostPlan:
        """The regions found (and pinned), then every segment checked, in a worker thread for a
        large request; a Load's ``progress`` word ``(region, offset, length)`` is taken too."""
        found = self.regions.regions_for(session_id, columns, counts, gpu=False)
        used: set[Region] = set(found.values())
        word = None
        if kind is TaskKind.LOAD and progress is not None:
            word = progress_word(self.regions, session_id, *progress, columns)
            used.add(word.region)
        self.regions.pin(used)
        try:
            return await self.off_loop(
                len(columns.region_ids), self._checked, kind, columns, counts, found, used, word
            )
        except BaseException:
            self.regions.unpin(used)
            raise

    def _checked(
        self,
        kind: TaskKind,
        columns: SegmentColumns,
        counts: list[int],
        found: dict[int, Region],
        used: set[Region],
        word: ProgressWord | None,
    ) -> HostPlan:
        """Every segment checked, overlapping Load destinations refused (no event-loop state: may run
        in a worker thread). A batch of the usual shape makes its views a chunk at a time, as the
        task moves it (as span batches: no view a block); any other has one iovec per block made here."""
        batch = single_segment_batch(columns, found, self.max_block_bytes)
        iovs = (
            []
            if batch is not None
            else host_iovecs(check_segments(columns, counts, found, self.max_block_bytes))
        )
        if kind is TaskKind.LOAD and not (batch is not None and batch.ascending):
            check_disjoint(columns, counts)  # spans in ascending order, one region: disjoint already
        if batch is not None:
            return HostPlan(used, batch.items, batch.lengths, word)

        def items(keys: Sequence[BlockKey], start: int, stop: int) -> list[tuple[BlockKey, IoVec]]:
            return list(zip(keys[start:stop], iovs[start:stop], strict=True))

        return HostPlan(used, items, [iov_len(iov) for iov in iovs], word)

    async def run(
        self, task: Task, keys: Sequence[BlockKey], plan: Plan, durable: bool, settle: Settle
    ) -> None:
        """The task's blocks a chunk at a time, two chunks in flight (:func:`overlapped`): the event
        loop does one chunk's bookkeeping while the other's bytes are copied in a worker thread (a
        Dump of small blocks copies one chunk after another in the task's
        :class:`~ucm_server.store.copy_lane.CopyLane`; otherwise each chunk's copy is a job of its
        own). A Load's progress word is reported by the last chunk only,
        started once every other chunk has ended, as its counts then hold for every block of the
        task; a Dump naming a key twice runs its chunks one after the other, so the later copy of
        the key is the one stored."""
        assert isinstance(plan, HostPlan)
        block_items, sizes, word = plan.items, plan.sizes, plan.word
        bounds = chunk_bounds(sizes)

        async def move(start: int, stop: int) -> None:
            items = block_items(keys, start, stop)
            if task.kind is TaskKind.LOAD:
                last = stop == bounds[-1][1]
                report = word.report if word is not None and last else None
                results = await self.pipeline.read_many(items, report=report)
            else:
                results = await self.pipeline.write_many(items, durable=durable)
            task.record_many(start, results, sizes[start:stop])
            await settle(task.kind, keys[start:stop], sizes[start:stop], results)

        in_order = len(bounds) > 1 and task.kind is TaskKind.DUMP and len(set(keys)) != len(keys)
        tail = bounds[-1:] if word is not None else []
        width = 1 if in_order else CHUNKS_IN_FLIGHT
        small = bool(sizes) and not split_over_threads(sizes)  # copies on one thread each
        lane = lane_for_task() if task.kind is TaskKind.DUMP and small else contextlib.nullcontext()
        with lane:  # a Dump's copies one after another in one worker (:mod:`~ucm_server.store.copy_lane`)
            await overlapped(task, move, bounds[: len(bounds) - len(tail)], width)
            await overlapped(task, move, tail, 1)


CHUNKS_IN_FLIGHT = 2
"""Chunks of one task moved at once: one copied while the next is looked up, leased and allocated
on the event loop (on two cores the bookkeeping then hides behind the copy)."""


async def overlapped(
    task: Task,
    move: Callable[[int, int], Awaitable[None]],
    bounds: Sequence[tuple[int, int]],
    width: int,
) -> None:
    """``move(start, stop)`` for each chunk of ``bounds``, ``width`` at a time, in order of start;
    no chunk starts once the task is asked to stop, and this returns only when every chunk started
    has ended (a chunk still copying into a client's memory after the task ended could overwrite
    memory the client had reused). The first failure is raised after that."""
    if width == 1 or len(bounds) == 1:  # nothing to overlap: no task per chunk
        for start, stop in bounds:
            if task.cancel_requested:
                return
            await move(start, stop)
        return
    running: set[asyncio.Task[None]] = set()
    failure: BaseException | None = None
    try:
        for start, stop in bounds:
            if task.cancel_requested:
                break
            running.add(asyncio.ensure_future(move(start, stop)))
            if len(running) >= width:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                failure = _first_failure(done)
                if failure is not None:
                    break
    finally:
        if running:  # let the chunks started end, even when this task itself is cancelled
            await asyncio.shield(asyncio.wait(running))
            failure = failure or _first_failure(running)
    if failure is not None:
        raise failure


def _first_failure(chunks: set[asyncio.Task[None]]) -> BaseException | None:
    """The first exception of ended chunks (each one's read, so none is reported as never retrieved)."""
    failures = [t.exception() for t in chunks if not t.cancelled()]
    return next((f for f in failures if f is not None), None)
