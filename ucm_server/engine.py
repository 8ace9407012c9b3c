"""The daemon's domain core: sessions, regions, tasks and the tier pipeline, behind plain methods.

The gRPC servicers only translate protobuf to these calls and back; everything that decides something
about a request (validation, ownership, limits) lives here, where tests and the admin service share it.
The engine's helpers each have one job of their own: :mod:`ucm_server.chunks` (how a task is cut),
:mod:`ucm_server.quota` (tenant accounting), :mod:`ucm_server.upkeep` (operator list/inspect/evict/
verify) and :mod:`ucm_server.snapshot` (the figures ``Admin.Stats`` and the metrics read).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TypeVar

from ucm_protocol.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from ucm_protocol.keys import BlockKey, Namespace, check_digests, check_namespace, make_keys
from ucm_protocol.text import printable
from ucm_server import __version__
from ucm_server.auth import Authenticator, current_principal
from ucm_server.chunks import CHUNK_BLOCKS, CHUNK_BYTES, chunk_bounds  # noqa: F401 (names kept here)
from ucm_server.config import ServerConfig
from ucm_server.expiry import Expiry
from ucm_server.gpu.backend import GpuUnavailable
from ucm_server.gpu.region import GpuRegion
from ucm_server.gpu.service import GpuPlan, GpuService
from ucm_server.handover import HandoverTable
from ucm_server.journal import remember_names
from ucm_server.load_progress import ProgressWord, progress_word
from ucm_server.metrics import Metrics
from ucm_server.quota import Quota
from ucm_server.region_prefault import RegionPrefaulter
from ucm_server.regions import (
    Region,
    RegionTable,
    SegmentColumns,
    check_disjoint,
    check_segments,
    host_iovecs,
    single_segment_iovecs,
)
from ucm_server.reply_budget import ReplyBudget
from ucm_server.retention import FILE_NAME as RETENTION_FILE
from ucm_server.retention import Change, RetentionTable
from ucm_server.snapshot import EngineSnapshot, TierFigures
from ucm_server.store.base import BlockInfo, BlockResult, BlockState, IoVec, TierStats, iov_len
from ucm_server.store.compressed import CompressedTier
from ucm_server.store.encrypted import EncryptedTier, read_key_file
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.registry import build_pipeline
from ucm_server.task_events import TaskEvents
from ucm_server.tasks import Task, TaskKind, TaskManager
from ucm_server.tenants import SEALED_FILE, TenantKeyring, TenantLedger, remember_sealed
from ucm_server.upkeep import Upkeep

log = logging.getLogger(__name__)

CODEC_FILE = "codec_tiers.json"
_CODEC_FIX = (
    "fix the file (a JSON list of the tiers that hold blocks compressed at rest); remove a tier only "
    "once it holds no encoded block"
)

CLIENT_NAME_CHARS = 256
INLINE_SEGMENTS = 4096
"""Requests with more segments than this are validated in a worker thread, not on the event loop."""
T = TypeVar("T")


@dataclass(slots=True)
class Session:
    session_id: str
    client_name: str
    pid: int
    attached_at: float
    tenant: str = ""
    owner: str = ""
    """Who the per-peer session cap counts this session against ("" = nobody: local, no token)."""


@dataclass(frozen=True, slots=True)
class RetentionAnswer:
    applied: int
    missing: int
    not_enforced: list[str]


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    present: bytes  # one byte per key: 1 stored, 0 not (the wire's ``present_bytes`` as it is)
    hit_prefix: int


class Engine:
    def __init__(
        self,
        config: ServerConfig,
        pipeline: Pipeline | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.config = config
        self.executor = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="ucm-io")
        self.pipeline = pipeline or build_pipeline(config, self.executor)
        self.regions = RegionTable(
            max_regions=config.max_session_regions,
            max_bytes=config.max_session_region_bytes,
            prefaulter=RegionPrefaulter(config.region_prefault),
        )
        self.handovers = HandoverTable(config.max_pending_handovers)
        self.upkeep = Upkeep(self.pipeline, self._keys)
        self.gpu = GpuService(self.pipeline, self.executor, mode=config.gpu)  # cupy only on first use
        self.tasks = TaskManager(retention_s=config.task_retention_s)
        self.reply_budget = ReplyBudget(config.reply_bytes)
        self.sessions: dict[str, Session] = {}
        self._region_tasks: dict[Region | GpuRegion, dict[int, Task]] = {}
        """The unfinished tasks copying to or from each region (see :meth:`release_region`)."""
        self.metrics = Metrics()
        self.snapshot_hooks: list[Callable[[EngineSnapshot], EngineSnapshot]] = []
        """Each may add figures gathered elsewhere (the data plane: lookups clients answered)."""
        self.metrics.attach(self.snapshot)
        self.tasks.on_finish.append(self._observe)
        self.task_events = TaskEvents()
        self.tasks.on_finish.append(self.task_events.publish)
        self.started = time.monotonic()
        self.lookups = self.lookup_keys = self.lookup_hits = 0
        self.closing = False
        ledger: TenantLedger | None = None
        if authenticator is not None:
            quotas = {t: p.quota for t, p in authenticator.tenants.items() if t}
            ledger = TenantLedger(config.data_dir / "tenants.json", quotas, self.executor)
        self._encrypt(authenticator, ledger)
        self._compress()
        self.retention = RetentionTable(config.data_dir / RETENTION_FILE, self.executor)
        self.pipeline.set_rules(self.retention)
        self.quota = Quota(ledger, self.pipeline, self.retention)
        self.expiry = Expiry(self.pipeline, self.retention, self.quota)
        self._quota_opening: asyncio.Task[None] | None = None

    def _encrypt(self, authenticator: Authenticator | None, ledger: TenantLedger | None) -> None:
        """Wrap the ``encrypt_tiers`` in :class:`EncryptedTier` with the tenants' keys (read now:
        a bad key file stops start-up naming the file, never showing the key)."""
        tenants = authenticator.tenants if authenticator is not None else {}
        keyed = {t: p.key_file for t, p in tenants.items() if t and p.key_file}
        names = self.config.encrypted_tiers
        sealed_file = self.config.data_dir / SEALED_FILE
        if not names and sealed_file.exists():
            raise ConfigError(
                f"encrypt_tiers is empty, but {sealed_file} lists tenants whose blocks are encrypted at "
                "rest: name the tiers again (or delete those blocks and the file)"
            )
        if keyed and not names:
            raise ConfigError(
                f"auth_tokens_file gives tenant {sorted(keyed)[0]!r} a key_file, but encrypt_tiers is empty: "
                "its blocks would be stored in clear (name the tiers to encrypt)"
            )
        if not names:
            return
        if not keyed or ledger is None:
            raise ConfigError("encrypt_tiers is set, but no tenant in auth_tokens_file has a key_file")
        keys = {t: read_key_file(Path(path), t) for t, path in keyed.items()}
        keyring = TenantKeyring(ledger, keys, remember_sealed(sealed_file, keys))
        self.pipeline.wrap(names, lambda tier: EncryptedTier(tier, keyring, self.executor))
        log.info("encryption at rest: %s, for %d tenant(s)", ", ".join(names), len(keyed))

    def _compress(self) -> None:
        """Wrap the ``codec_tiers`` in :class:`CompressedTier` (outside any encryption: ciphertext
        does not compress), and every tier that ever held encoded blocks in a decoding-only one:
        turning the codec off must not turn its blocks into garbage."""
        names = self.config.compressed_tiers
        known = [t.name for t in self.pipeline.tiers[1:]]
        path = self.config.data_dir / CODEC_FILE
        ever = remember_names(path, names, "compressed tiers", _CODEC_FIX)
        for name in sorted(ever - set(names) - set(known)):
            log.warning("%s lists tier %r, which is not in store_pipeline now", path, name)
        dtype = self.config.codec_dtype
        self.pipeline.wrap(names, lambda tier: CompressedTier(tier, dtype, self.executor))
        decoding = sorted((ever - set(names)) & set(known))
        self.pipeline.wrap(decoding, lambda tier: CompressedTier(tier, None, self.executor))
        if names or decoding:
            log.info(
                "compression at rest: %s (%s, %s); decoding only: %s",
                ", ".join(names) or "none",
                self.config.codec,
                dtype,
                ", ".join(decoding) or "none",
            )

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

    async def _open_quota(self) -> None:
        """Rebuild the tenants' usage once every tier has indexed what survived the restart (until
        then a tenant's older blocks are not counted against its quota)."""
        for tier in self.pipeline.tiers:
            await tier.indexed()
        await self.quota.open()

    @property
    def ledger(self) -> TenantLedger | None:
        """The tenants' ledger (None without tenants); :attr:`quota` does the accounting with it."""
        return self.quota.ledger

    @ledger.setter
    def ledger(self, ledger: TenantLedger | None) -> None:
        self.quota.ledger = ledger

    async def close(self, grace_s: float = 10.0) -> None:
        opening = self._quota_opening
        if opening is not None:
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
        await self.expiry.stop()
        await self.tasks.shutdown(grace_s)
        await self.gpu.close()
        await self.pipeline.close()
        self.handovers.close()
        if self.regions.prefaulter is not None:
            self.regions.prefaulter.close()
        self.executor.shutdown(wait=True)
        self.metrics.close()

    # -- sessions -------------------------------------------------------------------------------------
    def attach(self, client_name: str, pid: int, *, task_events: bool = False, peer: str = "") -> Session:
        """A new session; ``peer`` is gRPC's peer string (``ipv4:10.0.0.5:41234``, ``unix:...``)."""
        # Kept and logged escaped and capped: a client name is the client's text (issue #11, section 11).
        name = printable(client_name or "?", CLIENT_NAME_CHARS)
        tenant = current_principal.get().tenant
        owner = _session_owner(tenant, peer)
        self._check_session_caps(owner)
        s = Session(uuid.uuid4().hex, name, pid, time.time(), tenant, owner)
        self.sessions[s.session_id] = s
        if task_events:
            self.task_events.open(s.session_id)
        log.info("session %s attached (%s, pid %d)", s.session_id[:8], s.client_name, pid)
        return s

    def _check_session_caps(self, owner: str) -> None:
        """One client (or tenant, or TCP host) cannot take every session the daemon can hold."""
        cap = self.config.max_sessions
        if len(self.sessions) >= cap:
            raise ResourceExhausted(
                f"the daemon holds {len(self.sessions)} sessions; the limit is {cap} (setting max_sessions)"
            )
        if not owner:
            return
        cap = self.config.max_sessions_per_peer
        mine = sum(1 for s in self.sessions.values() if s.owner == owner)
        if mine >= cap:
            raise ResourceExhausted(
                f"{owner} holds {mine} sessions; the limit is {cap} (setting max_sessions_per_peer)"
            )

    async def detach(self, session_id: str) -> None:
        self.task_events.close(session_id)
        if self.sessions.pop(session_id, None) is None:
            return
        ntasks = await self.tasks.release_session(session_id)
        nregions = self.regions.release_session(session_id)
        log.info("session %s detached: released %d regions, %d tasks", session_id[:8], nregions, ntasks)

    def session(self, session_id: str | None) -> Session:
        if self.closing:
            raise Unavailable("the daemon is shutting down")
        if not session_id:
            raise FailedPrecondition(
                "this call needs a session: call Attach first and pass ucm-session metadata"
            )
        s = self.sessions.get(session_id)
        if s is None:
            raise FailedPrecondition(
                f"session {session_id[:8]} is not attached (daemon restarted?); attach again"
            )
        if s.tenant != current_principal.get().tenant:
            raise PermissionDenied(f"session {session_id[:8]} belongs to another tenant")
        return s

    # -- regions --------------------------------------------------------------------------------------
    def register_region(self, session_id: str | None, memfd_token: bytes, size: int, label: str) -> Region:
        """Map the memfd handed over on the fd socket under ``memfd_token`` (once) as a new region."""
        s = self.session(session_id)
        if size <= 0:
            raise InvalidArgument(f"region size must be positive, got {size}")
        self.regions.check_limits(s.session_id, size)  # before the token is spent
        handover = self.handovers.take(memfd_token)
        try:
            if size > handover.size:
                raise InvalidArgument(
                    f"region size {size} is larger than the memory handed over ({handover.size} bytes)"
                )
            return self.regions.register_fd(
                s.session_id, handover.fd, size, label, uid=handover.uid, pid=handover.pid
            )
        finally:
            handover.close()  # the mapping keeps the memory; the descriptor is not needed any more

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
        """A GPU region from a CUDA IPC handle; ``GpuUnavailable`` (FAILED_PRECONDITION) says why not."""
        s = self.session(session_id)
        self.regions.check_limits(s.session_id, size)
        region = await self.gpu.register(
            self.regions,
            s.session_id,
            handle=handle,
            offset=offset,
            size=size,
            device=device,
            device_uuid=device_uuid,
            label=label,
        )
        if s.session_id not in self.sessions:  # the client went away while the handle was opened
            self.regions.release_session(s.session_id)
            raise FailedPrecondition(f"session {s.session_id[:8]} ended during registration")
        return region

    def unregister_region(self, session_id: str | None, region_id: int) -> None:
        """Forget the region at once; tasks already using it keep their pin and finish (see
        :meth:`release_region` for what the UnregisterRegion call does)."""
        s = self.session(session_id)
        self.regions.unregister(s.session_id, region_id)

    async def release_region(self, session_id: str | None, region_id: int) -> None:
        """UnregisterRegion: when this returns the daemon no longer touches the region's memory.

        Before, the region was only forgotten: a Load still running into it went on writing for as long
        as it ran, over memory the client had every reason to think was its own again (a red-team test
        saw all 64 blocks of a load land after the call returned, the task reporting OK). Now the
        session's tasks still using the region are cancelled and waited for, as Cancel does: blocks they
        had not copied end CANCELLED, and nothing is copied after the call returns."""
        s = self.session(session_id)
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

    # -- lookups and deletes --------------------------------------------------------------------------
    def _scope(self, namespace: bytes) -> Namespace:
        """The caller's namespace as stored: checked, then made private to the caller's tenant."""
        return current_principal.get().scope(check_namespace(namespace))

    def _check_batch(self, digests: Sequence[bytes]) -> None:
        if len(digests) > self.config.max_batch_blocks:
            raise InvalidArgument(
                f"{len(digests)} keys in one request; the limit is {self.config.max_batch_blocks}"
            )

    def _keys(self, namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
        self._check_batch(digests)
        return make_keys(self._scope(namespace), digests)

    async def lookup(
        self, namespace: bytes, digests: Sequence[bytes], *, checked: bool = False
    ) -> LookupAnswer:
        """Presence of each key and the hit prefix; ``checked`` = digests are known to be 32 bytes."""
        self._check_batch(digests)
        ns = self._scope(namespace)
        if not checked:
            check_digests(digests)
        await self.expiry.due()  # an expired block is never answered present
        sizes, complete = await self.pipeline.lookup_presence(ns, digests)  # no per-key objects
        if complete or None not in sizes:  # all found (a repeated prompt): no per-key pass at all
            present, prefix, hits = b"\x01" * len(sizes), len(sizes), len(sizes)
        else:
            present = bytes(map(operator.is_not, sizes, repeat(None)))  # C-level: a byte per key, 0 or 1
            prefix = present.find(0)
            hits = present.count(1)
        self.lookups += 1
        self.lookup_keys += len(digests)
        self.lookup_hits += hits
        self.metrics.observe_lookup(len(digests), hits)
        return LookupAnswer(present, prefix)

    async def delete(self, namespace: bytes, digests: Sequence[bytes]) -> int:
        keys = self._keys(namespace, digests)
        self.quota.forgot(keys)
        deleted = await self.pipeline.delete(keys)
        await self.retention.forget(keys)
        return deleted

    async def set_retention(
        self, namespace: bytes, digests: Sequence[bytes], change: Change, *, require_all_tiers: bool = False
    ) -> RetentionAnswer:
        """Pin/unpin, expire or prioritise the stored blocks among ``digests`` (of the caller's
        tenant). A pin where some tier cannot hold it is refused with ``require_all_tiers``, else
        reported; a pin past the owner's quota is refused whole (RESOURCE_EXHAUSTED)."""
        keys = self._keys(namespace, digests)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")
        gaps = self.pipeline.pin_gaps() if change.pin else []
        if gaps and require_all_tiers:
            raise FailedPrecondition("cannot pin in every tier: " + "; ".join(gaps))
        await self.expiry.due()
        sizes = await self.pipeline.lookup(keys)
        stored = [k for k, size in zip(keys, sizes, strict=True) if size is not None]
        if change.pin:
            self.quota.check_pins(keys, sizes)
        await self.retention.change(stored, change, time.time())
        return RetentionAnswer(len(stored), len(keys) - len(stored), gaps)

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
        progress: tuple[int, int, int] | None = None,
    ) -> Task:
        """Validate everything up front (nothing is copied for a bad request), then run as a task.

        Validation costs time linear in the segments, which the caps bound; a request with more
        than :data:`INLINE_SEGMENTS` segments is checked in a worker thread (its regions pinned), so
        other clients are answered meanwhile. ``progress``: a Load's progress word ``(region,
        offset, length)`` (:mod:`ucm_server.load_progress`); taken for host loads only, which the
        task says in ``reports_progress``."""
        session = self.session(session_id)
        self._check_task_slot(session)
        keys = self._keys(namespace, digests)
        columns = SegmentColumns(counts, region_ids, offsets, lengths)
        self._check_segment_caps(columns)
        if kind is TaskKind.LOAD:
            await self._check_load_sizes(keys, counts, lengths)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")
        if kind is TaskKind.DUMP:
            await self.quota.claim(keys)  # before the regions are found and pinned
        if self.regions.has_gpu(region_ids):  # CUDA IPC regions: device copies (ucm_server.gpu)
            return await self._submit_gpu(kind, session, keys, columns, durable)
        block_counts = columns.block_counts(len(keys))
        found = self.regions.regions_for(session.session_id, columns, block_counts, gpu=False)
        used: set[Region] = set(found.values())
        word = None
        if kind is TaskKind.LOAD and progress is not None:
            word = progress_word(self.regions, session.session_id, *progress, columns)
            used.add(word.region)
        self.regions.pin(used)
        try:
            iovs = await self._off_loop(len(region_ids), self._host_plan, kind, columns, block_counts, found)
            self._still_valid(session, used)
            if kind is TaskKind.DUMP:
                self.quota.refuse_oversized(map(iov_len, iovs))
        except BaseException:
            self.regions.unpin(used)
            raise

        async def body(task: Task) -> None:
            await self._run_chunks(task, keys, iovs, durable, word)

        task = self._start(
            kind,
            session,
            len(keys),
            body,
            on_refused=lambda: self.regions.unpin(used),
            regions=used,
            on_end=None if word is None else word.done,
        )
        task.reports_progress = word is not None
        return task

    def _host_plan(
        self, kind: TaskKind, columns: SegmentColumns, counts: list[int], found: dict[int, Region]
    ) -> list[IoVec]:
        """Every segment checked, overlapping Load destinations refused, one iovec per block (no
        event-loop state: may run in a worker thread)."""
        iovs = single_segment_iovecs(columns, found, self.config.max_block_bytes)
        if iovs is None:
            iovs = host_iovecs(check_segments(columns, counts, found, self.config.max_block_bytes))
        if kind is TaskKind.LOAD:
            check_disjoint(columns, counts)
        return iovs

    async def _off_loop(self, nsegments: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` inline for a small request, in a worker thread for a large one."""
        if nsegments <= INLINE_SEGMENTS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _still_valid(self, session: Session, regions: Iterable[Region | GpuRegion]) -> None:
        """After an off-loop check: the session and its regions did not go away meanwhile."""
        if session.session_id not in self.sessions:
            raise FailedPrecondition(f"session {session.session_id[:8]} ended while its request was checked")
        for r in regions:
            if r.closing:
                raise InvalidArgument(f"region {r.region_id} was unregistered while the request was checked")

    def _check_segment_caps(self, columns: SegmentColumns) -> None:
        """The caps that bound a request's cost (RESOURCE_EXHAUSTED, naming the setting)."""
        nseg = len(columns.region_ids)
        cap = self.config.max_segments_per_request
        if nseg > cap:
            raise ResourceExhausted(
                f"{nseg} segments in one request; the limit is {cap} (setting max_segments_per_request)"
            )
        cap = self.config.max_segments_per_block
        most = max(columns.counts) if columns.counts else 1
        if most > cap:
            b = columns.counts.index(most)
            raise ResourceExhausted(
                f"block {b} has {most} segments; the limit is {cap} (setting max_segments_per_block)"
            )

    def _check_task_slot(self, session: Session) -> None:
        cap = self.config.max_tasks_per_session
        active = self.tasks.active(session.session_id)
        if active >= cap:
            raise ResourceExhausted(
                f"session {session.session_id[:8]} has {active} tasks running or queued; the limit is "
                f"{cap} (setting max_tasks_per_session): wait for some to finish"
            )

    def _start(
        self,
        kind: TaskKind,
        session: Session,
        nblocks: int,
        body: Callable[[Task], Awaitable[None]],
        on_refused: Callable[[], None] | None = None,
        regions: Iterable[Region | GpuRegion] = (),
        on_end: Callable[[], None] | None = None,
    ) -> Task:
        """Submit a task body, re-checking the session's task slots (validation may have awaited).

        ``regions`` (pinned by the caller) are tracked for :meth:`release_region` while the task
        lives and unpinned when it ends, whether or not its body ran; ``on_end`` runs then too,
        before the unpinning (a Load's progress word reads DONE even for a task cancelled while
        queued, so no reader waits on it until its deadline)."""
        try:
            self._check_task_slot(session)
        except ResourceExhausted:
            if on_refused is not None:
                on_refused()
            raise
        held = list(regions)

        def release(task: Task) -> None:
            if on_end is not None:
                on_end()
            self._untrack(task, held)
            self.regions.unpin(held)

        task = self.tasks.submit(
            kind, session.session_id, nblocks, body, release if held or on_end is not None else None
        )
        self._track(task, held)  # before the body first runs (it starts at the next await)
        return task

    async def _check_load_sizes(self, keys: list[BlockKey], counts: list[int], lengths: list[int]) -> None:
        """A load into a destination of the wrong size is the caller's mistake: refuse it whole
        (``INVALID_ARGUMENT``, nothing copied) rather than fail blocks one by one."""
        sizes = await self.pipeline.lookup(keys)
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

    async def _submit_gpu(
        self, kind: TaskKind, session: Session, keys: list[BlockKey], columns: SegmentColumns, durable: bool
    ) -> Task:
        counts = columns.block_counts(len(keys))
        held = set(self.regions.regions_for(session.session_id, columns, counts, gpu=True).values())
        self.regions.pin(held)  # while the plan is made, perhaps in a worker thread
        try:
            nseg = len(columns.region_ids)
            plan = await self._off_loop(nseg, self._gpu_plan, kind, session, columns, counts)
            self._still_valid(session, held)
            if kind is TaskKind.DUMP:
                self.quota.refuse_oversized(block.nbytes for block in plan.blocks)
            self.regions.pin(plan.regions)
        finally:
            self.regions.unpin(held)

        async def body(task: Task) -> None:
            await self.gpu.run(task, keys, plan, durable)
            if self.quota.enabled:  # per-tenant quotas, as for host blocks (once, at the task's end)
                states, blocks = task.states, plan.blocks
                done = [(keys[i], blocks[i].nbytes) for i, s in enumerate(states) if s == BlockState.OK]
                await self.quota.account(kind, done)

        return self._start(
            kind,
            session,
            len(keys),
            body,
            on_refused=lambda: self.regions.unpin(plan.regions),
            regions=plan.regions,
        )

    def _gpu_plan(
        self, kind: TaskKind, session: Session, columns: SegmentColumns, counts: list[int]
    ) -> GpuPlan:
        """:meth:`GpuService.plan`, and overlapping Load destinations refused (thread-safe)."""
        max_bytes = self.config.max_block_bytes
        plan = self.gpu.plan(self.regions, session.session_id, columns, len(counts), max_bytes)
        if kind is TaskKind.LOAD:
            check_disjoint(columns, counts)
        return plan

    async def _run_chunks(
        self,
        task: Task,
        keys: list[BlockKey],
        iovs: list[IoVec],
        durable: bool,
        word: ProgressWord | None = None,
    ) -> None:
        """The task's blocks a chunk at a time; a Load's progress ``word`` is reported by the last
        chunk only, as its counts then hold for every block of the task."""
        sizes = [iov_len(iov) for iov in iovs]  # once per block: small blocks feel every pass
        bounds = chunk_bounds(sizes)
        for start, stop in bounds:
            if task.cancel_requested:
                return
            items = list(zip(keys[start:stop], iovs[start:stop], strict=True))
            if task.kind is TaskKind.LOAD:
                last = stop == bounds[-1][1]
                report = word.report if word is not None and last else None
                results = await self.pipeline.read_many(items, report=report)
            else:
                results = await self.pipeline.write_many(items, durable=durable)
            task.record_many(start, results, sizes[start:stop])
            if self.quota.enabled:  # per-tenant quotas, chunk by chunk
                await self.quota.account(task.kind, _done(items, results))

    def submit_prefetch(self, session_id: str | None, namespace: bytes, digests: Sequence[bytes]) -> Task:
        session = self.session(session_id)
        self._check_task_slot(session)
        keys = self._keys(namespace, digests)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")

        async def body(task: Task) -> None:
            for start in range(0, len(keys), CHUNK_BLOCKS):
                if task.cancel_requested:
                    return
                for offset, r in enumerate(await self.pipeline.prefetch(keys[start : start + CHUNK_BLOCKS])):
                    task.record(start + offset, r)

        return self.tasks.submit(TaskKind.PREFETCH, session.session_id, len(keys), body)

    def task(self, session_id: str | None, task_id: int) -> Task:
        return self.tasks.get(task_id, self.session(session_id).session_id)

    def _observe(self, task: Task) -> None:
        self.metrics.observe_task(task.kind.name, task.elapsed_s, task.bytes_done)
        for state in set(task.states):
            self.metrics.blocks.labels(task.kind.name, _STATE_NAMES.get(state, str(state))).inc(
                task.states.count(state)
            )

    # -- slow path ------------------------------------------------------------------------------------
    async def get_bytes(
        self, namespace: bytes, digests: Sequence[bytes]
    ) -> AsyncIterator[tuple[int, BlockResult, bytes]]:
        keys = self._keys(namespace, digests)
        sizes = await self.pipeline.lookup(keys)
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if size is None:
                yield i, BlockResult(BlockState.MISSING), b""
                continue
            async with self.reply_budget.hold(size):  # until the reply is sent: see ReplyBudget
                buf = bytearray(size)
                (r,) = await self.pipeline.read_many([(key, [memoryview(buf)])], owned=True)
                data = bytes(buf) if r.ok else b""
                del buf
                yield i, r, data

    async def put_bytes(self, namespace: bytes, digest: bytes, data: bytes) -> BlockResult:
        (key,) = self._keys(namespace, [digest])
        if not data:
            raise InvalidArgument("block data is empty")
        if len(data) > self.config.max_block_bytes:
            raise InvalidArgument(
                f"block is {len(data)} bytes, more than max_block_bytes {self.config.max_block_bytes}"
            )
        self.quota.refuse_oversized([len(data)])
        await self.quota.claim([key])
        item = (key, [memoryview(data)])
        (r,) = await self.pipeline.write_many([item], owned=True)
        if self.quota.enabled:  # the same quota accounting as Dump: the tenant's oldest go first
            await self.quota.account(TaskKind.DUMP, _done([item], [r]))
        return r

    # -- figures and admin -----------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Every figure ``Admin.Stats`` and the metrics report, read at once (no await, no lock: the
        Prometheus scrape thread calls this too)."""
        tasks = self.tasks
        snap = EngineSnapshot(
            version=self.version,
            uptime_s=self.uptime_s,
            tiers=tuple(TierFigures(t.stats(), t.persistent, t.shared) for t in self.pipeline.tiers),
            sessions=len(self.sessions),
            regions=len(self.regions),
            region_bytes=self.regions.total_bytes,
            tasks_running=tasks.running - tasks.queued,
            tasks_queued=tasks.queued,
            lookups=self.lookups,
            lookup_keys=self.lookup_keys,
            lookup_hits=self.lookup_hits,
            pending_writeback=self.pipeline.pending_writeback,
            store_pipeline=self.pipeline.spec,
            writeback=self.pipeline.writeback_figures(),
            pinned_blocks=self.retention.pinned_count,
            retention_rules=len(self.retention),
            expired_blocks=self.expiry.expired,
            reply_bytes_held=self.reply_budget.held,
            reply_waits=self.reply_budget.waits,
        )
        for hook in self.snapshot_hooks:
            snap = hook(snap)
        return snap

    def tier_stats(self) -> list[tuple[TierStats, bool, bool]]:
        return [(f.stats, f.persistent, f.shared) for f in self.snapshot().tiers]

    # Operator upkeep lives in ucm_server.upkeep; these stay for callers of the engine.
    async def inspect(self, namespace: bytes, digest: bytes) -> tuple[BlockInfo, list[str]]:
        return await self.upkeep.inspect(namespace, digest)

    async def list_blocks(
        self, namespace: bytes, tier: str, page_size: int, page_token: str
    ) -> tuple[list[tuple[BlockInfo, list[str]]], str, int]:
        return await self.upkeep.list_blocks(namespace, tier, page_size, page_token)

    async def evict(
        self, tier_name: str, nbytes: int, namespace: bytes, digests: Sequence[bytes], everything: bool
    ) -> tuple[int, int]:
        return await self.upkeep.evict(tier_name, nbytes, namespace, digests, everything)

    def verify(
        self, tier_name: str, namespace: bytes, quarantine: bool = True
    ) -> AsyncIterator[tuple[int, int, list[str]]]:
        return self.upkeep.verify(tier_name, namespace, quarantine)

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def version(self) -> str:
        return __version__


def _session_owner(tenant: str, peer: str) -> str:
    """What ``max_sessions_per_peer`` counts by: the tenant when tokens name one, else the TCP
    peer's address without its port. Local Unix-socket peers all look alike to gRPC, so they share
    only the global ``max_sessions``."""
    if tenant:
        return f"tenant {tenant!r}"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest:
        host = rest.rsplit(":", 1)[0] if kind == "ipv4" or rest.startswith("[") else rest
        return f"peer {kind}:{host}"
    return ""


def _done(items: list[tuple[BlockKey, IoVec]], results: list[BlockResult]) -> list[tuple[BlockKey, int]]:
    """(key, bytes) of the blocks a batch moved, for :meth:`Quota.account`."""
    return [(key, iov_len(iov)) for (key, iov), r in zip(items, results, strict=True) if r.ok]


_STATE_NAMES = {int(s): s.name.lower() for s in BlockState}
