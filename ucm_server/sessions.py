"""Client sessions: attached under caps, their memory registered, their tasks waited for and cancelled.

A session lives exactly as long as its client's ``Attach`` stream: when the client goes away its
regions are unmapped and its tasks cancelled, with no cooperation from it. Calls that touch client
memory or tasks name their session; it is found here, and belongs to the caller's tenant only
(:meth:`ucm_server.authz.Authorizer.check_session`).

The caps that keep one client from taking what all need are checked here: ``max_sessions`` in all,
``max_sessions_per_peer`` per tenant (or TCP host), ``max_tasks_per_session``; a wait is clamped to
the wire's ``WAIT_CAP_S`` (a client waits longer by asking again), so no call holds a server thread
for long.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ucm_protocol.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from ucm_protocol.text import printable
from ucm_protocol.wire import WAIT_CAP_S
from ucm_server.auth import current_principal
from ucm_server.authz import Authorizer
from ucm_server.gpu.service import GpuService
from ucm_server.gpu_region import CudaImport, GpuRegion
from ucm_server.handover import HandoverTable
from ucm_server.regions import Region, RegionTable
from ucm_server.task_events import TaskEvents
from ucm_server.tasks import Task, TaskManager

log = logging.getLogger(__name__)

CLIENT_NAME_CHARS = 256


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
class SessionCaps:
    max_sessions: int
    max_sessions_per_peer: int
    max_tasks_per_session: int


class Sessions:
    def __init__(
        self,
        caps: SessionCaps,
        authz: Authorizer,
        tasks: TaskManager,
        regions: RegionTable,
        handovers: HandoverTable,
        gpu: GpuService,
    ) -> None:
        self.caps = caps
        self.authz = authz
        self.tasks = tasks
        self.regions = regions
        self.handovers = handovers
        self.gpu = gpu
        self.task_events = TaskEvents()
        tasks.on_finish.append(self.task_events.publish)
        self._sessions: dict[str, Session] = {}
        self.closing = False
        """The daemon is shutting down: calls that name a session are refused (UNAVAILABLE)."""

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    # -- attach and detach ------------------------------------------------------------------------------
    def attach(self, client_name: str, pid: int, *, task_events: bool = False, peer: str = "") -> Session:
        """A new session; ``peer`` is gRPC's peer string (``ipv4:10.0.0.5:41234``, ``unix:...``)."""
        name = printable(client_name or "?", CLIENT_NAME_CHARS)  # the client's text: kept escaped, capped
        tenant = current_principal.get().tenant
        owner = session_owner(tenant, peer)
        self._check_caps(owner)
        s = Session(uuid.uuid4().hex, name, pid, time.time(), tenant, owner)
        self._sessions[s.session_id] = s
        if task_events:
            self.task_events.open(s.session_id)
        log.info("session %s attached (%s, pid %d)", s.session_id[:8], s.client_name, pid)
        return s

    def _check_caps(self, owner: str) -> None:
        """One client (or tenant, or TCP host) cannot take every session the daemon can hold."""
        cap = self.caps.max_sessions
        if len(self._sessions) >= cap:
            raise ResourceExhausted(
                f"the daemon holds {len(self._sessions)} sessions; the limit is {cap} (setting max_sessions)"
            )
        if not owner:
            return
        cap = self.caps.max_sessions_per_peer
        mine = sum(1 for s in self._sessions.values() if s.owner == owner)
        if mine >= cap:
            raise ResourceExhausted(
                f"{owner} holds {mine} sessions; the limit is {cap} (setting max_sessions_per_peer)"
            )

    async def detach(self, session_id: str) -> None:
        self.task_events.close(session_id)
        if self._sessions.pop(session_id, None) is None:
            return
        ntasks = await self.tasks.release_session(session_id)
        nregions = self.regions.release_session(session_id)
        log.info("session %s detached: released %d regions, %d tasks", session_id[:8], nregions, ntasks)

    async def events(self, session_id: str, timeout_s: float) -> tuple[list[Task], bool]:
        """The session's tasks that ended since the last call (waiting up to ``timeout_s`` for one),
        and whether their events were stopped (a client that reads too slowly)."""
        return await self.task_events.next(session_id, timeout_s)

    def get(self, session_id: str | None) -> Session:
        """The attached session the call names, if it is the caller's tenant's."""
        if self.closing:
            raise Unavailable("the daemon is shutting down")
        if not session_id:
            raise FailedPrecondition(
                "this call needs a session: call Attach first and pass ucm-session metadata"
            )
        s = self._sessions.get(session_id)
        if s is None:
            raise FailedPrecondition(
                f"session {session_id[:8]} is not attached (daemon restarted?); attach again"
            )
        self.authz.check_session(s.tenant, session_id)
        return s

    def check_live(self, session: Session, regions: Iterable[Region | GpuRegion]) -> None:
        """After a check that awaited: the session and the regions it names did not go away meanwhile."""
        if session.session_id not in self._sessions:
            raise FailedPrecondition(f"session {session.session_id[:8]} ended while its request was checked")
        for r in regions:
            if r.closing:
                raise InvalidArgument(f"region {r.region_id} was unregistered while the request was checked")

    # -- memory -----------------------------------------------------------------------------------------
    def register_region(self, session_id: str | None, memfd_token: bytes, size: int, label: str) -> Region:
        """Map the memfd handed over on the fd socket under ``memfd_token`` (once) as a new region."""
        s = self.get(session_id)
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

    async def register_cuda_region(self, session_id: str | None, cuda: CudaImport) -> GpuRegion:
        """A GPU region from a CUDA IPC handle; ``GpuUnavailable`` (FAILED_PRECONDITION) says why not."""
        s = self.get(session_id)
        self.regions.check_limits(s.session_id, cuda.size)
        region = await self.gpu.register(self.regions, s.session_id, cuda)
        if s.session_id not in self._sessions:  # the client went away while the handle was opened
            self.regions.release_session(s.session_id)
            raise FailedPrecondition(f"session {s.session_id[:8]} ended during registration")
        return region

    def unregister_region(self, session_id: str | None, region_id: int) -> None:
        """Forget the region at once; tasks already using it keep their pin and finish (the
        UnregisterRegion call also stops them: :meth:`ucm_server.submit.Submitter.release_region`)."""
        s = self.get(session_id)
        self.regions.unregister(s.session_id, region_id)

    # -- tasks ------------------------------------------------------------------------------------------
    def check_task_slot(self, session: Session) -> None:
        cap = self.caps.max_tasks_per_session
        active = self.tasks.active(session.session_id)
        if active >= cap:
            raise ResourceExhausted(
                f"session {session.session_id[:8]} has {active} tasks running or queued; the limit is "
                f"{cap} (setting max_tasks_per_session): wait for some to finish"
            )

    def task(self, session_id: str | None, task_id: int) -> Task:
        """One of the session's tasks (another session's is refused)."""
        return self.tasks.get(task_id, self.get(session_id).session_id)

    async def wait(
        self, session_id: str | None, task_id: int, timeout_s: float, cancel_on_timeout: bool
    ) -> Task:
        """The task once it ended, or as it is after ``timeout_s`` (clamped to ``WAIT_CAP_S``)."""
        task = self.task(session_id, task_id)
        return await self.tasks.wait(task, max(0.0, min(timeout_s, WAIT_CAP_S)), cancel_on_timeout)

    async def cancel(self, session_id: str | None, task_id: int) -> Task:
        """Stop the task; returns once it no longer touches client memory."""
        return await self.tasks.cancel(self.task(session_id, task_id))


def session_owner(tenant: str, peer: str) -> str:
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
