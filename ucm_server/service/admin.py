"""The Admin servicer: what ``ucm-admin`` and operators call. Thin, like the KVStore one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from grpc import aio

from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.engine import Engine
from ucm_server.retention import PLAIN, Rule
from ucm_server.snapshot import TierFigures
from ucm_server.store.base import BlockInfo


def block_info(info: BlockInfo, tiers: list[str], rule: Rule = PLAIN) -> pb.BlockInfo:
    return pb.BlockInfo(
        retention=pb.Retention(pinned=rule.pinned, expires_at=rule.expires_at, priority=rule.priority),
        namespace=info.key.namespace,
        key=info.key.digest,
        size=info.size,
        tiers=tiers,
        stored_at=info.stored_at,
        checksum=info.checksum or 0,
        has_checksum=info.checksum is not None,
    )


def tier_stats(tier: TierFigures) -> pb.TierStats:
    s = tier.stats
    return pb.TierStats(
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
        persistent=tier.persistent,
        shared=tier.shared,
        extra=s.extra,
    )


class AdminServicer(rpc.AdminServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Stats(self, request: pb.StatsRequest, context: aio.ServicerContext) -> pb.StatsResponse:
        snap = self.engine.snapshot()
        now = time.time()
        tiers = [tier_stats(tier) for tier in snap.tiers]
        if tiers and snap.writeback.max_bytes:  # the write-back queue drains the top tier's blocks
            tiers[0].extra.update(snap.writeback.as_extra())
        if tiers:  # whether the daemon keeps up with dumps, and what its door admits
            tiers[0].extra["store_saturated"] = float(snap.store_saturated)
            tiers[0].extra.update(snap.door_admission)
        return pb.StatsResponse(
            version=snap.version,
            uptime_s=snap.uptime_s,
            tiers=tiers,
            sessions=snap.sessions,
            regions=snap.regions,
            region_bytes=snap.region_bytes,
            tasks_running=snap.tasks_running,
            tasks_queued=snap.tasks_queued,
            lookups=snap.lookups,
            lookup_keys=snap.lookup_keys,
            lookup_hits=snap.lookup_hits,
            pending_writeback=snap.pending_writeback,
            store_pipeline=snap.store_pipeline,
            pinned_blocks=snap.pinned_blocks,
            retention_rules=snap.retention_rules,
            expired_blocks=snap.expired_blocks,
            session_list=[
                pb.SessionInfo(
                    client_name=s.client_name, pid=s.pid, tenant=s.tenant, age_s=now - s.attached_at
                )
                for s in self.engine.session_list()
            ],
        )

    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        page, token, total = await self.engine.list_blocks(
            request.namespace, request.tier, request.page_size, request.page_token
        )
        return pb.ListBlocksResponse(
            blocks=[block_info(info, tiers, rule) for info, tiers, rule in page],
            next_page_token=token,
            total=total,
        )

    async def Inspect(self, request: pb.InspectRequest, context: aio.ServicerContext) -> pb.InspectResponse:
        info, tiers, rule = await self.engine.inspect(request.namespace, request.key)
        return pb.InspectResponse(block=block_info(info, tiers, rule))

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
