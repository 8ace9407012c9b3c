"""The daemon's GPU data path: CUDA IPC regions, a pinned Cache arena, batched device copies.

A vLLM worker shares its GPU KV cache once, as CUDA IPC handles; from then on Load/Dump name
``(region, offset, length)`` segments in that memory exactly as for shared memory, and the daemon moves
the bytes with ``cudaMemcpyAsync`` between the client's GPU memory and its own Cache arena:

* **load**: each block cached in the arena is leased (so it cannot be evicted or reused mid-copy) and
  copied host→device straight from its arena pages. Blocks not in the Cache are first read from the
  lower tiers into a pinned bounce buffer (which also promotes them into the Cache), then copied.
* **dump**: Cache pages are reserved for each block, filled device→host, and published only once the
  copies have completed, so no reader ever sees a half-written block; write-back to the lower tiers then
  proceeds as for host blocks. Blocks the Cache cannot take go through a pinned bounce buffer and the
  ordinary pipeline write.

The arena is page-locked once (``cudaHostRegister``) when the GPU path starts, so every copy is a DMA
with no staging copy in either process and no KV byte in a gRPC message. A task's blocks are copied a
chunk at a time: all copies of a chunk are queued on one of the device's streams (a small pool per
device) and an event is recorded after them; up to ``QUEUE_DEPTH`` chunks are queued before the oldest
is waited for, so host-side bookkeeping overlaps the transfers. A block is reported OK only after the
event of its copies has completed. Ordering against the client's own kernels is the client's side of
the contract: it records an event after the kernels that produce the blocks and waits for it before it
asks for a dump (``ucm_client.gpu``), and it waits for a load's task before its kernels read the blocks.

cupy is optional and is imported only when the first GPU region arrives (or at start with
``gpu: on``); a daemon without cupy or without a device refuses GPU regions with that reason and keeps
serving host clients. All CUDA calls go through :class:`~ucm_server.gpu.backend.CudaBackend`, so this
module is tested on CPU-only machines with a fake backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.keys import BlockKey
from ucm_server.chunks import CHUNK_BLOCKS, CHUNK_BYTES, chunk_bounds  # noqa: F401 (names kept here)
from ucm_server.gpu.backend import (
    IPC_HANDLE_BYTES,
    CudaBackend,
    CudaError,
    GpuUnavailable,
    Piece,
    load_backend,
)
from ucm_server.gpu_region import CudaImport, GpuRegion
from ucm_server.regions import RegionTable, SegmentColumns, check_disjoint
from ucm_server.store.base import OK, BlockResult, failed
from ucm_server.store.leasing import Leasing
from ucm_server.store.pipeline import Pipeline
from ucm_server.tasks import Task, TaskKind

if TYPE_CHECKING:
    from ucm_server.movers import OffLoop, Plan, Settle
    from ucm_server.store.cache import Lease, Reservation

log = logging.getLogger(__name__)
T = TypeVar("T")

STREAMS_PER_DEVICE = 4
QUEUE_DEPTH = 3
"""Chunks of one task queued on the device at once: the next ones are queued while one completes."""
STAGING_ROUND = 2 << 20
STAGING_MIN = 8 << 20
STAGING_KEEP = 512 << 20
"""Pinned bounce buffers kept for reuse (allocating pinned memory costs milliseconds)."""

GpuMode = Literal["auto", "on", "off"]


@dataclass(frozen=True, slots=True)
class DeviceBlock:
    """One block of a GPU request: its device and its segments as (device address, length)."""

    device: int
    segments: tuple[tuple[int, int], ...]
    nbytes: int


@dataclass(slots=True)
class GpuPlan:
    """A validated GPU request: one :class:`DeviceBlock` per key, and the regions to pin meanwhile
    (a :class:`~ucm_server.movers.Plan`)."""

    blocks: list[DeviceBlock]
    regions: set[GpuRegion]

    @property
    def sizes(self) -> list[int]:
        return [block.nbytes for block in self.blocks]

    @property
    def reports_progress(self) -> bool:
        """A progress word is a host Load's only."""
        return False

    def done(self) -> None:
        """Nothing to give back: the task unpins the regions."""


