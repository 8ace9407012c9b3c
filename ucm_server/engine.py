"""The daemon's domain core, behind plain methods: what the gRPC servicers (and tests) call.

The servicers translate protobuf to these calls and back and reach nothing else; each call is handed
to the part whose one job it is, and the engine itself decides nothing about a request:

* :mod:`ucm_server.sessions` — sessions (attach under caps, detach), their memory, their tasks'
  wait (clamped) and cancel;
* :mod:`ucm_server.submit` — the one submit path of Load, Dump and Prefetch, with the movers of
  :mod:`ucm_server.movers` (host memory) and :mod:`ucm_server.gpu.service` (GPU memory);
* :mod:`ucm_server.blocks` — Lookup, Delete, SetRetention, GetBlocks and PutBlocks;
* :mod:`ucm_server.upkeep` — an operator's list, inspect, evict and verify;
* :mod:`ucm_server.authz` (who reaches what), :mod:`ucm_server.quota` (tenants' bytes and pins),
  :mod:`ucm_server.snapshot` (the figures ``Admin.Stats`` and the metrics read).

The engine builds those parts, the store (:func:`ucm_server.store.assembly.assemble`) and the
tenants' keys once, opens and closes them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey
from ucm_protocol.states import BlockState
from ucm_server import __version__, tracing
from ucm_server.auth import Authenticator
from ucm_server.authz import Authorizer
from ucm_server.blocks import BlockLimits, Blocks, LookupAnswer, RetentionAnswer
from ucm_server.config import ServerConfig
from ucm_server.expiry import Expiry
from ucm_server.gpu.backend import GpuUnavailable
from ucm_server.gpu.service import GpuService
from ucm_server.gpu_region import CudaImport, GpuRegion
from ucm_server.handover import HandoverTable
from ucm_server.metrics import Metrics
from ucm_server.movers import HostMover, OffLoop
from ucm_server.pressure import StorePressure
from ucm_server.quota import Quota
from ucm_server.region_prefault import RegionPrefaulter
from ucm_server.regions import Region, RegionTable, SegmentColumns
from ucm_server.reply_budget import ReplyBudget
from ucm_server.retention import FILE_NAME as RETENTION_FILE
from ucm_server.retention import Change, RetentionTable
from ucm_server.sessions import Session, SessionCaps, Sessions
from ucm_server.snapshot import EngineSnapshot, SessionFigures, TierFigures
from ucm_server.store.admitting import cache_only as cache_only_var
from ucm_server.store.assembly import assemble
from ucm_server.store.base import BlockResult, TierStats
from ucm_server.store.io_classes import ClassedExecutor
from ucm_server.store.pipeline import Pipeline
from ucm_server.submit import SegmentCaps, Submitter
from ucm_server.tasks import Task, TaskKind, TaskManager
from ucm_server.tenants import TenantLedger, tenant_keyring
from ucm_server.upkeep import Listed, Upkeep

__all__ = ["Engine", "LookupAnswer", "RetentionAnswer", "Session"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: ServerConfig, authenticator: Authenticator | None = None) -> None:
        self.config = config
        self.executor = ClassedExecutor(  # loads first, background work held for them
            config.io_threads, thread_name_prefix="ucm-io", background_hold_s=config.io_background_hold_s
        )
        tenants = authenticator.tenants if authenticator is not None else {}
        ledger: TenantLedger | None = None
        if authenticator is not None:
            quotas = {t: p.quota for t, p in tenants.items() if t}
            ledger = TenantLedger(config.data_dir / "tenants.json", quotas, self.executor)
        self.authz = Authorizer(authenticator, tcp_anonymous=config.tcp_anonymous, owners=ledger)
        """Who may call what and which namespaces a call reaches (:mod:`ucm_server.authz`)."""
        self.retention = RetentionTable(
            config.data_dir / RETENTION_FILE, self.executor, max_rules=config.max_retention_rules
        )
        key_files = {t: p.key_file for t, p in tenants.items() if t and p.key_file}
        keyring = tenant_keyring(
            config.encrypted_tiers, config.data_dir, key_files, ledger, self.authz.may_open
        )
        self.pipeline: Pipeline = assemble(
            config, self.executor, keyring, self.retention, outermost=tracing.tier_wrapper()
        )
        self.quota = Quota(
            ledger, self.pipeline, self.retention, pin_reserve=config.pin_reserve, pin_share=config.pin_share
        )
        self.expiry = Expiry(self.pipeline, self.retention, self.quota)
        self.regions = RegionTable(
            max_regions=config.max_session_regions,
            max_bytes=config.max_session_region_bytes,
            prefaulter=RegionPrefaulter(config.region_prefault),
        )
        self.handovers = HandoverTable(config.max_pending_handovers)
        self.tasks = TaskManager(retention_s=config.task_retention_s)
        self.metrics = Metrics()
        self.snapshot_hooks: list[Callable[[EngineSnapshot], EngineSnapshot]] = []
        """Each may add figures gathered elsewhere (the data plane: lookups clients answered)."""
        self.metrics.attach(self.snapshot)
        self.tasks.on_finish.append(self._observe)
        off_loop = OffLoop(self.executor)
        self.gpu = GpuService(  # cupy only on first use
            self.pipeline,
            self.executor,
            regions=self.regions,
            off_loop=off_loop,
            max_block_bytes=config.max_block_bytes,
            mode=config.gpu,
        )
        caps = SessionCaps(config.max_sessions, config.max_sessions_per_peer, config.max_tasks_per_session)
        self.sessions = Sessions(caps, self.authz, self.tasks, self.regions, self.handovers, self.gpu)
        self.pressure = StorePressure(self.pipeline, self.sessions.task_events.poke)  # told to every session
        self.reply_budget = ReplyBudget(config.reply_bytes)
        limits = BlockLimits(config.max_batch_blocks, config.max_block_bytes)
        self.blocks = Blocks(
            limits,
            self.authz,
            self.pipeline,
            self.retention,
            self.quota,
            self.expiry,
            self.metrics,
            self.reply_budget,
        )
        host = HostMover(self.pipeline, self.regions, off_loop, config.max_block_bytes)
        self.submitter = Submitter(
            SegmentCaps(config.max_segments_per_request, config.max_segments_per_block),
            self.sessions,
            self.blocks,
            host,
            self.gpu,
            self.quota,
        )
        self.upkeep = Upkeep(self.pipeline, self.blocks.store_keys, self.retention)
        self.started = time.monotonic()
        self._quota_opening: asyncio.Task[None] | None = None

    # -- life -----------------------------------------------------------------------------------------
    async def open(self) -> None:
        await self.pipeline.open()
        if self.config.gpu == "on":  # refuse to start without a GPU path, rather than at the first client
            try:
                await self.gpu.start()
            except GpuUnavailable as exc:
                raise ConfigError(f"gpu: on, but {exc.message}") from None
        if any(t.indexing for t in self.pipeline.tiers):  # serve now; count usage once indexed
            self._quota_opening = asyncio.create_task(self._open_quota())
        else:
            await self.quota.open()  # each tenant's usage, rebuilt from what survived the restart
        self.expiry.start()  # TTLs: expired blocks leave every tier (once the tiers are indexed)
        self.pressure.start()

    async def _open_quota(self) -> None:
        """Rebuild the tenants' usage once every tier has indexed what survived the restart (until
        then a tenant's older blocks are not counted against its quota)."""
        for tier in self.pipeline.tiers:
            await tier.indexed()
        await self.quota.open()

    async def stop_serving(self, grace_s: float) -> None:
        """Shutting down: calls naming a session are refused from now on, running tasks get
        ``grace_s`` to finish and the rest are cancelled between chunks."""
        self.sessions.closing = True
        await self.tasks.shutdown(grace_s)

    async def close(self, grace_s: float = 10.0) -> None:
        opening = self._quota_opening
        if opening is not None:
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
        await self.expiry.stop()
        await self.pressure.stop()
        await self.tasks.shutdown(grace_s)
        await self.gpu.close()
        await self.pipeline.close()
        self.handovers.close()
        if self.regions.prefaulter is not None:
            self.regions.prefaulter.close()
        self.executor.shutdown(wait=True)
        self.metrics.close()

    def _observe(self, task: Task) -> None:
        """A task ended: its time, bytes and blocks by outcome, for the metrics."""
        self.metrics.observe_task(task.kind.name, task.elapsed_s, task.bytes_done)
        for state in set(task.states):
            self.metrics.blocks.labels(task.kind.name, _STATE_NAMES.get(state, str(state))).inc(
                task.states.count(state)
            )

    @property
    def ledger(self) -> TenantLedger | None:
        """The tenants' ledger (None without tenants); :attr:`quota` does the accounting with it."""
        return self.quota.ledger

    @ledger.setter
    def ledger(self, ledger: TenantLedger | None) -> None:
        self.quota.ledger = ledger
        self.authz.owners = ledger

    @property
    def heartbeat_interval_s(self) -> float:
        return self.config.heartbeat_interval_s

    @property
    def store_saturated(self) -> bool:
        """Whether the daemon cannot keep up with dumps (:mod:`ucm_server.pressure`), as last seen."""
        return self.pressure.saturated

    def poll_store_saturated(self) -> bool:
        """The same, looked at now (a Dump's reply: the connector acts on it at once)."""
        return self.pressure.poll()

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def version(self) -> str:
        return __version__

    # -- sessions and their memory --------------------------------------------------------------------
    def attach(self, client_name: str, pid: int, *, task_events: bool = False, peer: str = "") -> Session:
        """A new session; ``peer`` is gRPC's peer string (``ipv4:10.0.0.5:41234``, ``unix:...``)."""
        return self.sessions.attach(client_name, pid, task_events=task_events, peer=peer)

    async def detach(self, session_id: str) -> None:
        await self.sessions.detach(session_id)

    async def session_events(self, session_id: str) -> tuple[list[Task], bool]:
        """The session's tasks that ended since last asked (waiting up to a heartbeat interval for
        one), and whether their events were stopped (the client read too slowly)."""
        return await self.sessions.events(session_id, self.config.heartbeat_interval_s)

    def register_region(self, session_id: str | None, memfd_token: bytes, size: int, label: str) -> Region:
        return self.sessions.register_region(session_id, memfd_token, size, label)

    async def register_cuda_region(
        self,
        session_id: str | None,
        *,
        handle: bytes,
        offset: int,
        size: int,
        device: int,
        device_uuid: bytes,
        label: str,
    ) -> GpuRegion:
        cuda = CudaImport(handle, offset, size, device, device_uuid, label)
        return await self.sessions.register_cuda_region(session_id, cuda)

    def unregister_region(self, session_id: str | None, region_id: int) -> None:
        self.sessions.unregister_region(session_id, region_id)

    async def release_region(self, session_id: str | None, region_id: int) -> None:
        await self.submitter.release_region(session_id, region_id)

    # -- tasks ----------------------------------------------------------------------------------------
    async def submit_io(
        self,
        kind: TaskKind,
        session_id: str | None,
        namespace: bytes,
        digests: Sequence[bytes],
        counts: list[int],
        region_ids: list[int],
        offsets: list[int],
        lengths: list[int],
        *,
        durable: bool = False,
        cache_only: bool = False,
        progress: tuple[int, int, int] | None = None,
    ) -> Task:
        """A Load or Dump (:mod:`ucm_server.submit`); segments column-wise as on the wire. The
        ``Load``/``Dump`` RPCs and the data plane's ring both submit here. ``cache_only``: a Dump kept
        in the Cache (read by the pipeline in the task this starts)."""
        columns = SegmentColumns(counts, region_ids, offsets, lengths)
        token = cache_only_var.set(cache_only)
        try:
            return await self.submitter.start_io(
                kind, session_id, namespace, digests, columns, durable=durable, progress=progress
            )
        finally:
            cache_only_var.reset(token)

    def submit_prefetch(self, session_id: str | None, namespace: bytes, digests: Sequence[bytes]) -> Task:
        return self.submitter.start_prefetch(session_id, namespace, digests)

    def task(self, session_id: str | None, task_id: int) -> Task:
        return self.sessions.task(session_id, task_id)

    async def wait(
        self, session_id: str | None, task_id: int, timeout_s: float, cancel_on_timeout: bool = False
    ) -> Task:
        return await self.sessions.wait(session_id, task_id, timeout_s, cancel_on_timeout)

    async def cancel(self, session_id: str | None, task_id: int) -> Task:
        return await self.sessions.cancel(session_id, task_id)

    # -- blocks ---------------------------------------------------------------------------------------
    def keys(self, namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
        """The keys a data call of the caller names, as stored."""
        return self.blocks.keys(namespace, digests)

    async def lookup(
        self, namespace: bytes, digests: Sequence[bytes], *, checked: bool = False
    ) -> LookupAnswer:
        return await self.blocks.lookup(namespace, digests, checked=checked)

    async def delete(self, namespace: bytes, digests: Sequence[bytes]) -> int:
        return await self.blocks.delete(namespace, digests)

    async def set_retention(
        self, namespace: bytes, digests: Sequence[bytes], change: Change, *, require_all_tiers: bool = False
    ) -> RetentionAnswer:
        return await self.blocks.set_retention(
            namespace, digests, change, require_all_tiers=require_all_tiers
        )

    def get_bytes(
        self, namespace: bytes, digests: Sequence[bytes]
    ) -> AsyncIterator[tuple[int, BlockResult, bytes]]:
        return self.blocks.get_bytes(namespace, digests)

    async def put_bytes(self, namespace: bytes, digest: bytes, data: bytes) -> BlockResult:
        return await self.blocks.put_bytes(namespace, digest, data)

    # -- figures and admin -----------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Every figure ``Admin.Stats`` and the metrics report, read at once (no await, no lock: the
        Prometheus scrape thread calls this too)."""
        tasks, blocks = self.tasks, self.blocks
        snap = EngineSnapshot(
            version=self.version,
            uptime_s=self.uptime_s,
            tiers=tuple(TierFigures(t.stats(), t.persistent, t.shared) for t in self.pipeline.tiers),
            sessions=len(self.sessions),
            regions=len(self.regions),
            region_bytes=self.regions.total_bytes,
            tasks_running=tasks.running - tasks.queued,
            tasks_queued=tasks.queued,
            lookups=blocks.lookups,
            lookup_keys=blocks.lookup_keys,
            lookup_hits=blocks.lookup_hits,
            pending_writeback=self.pipeline.pending_writeback,
            store_pipeline=self.pipeline.spec,
            writeback=self.pipeline.writeback_figures(),
            pinned_blocks=self.retention.pinned_count,
            retention_rules=len(self.retention),
            expired_blocks=self.expiry.expired,
            reply_bytes_held=self.reply_budget.held,
            reply_waits=self.reply_budget.waits,
            store_saturated=self.pressure.saturated,
            door_admission=self.pipeline.admission.door_extra() if self.pipeline.admission else {},
        )
        for hook in self.snapshot_hooks:
            snap = hook(snap)
        return snap

    def session_list(self) -> list[SessionFigures]:
        """The attached sessions, oldest first."""
        return sorted(
            (SessionFigures(s.client_name, s.pid, s.tenant, s.attached_at) for s in self.sessions),
            key=lambda s: s.attached_at,
        )

    def tier_stats(self) -> list[tuple[TierStats, bool, bool]]:
        return [(f.stats, f.persistent, f.shared) for f in self.snapshot().tiers]

    async def inspect(self, namespace: bytes, digest: bytes) -> Listed:
        return await self.upkeep.inspect(namespace, digest)

    async def list_blocks(
        self, namespace: bytes, tier: str, page_size: int, page_token: str
    ) -> tuple[list[Listed], str, int]:
        return await self.upkeep.list_blocks(namespace, tier, page_size, page_token)

    async def evict(
        self, tier_name: str, nbytes: int, namespace: bytes, digests: Sequence[bytes], everything: bool
    ) -> tuple[int, int]:
        return await self.upkeep.evict(tier_name, nbytes, namespace, digests, everything)

    def verify(
        self, tier_name: str, namespace: bytes, quarantine: bool = True
    ) -> AsyncIterator[tuple[int, int, list[str]]]:
        return self.upkeep.verify(tier_name, namespace, quarantine)


_STATE_NAMES = {int(s): s.name.lower() for s in BlockState}
