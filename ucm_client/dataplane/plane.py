"""The blocking client's data plane: its channel to the daemon, kept for the current session.

:class:`~ucm_client.sync.UcmClient` asks this first for ``lookup``, ``load``/``dump`` and their
``wait``/``check``; every method answers ``None`` when the data plane cannot serve the call (a TCP
target, a daemon without one, no compiled helper, ``UCM_DATAPLANE=off``, a lookup the table cannot
answer, a request that does not fit the ring, a channel that ended), and the client then does what
it always did, over gRPC. A refusal is the daemon's, raised as the RPC would raise it.

The channel belongs to one session: after a reconnect (a restarted daemon) the old one is closed
and a new one opened, so nothing mapped from the old daemon is ever read again. A daemon that
refused a channel (an older one, say) is not asked again for :data:`RETRY_S`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ucm_client import tracing
from ucm_client.client import AsyncUcmClient
from ucm_client.dataplane.channel import fetch_table, open_channel
from ucm_client.dataplane.ring import RingClient, RingClosed, Submitted
from ucm_client.dataplane.table import Miss, TableView
from ucm_client.types import BlockIO, BlockState, LookupResult, Segment, TaskResult, as_segment
from ucm_protocol import dataplane as dp
from ucm_protocol.errors import FailedPrecondition, UcmError, Unavailable
from ucm_protocol.native import dataplane_enabled
from ucm_protocol.wire import WAIT_CAP_S

log = logging.getLogger(__name__)

RETRY_S = 30.0
"""How long a client that could not open a channel uses gRPC before it tries again."""
REMEMBERED_TASKS = 1 << 16
"""Tasks of the ring remembered as such (a wait on an older one asks gRPC)."""


class _Channel:
    """One session's ring and table."""

    def __init__(self, session_id: str, ring: RingClient, table: TableView) -> None:
        self.session_id = session_id
        self.ring = ring
        self.table = table
        self.tracked: set[bytes] = set()
        self.tasks: collections.OrderedDict[int, int] = collections.OrderedDict()
        """Tasks submitted through the ring -> their block count (for an all-OK result)."""

    def alive(self) -> bool:
        """The daemon is still at the other end: one peek at the connection, which a daemon that died
        or stopped has closed (a pending doorbell byte is no answer either way: the ring's thread
        reads those at once, and sees the end)."""
        if self.ring.dead:
            return False
        try:
            return self.ring.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.ring.close()
        self.table.close()


