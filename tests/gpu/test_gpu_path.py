"""The daemon's GPU data path end to end in-process, on a fake CUDA backend (no GPU needed).

Everything above ``CudaBackend`` runs for real: IPC regions in the region table, the pinned Cache arena,
leases and reservations, the bounce buffer for blocks the Cache does not hold, chunked copies with
events, write-back to Posix, per-block status, errors and cleanup. The fake moves bytes only when an
event is waited for, so a block reported before its copy completed would come back wrong.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import FakeCuda

from ucm_client import key_digest, namespace_id
from ucm_protocol.errors import FailedPrecondition, InvalidArgument
from ucm_protocol.fdpass import PeerCredentials
from ucm_server.config import ServerConfig
from ucm_server.engine import Engine
from ucm_server.gpu.backend import GpuUnavailable
from ucm_server.gpu.service import pair_runs
from ucm_server.store.base import BlockState
from ucm_server.store.cache import CacheTier
from ucm_server.tasks import Task, TaskKind

NS = namespace_id(model="gpu-test", dtype="uint8")
BLOCK = 256 << 10


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))  # type: ignore[arg-type]


@asynccontextmanager
async def gpu_engine(
    tmp_path: Path,
    *,
    pipeline: str = "Cache|Posix",
    cache: int = 64 << 20,
    fake: FakeCuda | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[Engine, FakeCuda]]:
    config = ServerConfig(
        socket=tmp_path / "ucm.sock",
        data_dir=tmp_path / "data",
        store_pipeline=pipeline,
        cache_capacity=cache,
        durable=False,
        metrics_address="off",
        **kw,
    ).validate()
    engine = Engine(config)
    backend = fake or FakeCuda()
    engine.gpu.backend_factory = lambda: backend
    await engine.open()
    try:
        yield engine, backend
    finally:
        await engine.close()


class Device:
    """A fake device allocation registered as a GPU region of one session."""

    def __init__(self, size: int) -> None:
        self.handle, self.mem = FakeCuda.allocate(size)
        self.size = size
        self.region = 0

    @property
    def view(self) -> memoryview:
        return memoryview(self.mem).cast("B")

    async def register(self, engine: Engine, sid: str, *, offset: int = 0, size: int | None = None) -> int:
        region = await engine.register_cuda_region(
            sid,
            handle=self.handle,
            offset=offset,
            size=size if size is not None else self.size - offset,
            device=0,
            device_uuid=engine.gpu.backend.device_uuid(0) if engine.gpu.backend else b"",
            label="kv",
        )
        self.region = region.region_id
        return self.region


def keys(n: int, tag: str = "b") -> list[bytes]:
    return [key_digest(tag, i) for i in range(n)]


async def io(
    engine: Engine,
    kind: TaskKind,
    sid: str,
    digests: list[bytes],
    region: int,
    *,
    size: int = BLOCK,
    first: int = 0,
    durable: bool = False,
) -> Task:
    n = len(digests)
    task = await engine.submit_io(
        kind,
        sid,
        NS,
        digests,
        [],
        [region] * n,
        [(first + i) * size for i in range(n)],
        [size] * n,
        durable=durable,
    )
    await asyncio.wait_for(task.done.wait(), 30)
    return task


def states(task: Task) -> list[BlockState]:
    return [BlockState(s) for s in task.states]


def test_round_trip_through_the_pinned_cache(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 48
            src, dst = Device(n * BLOCK), Device(n * BLOCK)
            src.view[:] = os.urandom(n * BLOCK)
            await src.register(engine, sid)
            await dst.register(engine, sid)
            cache = engine.pipeline.top
            assert isinstance(cache, CacheTier) and cache.arena.pinned
            assert fake.registered == {cache.arena.address: cache.arena.capacity}

            dump = await io(engine, TaskKind.DUMP, sid, keys(n), src.region)
            assert states(dump) == [BlockState.OK] * n, dump.reasons
            assert dump.bytes_done == n * BLOCK
            load = await io(engine, TaskKind.LOAD, sid, keys(n), dst.region)
            assert states(load) == [BlockState.OK] * n, load.reasons
            assert bytes(dst.view) == bytes(src.view)
            # Straight between device and arena pages: no bounce buffer was needed either way.
            assert fake.pinned == {} and fake.d2h_bytes == fake.h2d_bytes == n * BLOCK
            assert fake.outstanding == 0
            # Write-back took the blocks to Posix too.
            await engine.pipeline.drain()
            posix = engine.pipeline.tiers[1]
            assert await posix.lookup(engine.keys(NS, keys(n))) == [BLOCK] * n

    run(body)


def test_blocks_missing_from_the_cache_come_from_posix_through_a_bounce_buffer(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 16
            src, dst = Device(n * BLOCK), Device((n + 1) * BLOCK)
            src.view[:] = os.urandom(n * BLOCK)
            await src.register(engine, sid)
            await dst.register(engine, sid)
            assert (
                states(await io(engine, TaskKind.DUMP, sid, keys(n), src.region, durable=True))
                == [BlockState.OK] * n
            )
            await engine.evict("Cache", 0, b"", [], True)
            load = await io(engine, TaskKind.LOAD, sid, [*keys(n), key_digest("absent")], dst.region)
            assert states(load) == [BlockState.OK] * n + [BlockState.MISSING]
            assert bytes(dst.view[: n * BLOCK]) == bytes(src.view[: n * BLOCK])
            assert fake.pinned, "the bounce buffer is pinned host memory"
            # The read promoted the blocks: the next load is served from the arena.
            h2d = fake.h2d_bytes
            dst.view[:] = b"\0" * dst.size
            assert states(await io(engine, TaskKind.LOAD, sid, keys(n), dst.region)) == [BlockState.OK] * n
            assert bytes(dst.view[: n * BLOCK]) == bytes(src.view[: n * BLOCK])
            assert fake.h2d_bytes == h2d + n * BLOCK

    run(body)


def test_dump_larger_than_the_cache_goes_down_through_the_bounce_buffer(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path, cache=128 << 10) as (engine, _fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 4
            src, dst = Device(n * BLOCK), Device(n * BLOCK)
            src.view[:] = os.urandom(n * BLOCK)
            await src.register(engine, sid)
            await dst.register(engine, sid)
            dump = await io(engine, TaskKind.DUMP, sid, keys(n), src.region)
            assert states(dump) == [BlockState.OK] * n, dump.reasons
            load = await io(engine, TaskKind.LOAD, sid, keys(n), dst.region)
            assert states(load) == [BlockState.OK] * n, load.reasons
            assert bytes(dst.view) == bytes(src.view)

    run(body)


def test_cache_only_pipeline_and_many_chunks(tmp_path: Path) -> None:
    """More than one chunk (256 blocks), so a chunk is queued while the previous one completes."""

    async def body() -> None:
        async with gpu_engine(tmp_path, pipeline="Cache", cache=64 << 20) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n, size = 600, 16 << 10
            src, dst = Device(n * size), Device(n * size)
            src.view[:] = os.urandom(n * size)
            await src.register(engine, sid)
            await dst.register(engine, sid)
            assert (
                states(await io(engine, TaskKind.DUMP, sid, keys(n), src.region, size=size))
                == [BlockState.OK] * n
            )
            assert (
                states(await io(engine, TaskKind.LOAD, sid, keys(n), dst.region, size=size))
                == [BlockState.OK] * n
            )
            assert bytes(dst.view) == bytes(src.view)
            assert fake.outstanding == 0

    run(body)


def test_multi_segment_blocks_scatter_across_layers(tmp_path: Path) -> None:
    """A block made of one page per layer, loaded back into another layout of the same total size."""

    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, _fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            layers, page, nblocks = 3, 10_000, 4
            kv = Device(layers * nblocks * page)
            kv.view[:] = os.urandom(kv.size)
            flat = Device(nblocks * layers * page + 7)
            rk = await kv.register(engine, sid)
            rf = await flat.register(engine, sid)
            digests = keys(nblocks, "layers")
            task = await engine.submit_io(
                TaskKind.DUMP,
                sid,
                NS,
                digests,
                [layers] * nblocks,
                [rk] * (layers * nblocks),
                [layer * nblocks * page + b * page for b in range(nblocks) for layer in range(layers)],
                [page] * (layers * nblocks),
            )
            await task.done.wait()
            assert states(task) == [BlockState.OK] * nblocks, task.reasons
            load = await engine.submit_io(
                TaskKind.LOAD,
                sid,
                NS,
                digests,
                [],
                [rf] * nblocks,
                [7 + b * layers * page for b in range(nblocks)],
                [layers * page] * nblocks,
            )
            await load.done.wait()
            assert states(load) == [BlockState.OK] * nblocks, load.reasons
            for b in range(nblocks):
                expected = b"".join(
                    bytes(kv.view[layer * nblocks * page + b * page :][:page]) for layer in range(layers)
                )
                assert bytes(flat.view[7 + b * layers * page :][: layers * page]) == expected

    run(body)


def test_a_failed_copy_fails_its_blocks_and_gives_the_pages_back(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 8
            src = Device(n * BLOCK)
            await src.register(engine, sid)
            cache = engine.pipeline.top
            assert isinstance(cache, CacheTier)
            free = cache.arena.free_pages
            fake.fail_wait = "cudaErrorIllegalAddress: an illegal memory access was encountered"
            dump = await io(engine, TaskKind.DUMP, sid, keys(n), src.region)
            assert states(dump) == [BlockState.FAILED] * n
            assert "illegal memory access" in dump.reasons[0]
            assert cache.arena.free_pages == free and cache.stats().blocks == 0
            fake.fail_copy = "cudaErrorInvalidValue: invalid argument"
            assert (
                states(await io(engine, TaskKind.DUMP, sid, keys(n), src.region)) == [BlockState.FAILED] * n
            )
            assert cache.arena.free_pages == free
            # The next dump works, and a failed load leaves the cached blocks leasable.
            assert states(await io(engine, TaskKind.DUMP, sid, keys(n), src.region)) == [BlockState.OK] * n
            fake.fail_wait = "cudaErrorLaunchFailure"
            assert (
                states(await io(engine, TaskKind.LOAD, sid, keys(n), src.region)) == [BlockState.FAILED] * n
            )
            await engine.pipeline.drain()
            assert cache.stats().extra["leased_blocks"] == 0
            assert fake.outstanding == 0

    run(body)


def test_cancel_returns_only_after_the_queued_copies_completed(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path, pipeline="Cache", cache=256 << 20) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n, size = 2000, 64 << 10
            dev = Device(n * size)
            rid = await dev.register(engine, sid)
            offsets = [i * size for i in range(n)]
            task = await engine.submit_io(TaskKind.DUMP, sid, NS, keys(n), [], [rid] * n, offsets, [size] * n)
            await asyncio.sleep(0)
            await engine.tasks.cancel(task)
            assert fake.outstanding == 0  # nothing still copying into or out of client memory
            done = states(task)
            assert BlockState.PENDING not in done
            cache = engine.pipeline.top
            assert isinstance(cache, CacheTier)
            assert cache.stats().blocks == done.count(BlockState.OK)

    run(body)


def test_regions_share_one_mapping_and_session_end_closes_it(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            dev = Device(4 * BLOCK)
            await dev.register(engine, sid, offset=0, size=2 * BLOCK)
            await dev.register(engine, sid, offset=2 * BLOCK, size=2 * BLOCK)  # same allocation
            assert fake.opens == 1 and len(fake.opened) == 1 and engine.gpu.open_mappings == 1
            assert len(engine.regions) == 2
            await engine.detach(sid)
            assert fake.opened == {} and engine.gpu.open_mappings == 0 and len(engine.regions) == 0

    run(body)


def test_unregister_waits_for_a_running_copy(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 32
            dev = Device(n * BLOCK)
            rid = await dev.register(engine, sid)
            task = await engine.submit_io(
                TaskKind.DUMP, sid, NS, keys(n), [], [rid] * n, [i * BLOCK for i in range(n)], [BLOCK] * n
            )
            engine.unregister_region(sid, rid)  # the region is pinned by the task: closed after it
            await task.done.wait()
            assert states(task) == [BlockState.OK] * n
            assert fake.opened == {}

    run(body)


def test_bad_gpu_requests_are_refused_up_front(tmp_path: Path) -> None:
    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            dev = Device(4 * BLOCK)
            rid = await dev.register(engine, sid)
            with pytest.raises(InvalidArgument, match="outside region"):
                await engine.submit_io(TaskKind.LOAD, sid, NS, keys(1), [], [rid], [4 * BLOCK - 10], [20])
            with pytest.raises(InvalidArgument, match="outside its CUDA allocation"):
                await dev.register(engine, sid, offset=BLOCK, size=4 * BLOCK)
            with pytest.raises(InvalidArgument, match="64 bytes"):
                await engine.register_cuda_region(
                    sid, handle=b"short", offset=0, size=10, device=0, device_uuid=b"", label=""
                )
            with pytest.raises(InvalidArgument, match="no CUDA device with UUID"):
                await engine.register_cuda_region(
                    sid, handle=dev.handle, offset=0, size=10, device=0, device_uuid=b"x" * 16, label=""
                )
            with pytest.raises(InvalidArgument, match="cannot be opened"):
                await engine.register_cuda_region(
                    sid, handle=b"\1" * 64, offset=0, size=10, device=0, device_uuid=b"", label=""
                )
            # Mixing host and GPU regions in one request is refused, whichever comes first.
            from ucm_client import SharedBuffer

            with SharedBuffer(BLOCK) as shm:
                peer = PeerCredentials(os.getpid(), os.getuid(), os.getgid())  # as the fd socket would see us
                token = engine.handovers.add(os.dup(shm.fileno()), shm.size, peer)
                host = engine.register_region(sid, token, shm.size, "host").region_id
                with pytest.raises(InvalidArgument, match="cannot mix host and GPU"):
                    await engine.submit_io(
                        TaskKind.DUMP, sid, NS, keys(2), [], [rid, host], [0, 0], [BLOCK, BLOCK]
                    )
                with pytest.raises(InvalidArgument, match="cannot mix host and GPU"):
                    await engine.submit_io(
                        TaskKind.DUMP, sid, NS, keys(2), [], [host, rid], [0, 0], [BLOCK, BLOCK]
                    )
                # Host regions keep working beside GPU ones.
                shm.buf[:] = os.urandom(BLOCK)
                host_task = await engine.submit_io(
                    TaskKind.DUMP, sid, NS, keys(1, "h"), [], [host], [0], [BLOCK]
                )
                await host_task.done.wait()
                assert states(host_task) == [BlockState.OK]
                engine.unregister_region(sid, host)
            assert fake.outstanding == 0

    run(body)


def test_without_cupy_gpu_regions_are_refused_with_the_reason(tmp_path: Path) -> None:
    """The real backend loader on this machine (no cupy, or no device): FAILED_PRECONDITION, host IO fine."""
    pytest.importorskip("ucm_server.gpu.backend")
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy is installed here; the refusal path needs a machine without it")
    except ImportError:
        pass

    async def body() -> None:
        config = ServerConfig(
            socket=tmp_path / "ucm.sock", data_dir=tmp_path / "data", durable=False, metrics_address="off"
        ).validate()
        engine = Engine(config)
        await engine.open()
        try:
            sid = engine.attach("gpu", os.getpid()).session_id
            for _ in range(2):  # the reason is remembered; the second refusal is as clear
                with pytest.raises(GpuUnavailable, match="cupy is not installed") as info:
                    await engine.register_cuda_region(
                        sid, handle=b"\0" * 64, offset=0, size=4096, device=0, device_uuid=b"", label=""
                    )
                assert isinstance(info.value, FailedPrecondition)
            assert "cupy" in engine.gpu.status
        finally:
            await engine.close()

    run(body)


def test_gpu_off_refuses_and_gpu_on_needs_a_backend(tmp_path: Path) -> None:
    async def off() -> None:
        async with gpu_engine(tmp_path / "off", gpu="off") as (engine, fake):
            sid = engine.attach("gpu", os.getpid()).session_id
            with pytest.raises(GpuUnavailable, match=r"gpu: off"):
                await Device(BLOCK).register(engine, sid)
            assert fake.registered == {}

    async def on() -> None:
        async with gpu_engine(tmp_path / "on", gpu="on") as (engine, fake):
            cache = engine.pipeline.top
            assert isinstance(cache, CacheTier)
            assert fake.registered == {cache.arena.address: cache.arena.capacity}  # pinned at start
        assert fake.registered == {}  # and unpinned at close

    run(off)
    run(on)


def test_pair_runs_splits_and_merges() -> None:
    assert pair_runs([(100, 10)], [(0, 4), (4, 6)]) == [(100, 0, 10)]  # contiguous source: one copy
    assert pair_runs([(100, 5), (200, 5)], [(0, 10)]) == [(100, 0, 5), (200, 5, 5)]
    assert pair_runs([(100, 3), (103, 3)], [(0, 2), (50, 4)]) == [(100, 0, 2), (102, 50, 4)]
    assert pair_runs([], []) == []
    assert ctypes.sizeof(ctypes.c_char * 1) == 1


def test_gpu_dumps_count_against_the_tenant_quota(tmp_path: Path) -> None:
    from ucm_server.auth import Principal, current_principal
    from ucm_server.tenants import TenantLedger

    async def body() -> None:
        async with gpu_engine(tmp_path) as (engine, _fake):
            engine.ledger = TenantLedger(tmp_path / "tenants.json", {"acme": 4 * BLOCK})
            current_principal.set(Principal(tenant="acme", admin=False, quota=4 * BLOCK))
            sid = engine.attach("gpu", os.getpid()).session_id
            n = 8
            src = Device(n * BLOCK)
            await src.register(engine, sid)
            assert states(await io(engine, TaskKind.DUMP, sid, keys(n), src.region)) == [BlockState.OK] * n
            answer = await engine.lookup(NS, keys(n))
            assert answer.present == bytes([0] * 4 + [1] * 4)  # the oldest went to make room
            assert engine.ledger.usage("acme") == 4 * BLOCK

    run(body)
