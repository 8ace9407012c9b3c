"""One session's ring, the daemon's side: Load/Dump requests in, their answers out, no gRPC call.

The client writes a request's body into the ring's arena and a 64-byte entry into the submission
queue, then rings the doorbell (a byte on the session's data-plane connection). The daemon takes
the entries in order, each one *copied out of the shared memory before anything in it is checked*
(a client changing its ring meanwhile changes nothing the daemon decided on), and hands it to the
engine exactly as the ``Load``/``Dump`` RPC would: same checks, same session and tenant, same
errors. It answers in the completion queue: the task id (or the refusal: status and reason), and
later the task's end (all OK, or "ask ``Check``" for per-block states and reasons).

Everything in the ring is hostile input. Indices are free-running counters checked against the queue
sizes; an entry's body must lie inside the arena and have exactly the size its counts imply; the
request's limits are the RPC's (``max_batch_blocks``, ``max_segments_per_request``) and the arena's
size bounds any copy. A client that corrupts its indices loses its ring (the daemon closes the
channel; its gRPC calls keep working); one that never reads its completions stops being served
(the daemon holds at most a queue's worth of answers, then takes no more requests) but costs
nothing else. The connection ending (the client died) ends the ring; its tasks run on in the
session as any task does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import mmap
import os
import secrets
import socket
from collections.abc import Callable

import grpc
import numpy as np

from ucm_protocol import dataplane as dp
from ucm_protocol.errors import InvalidArgument, UcmError
from ucm_protocol.keys import KEY_BYTES, NAMESPACE_BYTES, PackedDigests
from ucm_protocol.native import native
from ucm_protocol.states import BlockState
from ucm_protocol.wire import AUTH_METADATA
from ucm_server.auth import Principal
from ucm_server.authz import DATA_PLANE, enter
from ucm_server.dataplane.memory import sealed_memfd
from ucm_server.engine import Engine
from ucm_server.tasks import Task, TaskKind, TaskState

log = logging.getLogger(__name__)

SQ_ENTRIES = 256
CQ_ENTRIES = 1024
"""Room for an answer and an end for every entry of a full submission queue, twice."""
_U32 = 0xFFFFFFFF
_KINDS = {dp.OP_LOAD: TaskKind.LOAD, dp.OP_DUMP: TaskKind.DUMP}


def ended_all_ok(task: Task) -> bool:
    """The task ended with every block OK: its ring entry says all there is to say of it."""
    return task.state == TaskState.DONE and task.states.count(BlockState.OK) == task.nblocks


def token_metadata(token: str) -> list[tuple[str, str]]:
    """The metadata a gRPC call with this bearer token carries (none without one)."""
    return [(AUTH_METADATA, f"Bearer {token}")] if token else []


class RingBroken(Exception):
    """The client wrote something into its ring's indices that cannot be: its ring is closed."""


def ring_layout(arena_bytes: int) -> tuple[int, int, int, int, int]:
    """(sq_at, cq_at, msg_at, arena_at, total bytes) of a ring with an arena of ``arena_bytes``."""
    sq_at = dp.RING_HEADER_BYTES
    cq_at = sq_at + SQ_ENTRIES * dp.SQE_BYTES
    msg_at = cq_at + CQ_ENTRIES * dp.CQE_BYTES
    arena_at = dp.page_align(msg_at + CQ_ENTRIES * dp.MESSAGE_BYTES)
    return sq_at, cq_at, msg_at, arena_at, dp.page_align(arena_at + arena_bytes)