class ClientDataPlane:
    def __init__(self, client: AsyncUcmClient, *, enabled: bool = True) -> None:
        self._client = client
        self._enabled = enabled and dataplane_enabled() and client.socket_path is not None
        self._lock = threading.Lock()
        self._channel: _Channel | None = None
        self._retry_at = 0.0
        self._closed = False
        self.lookups_local = 0
        """Lookups answered from the table (a figure for tests and benchmarks)."""

    @property
    def active(self) -> bool:
        return self._channel is not None

    # -- the channel ------------------------------------------------------------------------------------
    def channel(self) -> _Channel | None:
        """The current session's channel, opened if needed; None when the data plane is not to be used."""
        if not self._enabled or self._closed:
            return None
        session_id = self._client._session_id
        ch = self._channel
        if ch is not None and ch.session_id == session_id and ch.alive():
            return ch
        with self._lock:
            ch = self._channel
            if ch is not None and ch.session_id == session_id and ch.alive():
                return ch
            if ch is not None:  # the daemon went away, or this is another session: never read it again
                self._channel = None
                ch.close()
            if session_id is None:
                return None  # not connected: the gRPC path connects, the next call opens a channel
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._channel = self._open(session_id)
            except (UcmError, OSError) as exc:
                self._retry_at = time.monotonic() + RETRY_S
                log.info(
                    "ucm client %s: no data-plane channel (%s); using gRPC", self._client.client_name, exc
                )
                return None
            return self._channel

    def _open(self, session_id: str) -> _Channel:
        c = self._client
        path = c.socket_path
        assert path is not None
        conn, ring, table = open_channel(
            dp.dataplane_socket_path(path), c._trusted, session_id, c._token, c.connect_timeout_s
        )
        try:
            client = RingClient(conn, ring.map, name=c.client_name)
        except BaseException:
            conn.close()
            ring.map.close()
            table.map.close()
            raise
        return _Channel(session_id, client, TableView(table.map, table.generation))

    def _refresh_table(self, ch: _Channel) -> None:
        c = self._client
        path = c.socket_path
        assert path is not None
        try:
            fresh = fetch_table(
                dp.dataplane_socket_path(path), c._trusted, ch.session_id, c._token, c.connect_timeout_s
            )
        except (UcmError, OSError):
            return
        old, ch.table = ch.table, TableView(fresh.map, fresh.generation)
        old.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    # -- lookup -------------------------------------------------------------------------------------------
    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> LookupResult | None:
        if _traced():
            return None
        ch = self.channel()
        if ch is None:
            return None
        answer = ch.table.lookup(namespace, keys)
        if answer is Miss.STALE:
            self._refresh_table(ch)
            answer = ch.table.lookup(namespace, keys)
        if answer is Miss.UNTRACKED and namespace not in ch.tracked:
            ch.tracked.add(namespace)
            ch.ring.track(namespace)
        if isinstance(answer, Miss):
            return None
        prefix, present = answer
        n = len(present)
        hits = n if prefix == n else present.count(1)
        ch.ring.count_lookup(n, hits)
        self.lookups_local += 1
        if prefix == n:
            return LookupResult(present=[True] * n, hit_prefix=n)
        return LookupResult(present=np.frombuffer(present, np.bool_).tolist(), hit_prefix=prefix)

    # -- load and dump --------------------------------------------------------------------------------------
    def submit(
        self,
        op: int,
        namespace: bytes,
        blocks: Sequence[BlockIO],
        *,
        durable: bool = False,
        cache_only: bool = False,
        progress: Segment | None = None,
    ) -> concurrent.futures.Future[Submitted] | None:
        """A Load/Dump through the ring: the future of its answer, or None (use gRPC). A call made
        inside a traced span goes by gRPC, whose metadata carries the span's context to the daemon
        (its task span is then the caller's child)."""
        if type(namespace) is not bytes or _traced():
            return None
        ch = self.channel()
        if ch is None:
            return None
        c = self._client
        ids = {
            h: r.server_id for h, r in list(c._regions.items()) if r.lost is None and r.server_id is not None
        }
        word = None
        if progress is not None:
            try:
                seg = as_segment(progress, ids)
            except (UcmError, KeyError, TypeError, ValueError, AttributeError):
                return None  # the checked path names what is wrong with it
            word = (seg.region_id, seg.offset, seg.length)
        try:
            future = ch.ring.submit(
                op,
                namespace,
                blocks,
                ids,
                flags=(dp.SQF_DURABLE if durable else 0) | (dp.SQF_CACHE_ONLY if cache_only else 0),
                progress=word,
                timeout_s=c.rpc_timeout_s,
            )
        except RingClosed:
            return None
        if future is not None:
            nblocks = len(blocks)
            future.add_done_callback(lambda f: self._note(ch, f, nblocks))
        return future

    @staticmethod
    def _note(ch: _Channel, future: concurrent.futures.Future[Submitted], nblocks: int) -> None:
        if not future.cancelled() and future.exception() is None:
            ch.tasks[future.result().task_id] = nblocks
            while len(ch.tasks) > REMEMBERED_TASKS:  # older ones are answered by gRPC, as any task
                ch.tasks.popitem(last=False)

    # -- results ------------------------------------------------------------------------------------------
    def owns(self, task_id: object) -> bool:
        """Whether ``task_id`` was submitted through the ring of the current session's channel (task
        ids start again with a restarted daemon: an old channel's are never answered from)."""
        ch = self._channel
        return (
            ch is not None
            and type(task_id) is int
            and task_id in ch.tasks
            and ch.session_id == self._client._session_id
        )

    def _owner(self, task_id: int) -> _Channel | None:
        return self._channel if self.owns(task_id) else None

    def wait(self, task_id: int, timeout_s: float) -> tuple[TaskResult | None, float]:
        """The task's result if it ended all OK within ``timeout_s``; else None and the time left to
        ask gRPC with (it ended otherwise, timed out, or is not this channel's: ``timeout_s`` as
        given, which gRPC checks)."""
        ch = self._owner(task_id)
        if ch is None or type(timeout_s) not in (int, float) or math.isnan(timeout_s):
            return None, timeout_s
        seconds = min(max(float(timeout_s), 0.0), WAIT_CAP_S)
        start = time.monotonic()
        local = self._result(ch, task_id, ch.ring.wait_finished(task_id, seconds))
        return local, max(seconds - (time.monotonic() - start), 0.0)

    def check(self, task_id: int) -> TaskResult | None:
        ch = self._owner(task_id)
        if ch is None:
            return None
        return self._result(ch, task_id, ch.ring.peek_finished(task_id))

    @staticmethod
    def _result(ch: _Channel, task_id: int, done: object) -> TaskResult | None:
        from ucm_client.dataplane.ring import Finished

        if not isinstance(done, Finished) or not done.all_ok:
            return None
        nblocks = ch.tasks.get(task_id, done.nblocks)
        return TaskResult(
            task_id=task_id,
            done=True,
            cancelled=False,
            states=[BlockState.OK] * nblocks,
            bytes_done=done.bytes_done,
            elapsed_s=done.elapsed_s,
        )

    def answer(
        self,
        sent: concurrent.futures.Future[Submitted],
        by_grpc: Callable[[], concurrent.futures.Future[int]],
        progress: Segment | None,
    ) -> concurrent.futures.Future[int]:
        """The task id of a request sent through the ring. A refusal is the daemon's, as the RPC's
        would be, except a lost session or a channel that ended: the request then goes by gRPC
        (``by_grpc``, which reconnects; nothing was submitted). The answer's back-pressure flag is
        the client's, as a ``TaskHandle``'s is; a progress word the daemon did not take reads DONE."""
        client = self._client
        out: concurrent.futures.Future[int] = concurrent.futures.Future()

        def settle(f: concurrent.futures.Future[Submitted]) -> None:
            exc = f.exception()
            if exc is not None and refusal_needs_grpc(exc) and not self._closed:
                try:
                    again = by_grpc()
                except BaseException as late:  # the client was closed meanwhile
                    out.set_exception(late)
                    return
                again.add_done_callback(lambda g: _copy_outcome(g, out))
                return
            if exc is not None:
                client._progress_done(progress)
                out.set_exception(exc)
                return
            submitted = f.result()
            client.store_saturated = submitted.store_saturated
            # A task that does not end all OK is pushed on the session stream as a gRPC one is, and
            # the client's wait takes it from there if it came, else asks the daemon. It is not
            # expected there: one that ends all OK is never pushed, and a wait after its end was
            # dropped from the ring would wait out its timeout for a push that never comes.
            if progress is not None and not submitted.progress:
                client._progress_done(progress)
            out.set_result(submitted.task_id)

        sent.add_done_callback(settle)
        return out


def _traced() -> bool:
    """A call made inside a traced span goes by gRPC: its metadata carries the span's context, so the
    daemon's spans (the call's, its task's) are that span's children, as without the data plane."""
    return tracing.enabled() and bool(tracing.outgoing())


def _copy_outcome(source: concurrent.futures.Future[int], target: concurrent.futures.Future[int]) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def refusal_needs_grpc(exc: BaseException) -> bool:
    """A ring refusal that the gRPC path handles better: the session is gone (it reconnects), or the
    daemon is stopping."""
    return isinstance(exc, Unavailable) or (
        isinstance(exc, FailedPrecondition) and "not attached" in exc.message
    )