@dataclass(slots=True)
class _Mapping:
    device: int
    ptr: int
    alloc: int | None
    refs: int = 0


@dataclass(slots=True, eq=False)
class _Pinned:
    ptr: int
    size: int
    view: memoryview


@dataclass(slots=True)
class _Flight:
    """One chunk whose copies are queued: what to release and record once its events complete."""

    start: int
    keys: Sequence[BlockKey]
    blocks: Sequence[DeviceBlock]
    results: list[BlockResult | None]
    events: list[tuple[int, int]] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    reservations: list[tuple[int, Reservation]] = field(default_factory=list)
    staged: list[tuple[int, int]] = field(default_factory=list)
    """(block index in the chunk, offset in ``pinned``) of blocks going through the bounce buffer."""
    pinned: _Pinned | None = None
    error: str = ""


def pair_runs(dst: Sequence[tuple[int, int]], src: Sequence[tuple[int, int]]) -> list[Piece]:
    """Copies that move the concatenation of ``src`` runs into the ``dst`` runs (equal totals).

    Pieces contiguous on both sides are merged, so a block whose arena pages and device segment are
    both contiguous is one ``cudaMemcpyAsync``.
    """
    pieces: list[Piece] = []
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        daddr, dlen = dst[di]
        saddr, slen = src[si]
        n = min(dlen - doff, slen - soff)
        d, s = daddr + doff, saddr + soff
        if pieces and pieces[-1][0] + pieces[-1][2] == d and pieces[-1][1] + pieces[-1][2] == s:
            pd, ps, pn = pieces[-1]
            pieces[-1] = (pd, ps, pn + n)
        else:
            pieces.append((d, s, n))
        doff += n
        soff += n
        if doff == dlen:
            di, doff = di + 1, 0
        if soff == slen:
            si, soff = si + 1, 0
    return pieces


