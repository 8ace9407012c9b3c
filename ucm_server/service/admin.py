"""The Admin servicer: what ``ucm-admin`` and operators call. Thin, like the KVStore one."""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpc import aio

from ucm_server.api.ucm.v1 import ucm_pb2 as pb
from ucm_server.api.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.engine import Engine
from ucm_server.store.base import BlockInfo


def block_info(info: BlockInfo, tiers: list[str]) -> pb.BlockInfo:
    return pb.BlockInfo(
        namespace=info.key.namespace,
        key=info.key.digest,
        size=info.size,
        tiers=tiers,
        stored_at=info.stored_at,
        checksum=info.checksum or 0,
        has_checksum=info.checksum is not None,
    )


class AdminServicer(rpc.AdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Stats(self, request: pb.StatsRequest, context: aio.ServicerContext) -> pb.StatsResponse:
        e = self.engine
        tiers = [
            pb.TierStats(
                name=s.name,
                kind=s.kind,
                blocks=s.blocks,
                bytes=s.bytes,
                capacity_bytes=s.capacity_bytes,
                hits=s.hits,
                misses=s.misses,
                evictions=s.evictions,
                read_bytes=s.read_bytes,
                write_bytes=s.write_bytes,
                errors=s.errors,
                corrupt=s.corrupt,
                persistent=persistent,
                shared=shared,
                extra=s.extra,
            )
            for s, persistent, shared in e.tier_stats()
        ]
        return pb.StatsResponse(
            version=e.version,
            uptime_s=e.uptime_s,
            tiers=tiers,
            sessions=len(e.sessions),
            regions=len(e.regions),
            region_bytes=e.regions.total_bytes,
            tasks_running=e.tasks.running - e.tasks.queued,
            tasks_queued=e.tasks.queued,
            lookups=e.lookups,
            lookup_keys=e.lookup_keys,
            lookup_hits=e.lookup_hits,
            pending_writeback=e.pipeline.pending_writeback,
            store_pipeline=e.pipeline.spec,
        )

    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        page, token, total = await self.engine.list_blocks(
            request.namespace, request.tier, request.page_size, request.page_token
        )
        return pb.ListBlocksResponse(
            blocks=[block_info(info, tiers) for info, tiers in page], next_page_token=token, total=total
        )

    async def Inspect(self, request: pb.InspectRequest, context: aio.ServicerContext) -> pb.InspectResponse:
        info, tiers = await self.engine.inspect(request.namespace, request.key)
        return pb.InspectResponse(block=block_info(info, tiers))

    async def Evict(self, request: pb.EvictRequest, context: aio.ServicerContext) -> pb.EvictResponse:
        blocks, nbytes = await self.engine.evict(
            request.tier, request.min_bytes, request.namespace, request.keys, request.all
        )
        return pb.EvictResponse(blocks=blocks, bytes=nbytes)

    async def Verify(
        self, request: pb.VerifyRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.VerifyProgress]:
        corrupt = 0
        checked = total = 0
        progress = self.engine.verify(request.tier, request.namespace, request.quarantine)
        async for checked, total, bad in progress:
            corrupt += len(bad)
            yield pb.VerifyProgress(checked=checked, total=total, corrupt=corrupt, corrupt_keys=bad)
        yield pb.VerifyProgress(checked=checked, total=total, corrupt=corrupt, done=True)
