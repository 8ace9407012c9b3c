"""The KVStore servicer: protobuf in, :class:`~ucm_server.engine.Engine` calls, protobuf out.

Nothing here decides anything; validation and errors come from the engine, and the interceptor maps
them to status codes. Calls that touch client memory or tasks name their session in the
``ucm-session`` metadata entry; the session itself lives exactly as long as the client's ``Attach``
stream, which is how a client that dies releases its regions without any cooperation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from grpc import aio

from ucm_protocol.errors import InvalidArgument, PermissionDenied
from ucm_protocol.keys import PackedDigests
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_protocol.wire import SESSION_METADATA
from ucm_server.engine import Engine
from ucm_server.retention import Change
from ucm_server.store.admitting import cache_only
from ucm_server.tasks import Task, TaskKind


def session_of(context: aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA:
            return str(value)
    return None


def task_status(task: Task) -> pb.TaskStatus:
    return pb.TaskStatus(
        task_id=task.task_id,
        kind=int(task.kind),  # type: ignore[arg-type]  # our enums mirror the proto's values
        state=int(task.state),  # type: ignore[arg-type]
        block_status=list(task.states),  # type: ignore[arg-type]
        reasons=task.reasons,
        bytes_done=task.bytes_done,
        elapsed_s=task.elapsed_s,
    )


class KVStoreServicer(rpc.KVStoreServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Attach(
        self, request: pb.AttachRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        session = self.engine.attach(
            request.client_name, request.pid, task_events=request.task_events, peer=context.peer() or ""
        )
        interval = self.engine.heartbeat_interval_s
        try:
            yield pb.SessionEvent(
                session_id=session.session_id,
                heartbeat_interval_s=interval,
                server_version=self.engine.version,
                store_saturated=self.engine.store_saturated,
            )
            while True:  # a heartbeat every interval, or sooner with the statuses of tasks that ended
                finished, stopped = await self.engine.session_events(session.session_id)
                yield pb.SessionEvent(
                    session_id=session.session_id,
                    heartbeat_interval_s=interval,
                    finished=[task_status(task) for task in finished],
                    task_events_stopped=stopped,
                    store_saturated=self.engine.store_saturated,
                )
        finally:
            # Runs when the client closes the stream, dies (socket closed) or the server stops.
            await asyncio.shield(self.engine.detach(session.session_id))

    async def RegisterRegion(
        self, request: pb.RegisterRegionRequest, context: aio.ServicerContext
    ) -> pb.RegisterRegionResponse:
        if request.cuda_ipc_handle:  # GPU memory shared by CUDA IPC (ucm_server.gpu)
            gpu = await self.engine.register_cuda_region(
                session_of(context),
                handle=request.cuda_ipc_handle,
                offset=request.cuda_offset,
                size=request.size,
                device=request.cuda_device,
                device_uuid=request.cuda_device_uuid,
                label=request.label,
            )
            return pb.RegisterRegionResponse(region_id=gpu.region_id)
        if request.shm_name:
            raise PermissionDenied(
                "registration by name is not accepted (shm_name); hand the memory over as a sealed "
                "memfd through the client library (ucm_client.SharedBuffer)"
            )
        if not request.memfd_token:
            raise InvalidArgument(
                "RegisterRegion needs memfd_token (host memory handed over on the daemon's fd socket) "
                "or cuda_ipc_handle (GPU memory)"
            )
        region = self.engine.register_region(
            session_of(context), request.memfd_token, request.size, request.label
        )
        return pb.RegisterRegionResponse(region_id=region.region_id)

    async def UnregisterRegion(
        self, request: pb.UnregisterRegionRequest, context: aio.ServicerContext
    ) -> pb.UnregisterRegionResponse:
        await self.engine.release_region(session_of(context), request.region_id)
        return pb.UnregisterRegionResponse()

    async def Lookup(self, request: pb.LookupRequest, context: aio.ServicerContext) -> pb.LookupResponse:
        packed = request.packed_keys  # read once: each read of a bytes field is a copy
        if packed:
            if request.keys:
                raise InvalidArgument("send keys or packed_keys, not both")
            answer = await self.engine.lookup(request.namespace, PackedDigests(packed), checked=True)
            return pb.LookupResponse(present_bytes=answer.present, hit_prefix=answer.hit_prefix)
        answer = await self.engine.lookup(request.namespace, list(request.keys))
        return pb.LookupResponse(present=list(map(bool, answer.present)), hit_prefix=answer.hit_prefix)

    async def _submit(
        self,
        kind: TaskKind,
        batch: pb.BlockBatch,
        context: aio.ServicerContext,
        durable: bool = False,
        progress: pb.Segment | None = None,
    ) -> pb.TaskHandle:
        task = await self.engine.submit_io(
            kind,
            session_of(context),
            batch.namespace,
            batch.keys,
            list(batch.segment_counts),
            list(batch.region_ids),
            list(batch.offsets),
            list(batch.lengths),
            durable=durable,
            progress=(progress.region_id, progress.offset, progress.length) if progress is not None else None,
        )
        return pb.TaskHandle(
            task_id=task.task_id,
            progress=task.reports_progress,
            store_saturated=self.engine.poll_store_saturated(),
        )

    async def Load(self, request: pb.LoadRequest, context: aio.ServicerContext) -> pb.TaskHandle:
        progress = request.progress if request.HasField("progress") else None
        return await self._submit(TaskKind.LOAD, request.blocks, context, progress=progress)

    async def Dump(self, request: pb.DumpRequest, context: aio.ServicerContext) -> pb.TaskHandle:
        token = cache_only.set(request.cache_only)  # read by the pipeline in the task this call starts
        try:
            return await self._submit(TaskKind.DUMP, request.blocks, context, durable=request.wait_durable)
        finally:
            cache_only.reset(token)

    async def Prefetch(self, request: pb.PrefetchRequest, context: aio.ServicerContext) -> pb.TaskHandle:
        task = self.engine.submit_prefetch(session_of(context), request.namespace, request.keys)
        return pb.TaskHandle(task_id=task.task_id)

    async def Wait(self, request: pb.WaitRequest, context: aio.ServicerContext) -> pb.TaskStatus:
        task = await self.engine.wait(
            session_of(context), request.task_id, request.timeout_s, request.cancel_on_timeout
        )
        return task_status(task)

    async def Check(self, request: pb.TaskHandle, context: aio.ServicerContext) -> pb.TaskStatus:
        return task_status(self.engine.task(session_of(context), request.task_id))

    async def Cancel(self, request: pb.CancelRequest, context: aio.ServicerContext) -> pb.TaskStatus:
        return task_status(await self.engine.cancel(session_of(context), request.task_id))

    async def Delete(self, request: pb.DeleteRequest, context: aio.ServicerContext) -> pb.DeleteResponse:
        return pb.DeleteResponse(deleted=await self.engine.delete(request.namespace, request.keys))

    async def SetRetention(
        self, request: pb.SetRetentionRequest, context: aio.ServicerContext
    ) -> pb.SetRetentionResponse:
        answer = await self.engine.set_retention(
            request.namespace,
            request.keys,
            retention_change(request),
            require_all_tiers=request.require_all_tiers,
        )
        return pb.SetRetentionResponse(
            applied=answer.applied, missing=answer.missing, not_enforced=answer.not_enforced
        )

    async def GetBlocks(
        self, request: pb.GetBlocksRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GetBlockReply]:
        async for index, result, data in self.engine.get_bytes(request.namespace, request.keys):
            yield pb.GetBlockReply(
                index=index,
                status=int(result.state),  # type: ignore[arg-type]
                reason=result.reason,
                data=data,
            )

    async def PutBlocks(
        self, request_iterator: AsyncIterator[pb.BlockBytes], context: aio.ServicerContext
    ) -> pb.PutBlocksReply:
        reply = pb.PutBlocksReply()
        index = 0
        async for item in request_iterator:
            r = await self.engine.put_bytes(item.namespace, item.key, item.data)
            reply.block_status.append(int(r.state))  # type: ignore[arg-type]
            if r.reason:
                reply.reasons[index] = r.reason
            index += 1
        return reply


def retention_change(request: pb.SetRetentionRequest) -> Change:
    """The request's change, its contradictions refused with the fields named."""
    if request.pin and request.unpin:
        raise InvalidArgument("pin and unpin in one request: choose one")
    if request.ttl_s and request.clear_ttl:
        raise InvalidArgument("ttl_s and clear_ttl in one request: choose one")
    if request.ttl_s < 0:
        raise InvalidArgument(f"ttl_s must be positive, got {request.ttl_s}")
    return Change(
        pin=True if request.pin else (False if request.unpin else None),
        ttl_s=request.ttl_s if request.ttl_s else (0.0 if request.clear_ttl else None),
        priority=request.priority if request.set_priority else None,
    )