class _PinnedPool:
    """Pinned host bounce buffers, reused: for blocks that cannot go straight through the arena."""

    def __init__(self, backend: CudaBackend, keep_bytes: int = STAGING_KEEP) -> None:
        self._backend = backend
        self._keep = keep_bytes
        self._free: list[_Pinned] = []
        self.allocated = 0

    async def take(self, nbytes: int, run: Callable[..., Any]) -> _Pinned:
        fits = [p for p in self._free if p.size >= nbytes]
        if fits:
            best = min(fits, key=lambda p: p.size)
            self._free.remove(best)
            return best
        size = max(STAGING_MIN, -(-nbytes // STAGING_ROUND) * STAGING_ROUND)
        ptr = int(await run(self._backend.host_alloc, size))
        self.allocated += size
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        return _Pinned(ptr, size, view)

    def give(self, pinned: _Pinned) -> None:
        self._free.append(pinned)
        while len(self._free) > 1 and sum(p.size for p in self._free) > self._keep:
            self._drop(self._free.pop(0))

    def _drop(self, pinned: _Pinned) -> None:
        with contextlib.suppress(BufferError):
            pinned.view.release()
        self.allocated -= pinned.size
        try:
            self._backend.host_free(pinned.ptr)
        except CudaError as exc:
            log.warning("freeing a pinned bounce buffer failed: %s", exc)

    def close(self) -> None:
        while self._free:
            self._drop(self._free.pop())


class GpuService:
    """GPU regions and device copies for one engine; starts (imports cupy, pins the arena) on first use.

    The submit path's :class:`~ucm_server.movers.Mover` for GPU memory (:meth:`prepare`, :meth:`run`)."""

    def __init__(
        self,
        pipeline: Pipeline,
        executor: Executor | None,
        *,
        regions: RegionTable | None = None,
        off_loop: OffLoop | None = None,
        max_block_bytes: int = 0,
        mode: GpuMode = "auto",
        backend_factory: Callable[[], CudaBackend] = load_backend,
        streams_per_device: int = STREAMS_PER_DEVICE,
    ) -> None:
        """``regions``, ``off_loop``, ``max_block_bytes``: what :meth:`prepare` checks requests with."""
        self.pipeline = pipeline
        self.executor = executor
        self.regions = regions
        self.off_loop = off_loop
        self.max_block_bytes = max_block_bytes
        self.mode = mode
        self.backend_factory = backend_factory
        self.streams_per_device = streams_per_device
        self.backend: CudaBackend | None = None
        self.cache: Leasing | None = pipeline.leasing  # the Cache: its arena, leases, reservations
        self._failure: str | None = (
            "this daemon does not serve GPU regions: GPU support is off in its configuration (gpu: off)"
            if mode == "off"
            else None
        )
        self._lock: asyncio.Lock | None = None
        self._devices = 0
        self._uuids: dict[bytes, int] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._streams: dict[int, list[int]] = {}
        self._next: dict[int, Iterator[int]] = {}
        self._pool: _PinnedPool | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """One line for logs and diagnostics."""
        if self.backend is not None:
            pinned = self.cache is not None and self.cache.arena.pinned
            arena = "Cache arena pinned" if pinned else "Cache arena not pinned"
            return f"{self.backend.name}, {self._devices} device(s), {arena}"
        return self._failure or "not started (starts with the first GPU region)"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    async def start(self) -> CudaBackend:
        """Load the backend and pin the Cache arena once; :class:`GpuUnavailable` says why not."""
        if self.backend is not None:
            return self.backend
        if self._failure is not None:
            raise GpuUnavailable(self._failure)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.backend is not None:
                return self.backend
            if self._failure is not None:
                raise GpuUnavailable(self._failure)
            try:
                backend = await self._run(self.backend_factory)
                devices = backend.device_count()
                uuids = {backend.device_uuid(d): d for d in range(devices)}
            except GpuUnavailable as exc:
                self._failure = exc.message
                log.warning("GPU regions will be refused: %s", exc.message)
                raise
            except CudaError as exc:
                self._failure = f"this daemon cannot open GPU regions: CUDA does not answer ({exc})"
                log.warning("GPU regions will be refused: %s", self._failure)
                raise GpuUnavailable(self._failure) from None
            if self.cache is not None:
                began = time.monotonic()
                try:
                    await self._run(self.cache.arena.pin, backend.host_register, backend.host_unregister)
                    log.info(
                        "Cache arena pinned for GPU copies (%d MiB in %.2f s)",
                        self.cache.arena.capacity >> 20,
                        time.monotonic() - began,
                    )
                except CudaError as exc:
                    log.warning("the Cache arena could not be pinned (%s): GPU copies will run slower", exc)
            self._devices = devices
            self._uuids = {u: d for u, d in uuids.items() if u}
            self._pool = _PinnedPool(backend)
            self.backend = backend
            log.info("GPU data path ready: %s", self.status)
            return backend

    async def close(self) -> None:
        """Close every IPC mapping and stream (tasks have finished by now)."""
        backend = self.backend
        if backend is None:
            return
        for key in list(self._mappings):
            self._unmap(key)
        for device, streams in self._streams.items():
            for stream in streams:
                with contextlib.suppress(CudaError):
                    backend.destroy_stream(device, stream)
        self._streams.clear()
        self._next.clear()
        if self._pool is not None:
            self._pool.close()

    # -- regions --------------------------------------------------------------------------------------
    async def register(self, table: RegionTable, session_id: str, cuda: CudaImport) -> GpuRegion:
        """Open (or share an already open) IPC mapping and add a region of it to ``table``."""
        handle, offset, size, label = cuda.handle, cuda.offset, cuda.size, cuda.label
        backend = await self.start()
        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(
                f"cuda_ipc_handle must be {IPC_HANDLE_BYTES} bytes (a cudaIpcMemHandle_t), got {len(handle)}"
            )
        if size <= 0:
            raise InvalidArgument(f"region size must be positive, got {size}")
        dev = self._device(cuda.device, cuda.device_uuid)
        key = (dev, bytes(handle))
        assert self._lock is not None
        async with self._lock:  # one open per handle, even for concurrent registrations
            mapping = self._mappings.get(key)
            if mapping is None:
                try:
                    ptr, alloc = await self._run(backend.open_ipc, dev, key[1])
                except CudaError as exc:
                    raise InvalidArgument(
                        f"the CUDA IPC handle cannot be opened on device {dev}: {exc} "
                        "(is the allocating process alive and on this machine?)"
                    ) from None
                mapping = self._mappings[key] = _Mapping(dev, ptr, alloc)
            if mapping.alloc is not None and offset + size > mapping.alloc:
                if mapping.refs == 0:
                    self._unmap(key)
                raise InvalidArgument(
                    f"region [{offset}, {offset + size}) is outside its CUDA allocation "
                    f"of {mapping.alloc} bytes"
                )
            mapping.refs += 1
        ptr = mapping.ptr + offset
        name = f"cuda:{dev}@{ptr:#x}"
        region = table.add(
            lambda rid: GpuRegion(rid, session_id, name, size, label, dev, ptr, partial(self._release, key))
        )
        log.debug(
            "registered GPU region %d (%s, %d bytes) for session %s",
            region.region_id,
            name,
            size,
            session_id[:8],
        )
        return region

    def _device(self, device: int, device_uuid: bytes) -> int:
        if device_uuid and self._uuids:  # (a daemon that cannot read UUIDs goes by the ordinal)
            dev = self._uuids.get(bytes(device_uuid))
            if dev is None:
                raise InvalidArgument(
                    f"no CUDA device with UUID {bytes(device_uuid).hex()} is visible to the daemon "
                    f"({self._devices} device(s)); is the client on this machine, and does the daemon's "
                    "CUDA_VISIBLE_DEVICES include its GPU?"
                )
            return dev
        if not 0 <= device < self._devices:
            raise InvalidArgument(f"cuda_device {device} is not one of the daemon's {self._devices} devices")
        return device

    def _release(self, key: tuple[int, bytes]) -> None:
        mapping = self._mappings.get(key)
        if mapping is not None:
            mapping.refs -= 1
            if mapping.refs <= 0:
                self._unmap(key)

    def _unmap(self, key: tuple[int, bytes]) -> None:
        mapping = self._mappings.pop(key, None)
        if mapping is None or self.backend is None:
            return
        try:
            self.backend.close_ipc(mapping.device, mapping.ptr)
        except CudaError as exc:
            log.warning("closing a CUDA IPC mapping on device %d failed: %s", mapping.device, exc)

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    # -- requests -------------------------------------------------------------------------------------
    async def prepare(
        self,
        kind: TaskKind,
        session_id: str,
        columns: SegmentColumns,
        counts: list[int],
        progress: tuple[int, int, int] | None,
    ) -> GpuPlan:
        """The regions the request names (pinned while the plan is made, perhaps in a worker thread),
        every segment checked, overlapping Load destinations refused; the plan's regions pinned.
        A progress word is a host Load's only: not taken here."""
        assert self.regions is not None and self.off_loop is not None
        table = self.regions
        held = set(table.regions_for(session_id, columns, counts, gpu=True).values())
        table.pin(held)
        try:
            plan = await self.off_loop(len(columns.region_ids), self._plan, kind, session_id, columns, counts)
            table.pin(plan.regions)
        finally:
            table.unpin(held)
        return plan

    def _plan(self, kind: TaskKind, session_id: str, columns: SegmentColumns, counts: list[int]) -> GpuPlan:
        """:meth:`plan` for the request, and overlapping Load destinations refused (thread-safe)."""
        assert self.regions is not None
        plan = self.plan(self.regions, session_id, columns, len(counts), self.max_block_bytes)
        if kind is TaskKind.LOAD:
            check_disjoint(columns, counts)
        return plan

    def plan(
        self, table: RegionTable, session_id: str, columns: SegmentColumns, nblocks: int, max_block_bytes: int
    ) -> GpuPlan:
        """Check every segment of a GPU request up front (nothing is copied for a bad request)."""
        segs_by_block, used = table.segments(session_id, columns, nblocks, max_block_bytes, gpu=True)
        blocks: list[DeviceBlock] = []
        for b, segs in enumerate(segs_by_block):
            devices = list(dict.fromkeys(region.device for region, _, _ in segs))  # in request order
            if len(devices) > 1:
                raise InvalidArgument(
                    f"block {b}: segments on devices {devices[0]} and {devices[1]}; "
                    "a block lives on one device"
                )
            blocks.append(
                DeviceBlock(devices[0], tuple((r.ptr + o, n) for r, o, n in segs), sum(n for _, _, n in segs))
            )
        return GpuPlan(blocks, used)

    async def run(
        self, task: Task, keys: Sequence[BlockKey], plan: Plan, durable: bool, settle: Settle
    ) -> None:
        """Copy a task's blocks chunk by chunk, keeping up to QUEUE_DEPTH chunks queued on the device;
        each chunk's outcome is told to ``settle`` once its copies completed."""
        assert isinstance(plan, GpuPlan)
        load = task.kind is TaskKind.LOAD
        queued: deque[_Flight] = deque()
        try:
            for start, stop in chunk_bounds(block.nbytes for block in plan.blocks):
                if task.cancel_requested:
                    break
                queued.append(await self._issue(load, start, keys[start:stop], plan.blocks[start:stop]))
                if len(queued) >= QUEUE_DEPTH:
                    await self._finish(task, load, queued.popleft(), durable, settle)
        finally:
            while queued:  # also on errors: never leave copies running into client memory
                await self._finish(task, load, queued.popleft(), durable, settle)

    # -- copies ---------------------------------------------------------------------------------------
    def _stream(self, device: int) -> int:
        if device not in self._next:
            assert self.backend is not None
            streams = [self.backend.create_stream(device) for _ in range(self.streams_per_device)]
            self._streams[device] = streams
            self._next[device] = itertools.cycle(streams)
        return next(self._next[device])

    async def _issue(
        self, load: bool, start: int, keys: Sequence[BlockKey], blocks: Sequence[DeviceBlock]
    ) -> _Flight:
        """Take Cache pages (leases or reservations) for a chunk and queue its copies."""
        backend, pool = self.backend, self._pool
        assert backend is not None and pool is not None
        flight = _Flight(start, keys, blocks, [None] * len(keys))
        pieces: dict[int, list[Piece]] = {}
        try:
            cache = self.cache
            staged: list[int] = []
            for j, (key, block) in enumerate(zip(keys, blocks, strict=True)):
                if cache is None:
                    staged.append(j)
                elif load:
                    lease = cache.lease_for_read(key)
                    if lease is None:
                        staged.append(j)  # not cached: read from the lower tiers below
                        continue
                    if lease.size != block.nbytes:
                        lease.release()
                        flight.results[j] = failed(
                            f"length mismatch: block is {lease.size} bytes, destination {block.nbytes}"
                        )
                        continue
                    flight.leases.append(lease)
                    runs = cache.host_runs(lease)
                    pieces.setdefault(block.device, []).extend(pair_runs(block.segments, runs))
                else:
                    reservation = cache.reserve(key, block.nbytes)
                    if reservation is None:
                        staged.append(j)  # the Cache is full of blocks in use: bounce buffer
                        continue
                    flight.reservations.append((j, reservation))
                    runs = cache.host_runs(reservation)
                    pieces.setdefault(block.device, []).extend(pair_runs(runs, block.segments))
            if staged:
                flight.pinned = pinned = await pool.take(sum(blocks[j].nbytes for j in staged), self._run)
                offset = 0
                for j in staged:
                    flight.staged.append((j, offset))
                    offset += blocks[j].nbytes
                if load:
                    items = [(keys[j], [pinned.view[o : o + blocks[j].nbytes]]) for j, o in flight.staged]
                    got = await self.pipeline.read_many(items, owned=True)  # the pinned pool is ours
                    for (j, o), r in zip(flight.staged, got, strict=True):
                        if r.ok:
                            runs = [(pinned.ptr + o, blocks[j].nbytes)]
                            device_pieces = pieces.setdefault(blocks[j].device, [])
                            device_pieces.extend(pair_runs(blocks[j].segments, runs))
                        else:
                            flight.results[j] = r
                else:
                    for j, o in flight.staged:
                        runs = [(pinned.ptr + o, blocks[j].nbytes)]
                        pieces.setdefault(blocks[j].device, []).extend(pair_runs(runs, blocks[j].segments))
            for device, device_pieces in pieces.items():
                try:
                    stream = self._stream(device)
                    event = await self._run(backend.copy_async, device, stream, device_pieces, load)
                except CudaError as exc:
                    flight.error = str(exc)
                    break
                flight.events.append((device, event))
        except BaseException:
            await self._wait(flight)
            self._drop(flight)
            raise
        return flight

    async def _wait(self, flight: _Flight) -> None:
        assert self.backend is not None
        events, flight.events = flight.events, []
        for device, event in events:
            try:
                await self._run(self.backend.wait, device, event)
            except CudaError as exc:
                flight.error = flight.error or str(exc)

    def _drop(self, flight: _Flight) -> None:
        """Release everything a chunk holds (after its copies have completed)."""
        for lease in flight.leases:
            lease.release()
        flight.leases.clear()
        if self.cache is not None:
            for _, reservation in flight.reservations:
                self.cache.abort(reservation)
        flight.reservations.clear()
        if flight.pinned is not None and self._pool is not None:
            self._pool.give(flight.pinned)
        flight.pinned = None

    async def _finish(self, task: Task, load: bool, flight: _Flight, durable: bool, settle: Settle) -> None:
        """Wait for a chunk's copies, publish what a dump wrote, record every block's outcome and
        tell it to ``settle``."""
        await self._wait(flight)
        try:
            if flight.error:
                for _, reservation in flight.reservations:
                    assert self.cache is not None
                    self.cache.abort(reservation)
                flight.reservations.clear()
                reason = failed(f"CUDA copy failed: {flight.error}")
                flight.results = [r or reason for r in flight.results]
            elif not load:
                await self._publish(flight, durable)
            results = [r or OK for r in flight.results]
            sizes = [block.nbytes for block in flight.blocks]
            for j, r in enumerate(results):
                task.record(flight.start + j, r, sizes[j])
        finally:
            self._drop(flight)
        await settle(task.kind, flight.keys, sizes, results)

    async def _publish(self, flight: _Flight, durable: bool) -> None:
        """A dump's copies are complete: make its blocks visible and send them down the pipeline."""
        committed: list[int] = []
        if flight.reservations:
            assert self.cache is not None
            for j, reservation in flight.reservations:
                self.cache.commit(reservation)
                committed.append(j)
            flight.reservations.clear()
            results = await self.pipeline.flow_down([flight.keys[j] for j in committed], durable=durable)
            for j, r in zip(committed, results, strict=True):
                flight.results[j] = r
        if flight.staged:
            pinned = flight.pinned
            assert pinned is not None
            items = [
                (flight.keys[j], [pinned.view[o : o + flight.blocks[j].nbytes]]) for j, o in flight.staged
            ]
            results = await self.pipeline.write_many(items, durable=durable, owned=True)
            for (j, _), r in zip(flight.staged, results, strict=True):
                flight.results[j] = r
