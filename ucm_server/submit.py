"""The one submit path: a Load, Dump or Prefetch checked up front, then run as a task.

Every Load and Dump takes the same steps, whatever memory it names: its session (the caller's
tenant's) and task slots, its keys (mapped into the caller's tenant), the caps that bound its cost,
a Load's destination sizes, a Dump's namespace claimed for its tenant; then the mover for its memory
(:mod:`ucm_server.movers`: host regions, or GPU memory by CUDA IPC) checks and pins every segment,
the session and regions are checked to still be there, a Dump is admitted by the quota, and the
task starts. Nothing is copied for a request refused on the way. Each chunk the mover moves is told
to the quota (:meth:`ucm_server.quota.Quota.settle`), whichever mover it is.

While a task runs, the regions it copies to or from are pinned and tracked, so UnregisterRegion can
stop it (:meth:`Submitter.release_region`): when that call returns, nothing is copied any more.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from ucm_protocol.errors import InvalidArgument, ResourceExhausted
from ucm_protocol.keys import BlockKey
from ucm_server.blocks import Blocks
from ucm_server.chunks import CHUNK_BLOCKS
from ucm_server.gpu_region import GpuRegion
from ucm_server.movers import Mover, Plan
from ucm_server.quota import Quota
from ucm_server.regions import Region, RegionTable, SegmentColumns
from ucm_server.sessions import Session, Sessions
from ucm_server.store.pipeline import Pipeline
from ucm_server.tasks import Task, TaskKind, TaskManager

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SegmentCaps:
    max_segments_per_request: int
    max_segments_per_block: int


class Submitter:
    def __init__(
        self,
        caps: SegmentCaps,
        sessions: Sessions,
        blocks: Blocks,
        host: Mover,
        gpu: Mover,
        quota: Quota,
    ) -> None:
        self.caps = caps
        self.sessions = sessions
        self.blocks = blocks
        self.host = host
        self.gpu = gpu
        self.quota = quota
        self.tasks: TaskManager = sessions.tasks
        self.regions: RegionTable = sessions.regions
        self.pipeline: Pipeline = blocks.pipeline
        self._region_tasks: dict[Region | GpuRegion, dict[int, Task]] = {}
        """The unfinished tasks copying to or from each region (see :meth:`release_region`)."""

    async def start_io(
        self,
        kind: TaskKind,
        session_id: str | None,
        namespace: bytes,
        digests: Sequence[bytes],
        columns: SegmentColumns,
        *,
        durable: bool = False,
        progress: tuple[int, int, int] | None = None,
    ) -> Task:
        """Check everything up front (nothing is copied for a bad request), then run as a task.

        ``progress``: a Load's progress word ``(region, offset, length)``
        (:mod:`ucm_server.load_progress`); taken for host loads only, which the task says in
        ``reports_progress``."""
        session = self.sessions.get(session_id)
        self.sessions.check_task_slot(session)
        keys = self.blocks.keys(namespace, digests)
        self._check_segment_caps(columns)
        if kind is TaskKind.LOAD:
            await self._check_load_sizes(keys, digests, columns.counts, columns.lengths)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")
        if kind is TaskKind.DUMP:
            await self.quota.claim(keys)  # before the regions are found and pinned
        mover = self.gpu if self.regions.has_gpu(columns.region_ids) else self.host
        plan = await mover.prepare(
            kind, session.session_id, columns, columns.block_counts(len(keys)), progress
        )
        try:
            self.sessions.check_live(session, plan.regions)
            if kind is TaskKind.DUMP:
                self.quota.admit_write(keys, plan.sizes)
        except BaseException:
            self.regions.unpin(plan.regions)
            raise

        async def body(task: Task) -> None:
            await mover.run(task, keys, plan, durable, self.quota.settle)

        task = self._start(kind, session, len(keys), body, plan)
        task.reports_progress = plan.reports_progress
        return task

    def start_prefetch(self, session_id: str | None, namespace: bytes, digests: Sequence[bytes]) -> Task:
        """Bring blocks up into the Cache, as a task of the session."""
        session = self.sessions.get(session_id)
        self.sessions.check_task_slot(session)
        keys = self.blocks.keys(namespace, digests)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")

        async def body(task: Task) -> None:
            for start in range(0, len(keys), CHUNK_BLOCKS):
                if task.cancel_requested:
                    return
                for offset, r in enumerate(await self.pipeline.prefetch(keys[start : start + CHUNK_BLOCKS])):
                    task.record(start + offset, r)

        return self.tasks.submit(TaskKind.PREFETCH, session.session_id, len(keys), body)

    async def release_region(self, session_id: str | None, region_id: int) -> None:
        """UnregisterRegion: when this returns the daemon no longer touches the region's memory.

        Forgetting the region alone is not enough: a Load still running into it would go on writing
        for as long as it ran, over memory the client had every reason to think was its own again.
        The session's tasks still using the region are cancelled and waited for, as Cancel does:
        blocks they had not copied end CANCELLED, and nothing is copied after the call returns."""
        s = self.sessions.get(session_id)
        region = self.regions.get(s.session_id, region_id)
        users = list(self._region_tasks.get(region, {}).values())
        self.regions.unregister(s.session_id, region_id)
        if users:
            log.info(
                "session %s unregistered region %d under %d running task(s): cancelling them",
                s.session_id[:8],
                region_id,
                len(users),
            )
            await asyncio.gather(*(self.tasks.cancel(task) for task in users))

    # -- the steps ---------------------------------------------------------------------------------------
    def _check_segment_caps(self, columns: SegmentColumns) -> None:
        """The caps that bound a request's cost (RESOURCE_EXHAUSTED, naming the setting)."""
        nseg = len(columns.region_ids)
        cap = self.caps.max_segments_per_request
        if nseg > cap:
            raise ResourceExhausted(
                f"{nseg} segments in one request; the limit is {cap} (setting max_segments_per_request)"
            )
        cap = self.caps.max_segments_per_block
        most = max(columns.counts) if columns.counts else 1
        if most > cap:
            b = columns.counts.index(most)
            raise ResourceExhausted(
                f"block {b} has {most} segments; the limit is {cap} (setting max_segments_per_block)"
            )

    async def _check_load_sizes(
        self, keys: list[BlockKey], digests: Sequence[bytes], counts: list[int], lengths: list[int]
    ) -> None:
        """A load into a destination of the wrong size is the caller's mistake: refuse it whole
        (``INVALID_ARGUMENT``, nothing copied) rather than fail blocks one by one."""
        sizes = await self.pipeline.lookup(keys, digests)
        if counts:  # per-block sums from prefix sums: linear in C, whatever the segments per block
            prefix = list(itertools.accumulate(lengths, initial=0))
            bounds = list(itertools.accumulate(counts, initial=0))
            if bounds[-1] != len(lengths):
                return  # a malformed batch: the shape check names what is wrong
            wanted = [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]
        else:
            wanted = lengths
        if sizes == wanted:  # every block stored, at the size named (one C-level compare)
            return
        for i, (have, want) in enumerate(zip(sizes, wanted, strict=False)):
            if have is not None and have != want:
                raise InvalidArgument(f"block {i}: stored block is {have} bytes, the request names {want}")

    def _start(
        self,
        kind: TaskKind,
        session: Session,
        nblocks: int,
        body: Callable[[Task], Awaitable[None]],
        plan: Plan,
    ) -> Task:
        """Submit a task body, re-checking the session's task slots (the checks may have awaited).

        The plan's regions (pinned by its mover) are tracked for :meth:`release_region` while the
        task lives and unpinned when it ends, whether or not its body ran; the plan is told first
        (a Load's progress word reads DONE even for a task cancelled while queued, so no reader
        waits on it until its deadline)."""
        held: list[Region | GpuRegion] = list(plan.regions)
        try:
            self.sessions.check_task_slot(session)
        except ResourceExhausted:
            self.regions.unpin(held)
            raise

        def release(task: Task) -> None:
            plan.done()
            self._untrack(task, held)
            self.regions.unpin(held)

        task = self.tasks.submit(kind, session.session_id, nblocks, body, release)
        self._track(task, held)  # before the body first runs (it starts at the next await)
        return task

    def _track(self, task: Task, regions: Iterable[Region | GpuRegion]) -> None:
        for region in regions:
            self._region_tasks.setdefault(region, {})[task.task_id] = task

    def _untrack(self, task: Task, regions: Iterable[Region | GpuRegion]) -> None:
        for region in regions:
            users = self._region_tasks.get(region)
            if users is not None:
                users.pop(task.task_id, None)
                if not users:
                    del self._region_tasks[region]