class SessionRing:
    """The ring memory of one session and the loop that serves it."""

    def __init__(
        self,
        engine: Engine,
        session_id: str,
        token: str,
        conn: socket.socket,
        arena_bytes: int,
        *,
        on_close: Callable[[SessionRing], None],
        on_track: Callable[[Principal, bytes], None],
        on_submitted: Callable[[SessionRing, Task], None],
    ) -> None:
        assert native is not None
        self.engine = engine
        self.session_id = session_id
        self._metadata = token_metadata(token)
        """The caller's credentials, as a gRPC call of the session would carry them: every request in
        the ring is authorized again, as that call would be (a token revoked since is refused)."""
        self.conn = conn
        self.generation = secrets.randbits(63) or 1
        self._on_close = on_close
        self._on_track = on_track
        self._on_submitted = on_submitted
        self.last_lookup = (0, 0)
        """The keys and hits of the client's latest lookup answered from the table (its numbers)."""
        sq_at, cq_at, msg_at, arena_at, size = ring_layout(arena_bytes)
        self._sq_at, self._cq_at, self._msg_at, self._arena_at = sq_at, cq_at, msg_at, arena_at
        self.arena_bytes = arena_bytes
        self.size = size

        # The client writes its requests here, so no write seal; a fixed size, so no SIGBUS.
        def header(m: mmap.mmap) -> None:
            dp.RING_HEADER.pack_into(
                m, 0, dp.RING_MAGIC, dp.VERSION, dp.RING_HEADER_BYTES, self.generation,
                SQ_ENTRIES, CQ_ENTRIES, sq_at, cq_at, msg_at, arena_at, arena_bytes,
            )  # fmt: skip

        self.fd, self.map = sealed_memfd("ucmd-ring", size, header, read_only=False)
        self._sq_head = 0  # the daemon's own copies: never read back from the shared memory
        self._cq_tail = 0
        self._backlog: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._worker: asyncio.Task[None] | None = None
        self._bell_due = False
        self.tasks: dict[int, int] = {}
        """Tasks this ring submitted and not yet reported ended: task id -> the request's user data."""
        self.closed = False
        self.reason = ""

    def dup_fd(self) -> int:
        """A descriptor of the ring's memory for the client (the caller closes it once sent)."""
        return os.dup(self.fd)

    # -- the doorbell ------------------------------------------------------------------------------------
    def start(self) -> None:
        self.conn.setblocking(False)
        asyncio.get_running_loop().add_reader(self.conn.fileno(), self._readable)

    def _readable(self) -> None:
        """Bytes from the client: doorbells (their number does not matter), or the end of it."""
        try:
            while True:
                data = self.conn.recv(4096, socket.MSG_DONTWAIT)
                if not data:
                    self.close("the client closed its data-plane connection")
                    return
        except BlockingIOError:
            pass
        except OSError as exc:
            self.close(f"the data-plane connection failed: {exc}")
            return
        self.kick()

    def kick(self) -> None:
        """Serve what is queued (also flushes held answers); one worker per ring, requests in order."""
        if self.closed:
            return
        self._flush_backlog()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve())

    def tick(self) -> None:
        """The daemon's upkeep pass: answers held back by a full queue go out as it empties, and a
        worker that stopped for them resumes."""
        if self._backlog:
            self._flush_backlog()
            if len(self._backlog) < CQ_ENTRIES and (self._worker is None or self._worker.done()):
                self.kick()

    def _ring_bell(self) -> None:
        self._bell_due = False
        if self.closed:
            return
        with contextlib.suppress(BlockingIOError, InterruptedError):
            try:
                self.conn.send(dp.DOORBELL, socket.MSG_DONTWAIT)  # a full buffer: a bell is pending anyway
            except OSError as exc:
                if not isinstance(exc, BlockingIOError):
                    self.close(f"the data-plane connection failed: {exc}")

    # -- requests -------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        try:
            while not self.closed and len(self._backlog) < CQ_ENTRIES:
                entry = self._take()
                if entry is None:
                    return
                await self._handle(entry)
        except RingBroken as exc:
            self.close(str(exc))
        except Exception:
            log.exception("data plane: ring of session %s failed", self.session_id[:8])
            self.close("internal error serving the ring")

    def _take(self) -> bytes | None:
        """The next submission entry, copied out; None when the queue is empty."""
        assert native is not None
        tail = native.load_u32(self.map, dp.R_SQ_TAIL)
        waiting = (tail - self._sq_head) & _U32
        if waiting == 0:
            return None
        if waiting > SQ_ENTRIES:
            raise RingBroken(
                f"submission tail {tail} is {waiting} entries ahead of the head (at most {SQ_ENTRIES})"
            )
        at = self._sq_at + (self._sq_head % SQ_ENTRIES) * dp.SQE_BYTES
        entry = self.map[at : at + dp.SQE_BYTES]
        self._sq_head = (self._sq_head + 1) & _U32
        native.store_u32(self.map, dp.R_SQ_HEAD, self._sq_head)
        return entry

    async def _handle(self, entry: bytes) -> None:
        op, flags, _, nblocks, user_data, body_at, body_len, nseg, _, p_region, p_offset, p_length = (
            dp.SQE.unpack(entry)
        )
        if op == dp.OP_TRACK:  # the namespace in the progress word's place: no body, no answer
            with contextlib.suppress(UcmError):  # a token refused now: nothing tracked, no answer due
                principal = self._admit("channel")
                self._on_track(principal, p_region.to_bytes(8, "little") + p_offset.to_bytes(8, "little"))
            return
        kind = _KINDS.get(op)
        try:
            if kind is None:
                raise InvalidArgument(f"unknown data-plane request {op}")
            self._admit("load" if kind is TaskKind.LOAD else "dump")
            body = self._body(body_at, body_len, nblocks, nseg, bool(flags & dp.SQF_MULTI))
            task = await self._submit(kind, flags, body, nblocks, nseg, (p_region, p_offset, p_length))
            saturated = self.engine.poll_store_saturated()
        except UcmError as exc:
            self._post(dp.CQ_REFUSED, user_data, status=int(exc.code.value[0]), reason=exc.message)
            return
        except Exception:
            log.exception("data plane: a request of session %s failed", self.session_id[:8])
            self._post(
                dp.CQ_REFUSED,
                user_data,
                status=int(grpc.StatusCode.INTERNAL.value[0]),
                reason="internal error",
            )
            return
        self.tasks[task.task_id] = user_data
        self._on_submitted(self, task)
        self._post(
            dp.CQ_SUBMITTED,
            user_data,
            task_id=task.task_id,
            progress=task.reports_progress,
            nblocks=nblocks,
            saturated=saturated,
        )

    def _admit(self, entry: str) -> Principal:
        """Authorize a request as its RPC would be (:data:`~ucm_server.authz.DATA_PLANE`), and make
        the grant this worker's: the engine reads it as it reads a call's."""
        grant = self.engine.authz.admit(DATA_PLANE[entry], self._metadata, local=True)
        assert grant is not None
        enter(grant)
        return grant.principal

    def _body(self, at: int, length: int, nblocks: int, nseg: int, multi: bool) -> bytes:
        """The request's body, checked against the arena and its own counts, copied out. Only what
        reading it needs is checked here; the engine checks the request as it checks the RPC's (and
        names what is wrong the same way)."""
        if not multi and nseg != nblocks:
            raise InvalidArgument(f"{nseg} segments for {nblocks} blocks of one segment each")
        want = dp.body_bytes(nblocks, nseg, multi)
        if length != want or at % 8 or at < 0 or at > self.arena_bytes - length:
            raise InvalidArgument(
                f"request body of {length} bytes at arena offset {at}: {want} bytes inside the "
                f"{self.arena_bytes}-byte arena expected"
            )
        start = self._arena_at + at
        return self.map[start : start + length]

    async def _submit(
        self, kind: TaskKind, flags: int, body: bytes, nblocks: int, nseg: int, progress: tuple[int, int, int]
    ) -> Task:
        ns = body[:NAMESPACE_BYTES]
        keys_end = NAMESPACE_BYTES + KEY_BYTES * nblocks
        keys = PackedDigests(body[NAMESPACE_BYTES:keys_end])
        at = keys_end
        counts: list[int] = []
        if flags & dp.SQF_MULTI:
            counts = np.frombuffer(body, "<u4", nblocks, at).tolist()
            at += (4 * nblocks + 7) & ~7
        columns = np.frombuffer(body, "<u8", 3 * nseg, at).reshape(3, nseg)
        regions, offsets, lengths = (c.tolist() for c in columns)
        return await self.engine.submit_io(
            kind,
            self.session_id,
            ns,
            keys,
            counts,
            regions,
            offsets,
            lengths,
            durable=bool(flags & dp.SQF_DURABLE),
            cache_only=kind is TaskKind.DUMP and bool(flags & dp.SQF_CACHE_ONLY),
            progress=progress if kind is TaskKind.LOAD and flags & dp.SQF_PROGRESS else None,
        )

    # -- answers --------------------------------------------------------------------------------------
    def finished(self, task: Task) -> None:
        """A task of this ring ended: say so (all OK, or not: then the client asks ``Check``)."""
        user_data = self.tasks.pop(task.task_id, None)
        if user_data is None or self.closed:
            return
        all_ok = ended_all_ok(task)
        self._post(
            dp.CQ_FINISHED,
            user_data,
            task_id=task.task_id,
            state=int(task.state),
            all_ok=all_ok,
            bytes_done=task.bytes_done,
            elapsed_s=task.elapsed_s,
            nblocks=task.nblocks,
        )

    def _post(
        self,
        kind: int,
        user_data: int,
        *,
        status: int = 0,
        task_id: int = 0,
        state: int = 0,
        all_ok: bool = False,
        progress: bool = False,
        bytes_done: int = 0,
        elapsed_s: float = 0.0,
        nblocks: int = 0,
        saturated: bool = False,
        reason: str = "",
    ) -> None:
        message = reason.encode(errors="replace")[: dp.MESSAGE_BYTES]
        entry = dp.CQE.pack(
            user_data,
            kind,
            state,
            all_ok,
            progress,
            status,
            task_id,
            bytes_done,
            elapsed_s,
            len(message),
            nblocks,
            saturated,
        )
        self._backlog.append((entry, message))
        self._flush_backlog()

    def _flush_backlog(self) -> None:
        """Answers into the completion queue while it has room (the client frees it as it reads)."""
        assert native is not None
        if not self._backlog or self.closed:
            return
        head = native.load_u32(self.map, dp.R_CQ_HEAD)
        posted = False
        while self._backlog:
            used = (self._cq_tail - head) & _U32
            if used >= CQ_ENTRIES:  # full, or a head the client scribbled: it only delays its own answers
                break
            entry, message = self._backlog.popleft()
            slot = self._cq_tail % CQ_ENTRIES
            at = self._cq_at + slot * dp.CQE_BYTES
            self.map[at : at + dp.CQE_BYTES] = entry
            if message:
                m_at = self._msg_at + slot * dp.MESSAGE_BYTES
                self.map[m_at : m_at + len(message)] = message
            self._cq_tail = (self._cq_tail + 1) & _U32
            native.store_u32(self.map, dp.R_CQ_TAIL, self._cq_tail)  # after the entry (release)
            posted = True
        if posted and not self._bell_due:
            self._bell_due = True
            asyncio.get_running_loop().call_soon(self._ring_bell)  # one bell for this loop pass's answers

    def lookup_counters(self) -> tuple[int, int, int, int, int]:
        """The client's counts of lookups it answered from the table (its numbers: check them)."""
        assert native is not None
        m = self.map
        return (
            native.load_u64(m, dp.R_LOOKUPS),
            native.load_u64(m, dp.R_LOOKUP_KEYS),
            native.load_u64(m, dp.R_LOOKUP_HITS),
            native.load_u64(m, dp.R_LAST_KEYS),
            native.load_u64(m, dp.R_LAST_HITS),
        )

    # -- the end ----------------------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        if self.closed:
            return
        self._on_close(self)  # first: the service reads the ring's last counters
        self.closed = True
        self.reason = reason
        log.info("data plane: ring of session %s closed: %s", self.session_id[:8], reason)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        if (
            self._worker is not None
            and not self._worker.done()
            and self._worker is not asyncio.current_task()
        ):
            self._worker.cancel()
        self.conn.close()
        self.tasks.clear()
        self._backlog.clear()
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
