"""The local data plane, the daemon's side: the socket, the presence tables, the sessions' rings.

What it changes for a local client: a ``Lookup`` answered from a table the client maps (no round
trip), and ``Load``/``Dump`` submitted through a ring (no gRPC call; the engine does exactly what the
RPC does). gRPC stays the control plane (``Attach``, regions, ``Wait``/``Check`` for anything but
"all OK", retention, admin), the only plane for TCP clients, and every client's fallback.

Hooks into the rest of the daemon (each one line or so where it lives):

- :meth:`Engine.tasks.on_finish <ucm_server.tasks.TaskManager>`: a ring's task reports its end;
- ``TaskEvents.skip``: and, if all OK, is not pushed on the session stream as well (its client reads
  the ring);
- ``Engine.snapshot_hooks``: the lookups clients answered from a table count in ``Admin.Stats``;
- ``Metrics.before_collect``: and in ``/metrics``, up to the scrape;
- :func:`ucm_server.store.watch.add_watch`: the tables hear every tier's index changes beside any
  other watcher (KV events).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ucm_protocol import dataplane as dp
from ucm_protocol.errors import FailedPrecondition, UcmError
from ucm_server.auth import Authenticator, Principal
from ucm_server.authz import DATA_PLANE, enter
from ucm_server.dataplane.listener import DataPlaneListener
from ucm_server.dataplane.presence import REFRESH_S, Presence
from ucm_server.dataplane.ring import SessionRing, ended_all_ok, token_metadata
from ucm_server.engine import Engine
from ucm_server.snapshot import EngineSnapshot
from ucm_server.tasks import Task

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Counts:
    lookups: int = 0
    keys: int = 0
    hits: int = 0


class DataPlane:
    def __init__(
        self, engine: Engine, authenticator: Authenticator | None, socket_path: Path, arena_bytes: int
    ) -> None:
        self.engine = engine
        self.authenticator = authenticator
        self.arena_bytes = arena_bytes
        tenants = authenticator is not None and any(authenticator.tenants)
        self.presence = Presence(
            engine.pipeline, engine.retention, tenants=tenants, max_keys=engine.config.max_batch_blocks
        )
        self.rings: dict[str, SessionRing] = {}
        self._ring_tasks: dict[int, SessionRing] = {}
        self.listener = DataPlaneListener(socket_path, self)
        self._ticker: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # the lookup counts: the metrics scrape thread reads them too
        self._seen: dict[int, tuple[int, int, int]] = {}
        self.local = _Counts()
        engine.tasks.on_finish.append(self._finished)
        engine.sessions.task_events.skip = self._reported_by_ring  # its ring says it ended: no push as well
        engine.snapshot_hooks.append(self._with_local_lookups)
        engine.metrics.before_collect.append(self.fold_lookups)

    # -- life ------------------------------------------------------------------------------------------
    def bind(self) -> None:
        self.listener.bind()

    async def start(self) -> None:
        await self.listener.start()
        self._ticker = asyncio.create_task(self._tick())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.listener.close()
        for ring in list(self.rings.values()):
            ring.close("the daemon is stopping")
        await self.presence.close()

    async def _tick(self) -> None:
        """Keep the tables' lease, end rings of ended sessions, pass on answers a full queue held."""
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                self.presence.refresh()
                for ring in list(self.rings.values()):
                    if ring.session_id not in self.engine.sessions:
                        ring.close("its session ended")
                    else:
                        ring.tick()
            except Exception:
                log.exception("data plane: upkeep failed")

    # -- handshakes (the listener calls these on the event loop) ----------------------------------------
    def _principal(self, entry: str, session_id: str, token: str) -> Principal:
        """Who the caller is and whether it may, decided as for the RPC ``entry`` stands in for
        (:data:`~ucm_server.authz.DATA_PLANE`), and that the session is theirs."""
        grant = self.engine.authz.admit(DATA_PLANE[entry], token_metadata(token), local=True)
        assert grant is not None  # every entry point names a guarded method
        enter(grant)  # this handshake's task only
        self.engine.sessions.get(session_id)  # attached, and the caller's tenant's (else it raises)
        return grant.principal

    def open_channel(
        self, session_id: str, token: str, conn: socket.socket
    ) -> tuple[list[int], bytes, Callable[[bool], None]]:
        principal = self._principal("channel", session_id, token)
        if session_id in self.rings:
            raise FailedPrecondition(f"session {session_id[:8]} already has a data-plane channel")
        table = self.presence.table(principal.tenant)
        ring = SessionRing(
            self.engine,
            session_id,
            token,
            conn,
            self.arena_bytes,
            on_close=self._ring_closed,
            on_track=self._track,
            on_submitted=self._submitted,
        )
        self.rings[session_id] = ring
        fds: list[int] = []
        try:
            fds.append(ring.dup_fd())
            fds.append(table.reader_fd())
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            ring.close("could not hand the ring over")
            raise
        info = dp.CHANNEL_INFO.pack(ring.generation, ring.size, table.generation, table.size)

        def ready(sent: bool) -> None:
            if sent:
                ring.start()
            else:
                ring.close("the handshake's reply could not be sent")

        log.info("data plane: session %s has a channel", session_id[:8])
        return fds, info, ready

    def fetch_table(self, session_id: str, token: str) -> tuple[list[int], bytes]:
        principal = self._principal("table", session_id, token)
        table = self.presence.table(principal.tenant)
        return [table.reader_fd()], dp.TABLE_INFO.pack(table.generation, table.size)

    def _track(self, principal: Principal, named: bytes) -> None:
        if not self.presence.tenants:
            return  # every namespace is tracked already
        try:
            stored = self.engine.authz.namespace(named)  # as a Lookup of the caller would name it
        except UcmError:
            return
        self.presence.track(principal.tenant, named, stored)

    # -- rings and tasks ----------------------------------------------------------------------------------
    def _ring_closed(self, ring: SessionRing) -> None:
        with self._lock:
            self._fold(ring)
            self._seen.pop(id(ring), None)
            if self.rings.get(ring.session_id) is ring:
                del self.rings[ring.session_id]
        for task_id in list(ring.tasks):
            self._ring_tasks.pop(task_id, None)

    def _submitted(self, ring: SessionRing, task: Task) -> None:
        self._ring_tasks[task.task_id] = ring

    def _reported_by_ring(self, task: Task) -> bool:
        """A ring's task that ended all OK: its entry in the ring says it all. Any other end is
        pushed on the session stream as well, as a gRPC task's is (states and reasons, no call)."""
        return task.task_id in self._ring_tasks and ended_all_ok(task)

    def _finished(self, task: Task) -> None:
        ring = self._ring_tasks.pop(task.task_id, None)
        if ring is not None:
            ring.finished(task)

    # -- lookups answered by the clients ------------------------------------------------------------------
    def fold_lookups(self) -> None:
        """Add what clients counted in their rings since the last fold to the daemon's figures."""
        with self._lock:
            keys, hits = self.local.keys, self.local.hits
            last: tuple[int, int] | None = None
            for ring in list(self.rings.values()):
                if self._fold(ring):
                    last = ring.last_lookup
            added_keys, added_hits = self.local.keys - keys, self.local.hits - hits
        if last is not None:
            metrics = self.engine.metrics
            metrics.lookup_keys.inc(added_keys)
            metrics.lookup_hits.inc(added_hits)
            if last[0]:
                metrics.lookup_hit_rate.set(last[1] / last[0])

    def _fold(self, ring: SessionRing) -> bool:
        """One ring's counts into :attr:`local` (lock held). Checked, they are the client's own numbers:
        never backwards, never more keys than its lookups could carry, never more hits than keys."""
        if ring.closed:
            return False
        lookups, keys, hits, last_keys, last_hits = ring.lookup_counters()
        seen = self._seen.get(id(ring), (0, 0, 0))
        d_lookups, d_keys, d_hits = lookups - seen[0], keys - seen[1], hits - seen[2]
        if d_lookups <= 0 or d_keys < 0 or d_hits < 0:
            return False
        d_keys = min(d_keys, d_lookups * self.engine.config.max_batch_blocks)
        d_hits = min(d_hits, d_keys)
        self._seen[id(ring)] = (lookups, keys, hits)
        self.local.lookups += d_lookups
        self.local.keys += d_keys
        self.local.hits += d_hits
        ring.last_lookup = (last_keys, min(last_hits, last_keys))
        return True

    def _with_local_lookups(self, snap: EngineSnapshot) -> EngineSnapshot:
        self.fold_lookups()
        local = self.local
        return dataclasses.replace(
            snap,
            lookups=snap.lookups + local.lookups,
            lookup_keys=snap.lookup_keys + local.keys,
            lookup_hits=snap.lookup_hits + local.hits,
        )
