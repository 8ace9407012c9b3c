"""``AsyncUcmClient``: the asyncio client of the daemon; ``UcmClient`` (in ``sync.py``) wraps it.

The client holds one gRPC channel and one session (the ``Attach`` stream). Regions are registered
through it and remembered, so when the daemon restarts the client attaches again and re-registers every
region on the next call — callers keep using the same region handles.

A region handle is the client's own id, never reused within a client, mapped to the daemon's current
region id. After a reconnect every mapping is dropped before anything is registered again, and a handle
whose re-registration fails is dead for good (:class:`~ucm_client.errors.RegionLost` on every use): a
handle can never name a region id the new daemon gave to another buffer.

Every RPC goes through one wrapper (:meth:`AsyncUcmClient._rpc`), so errors always arrive as the domain
exceptions of :mod:`ucm_client.errors` carrying the daemon's reason — never a raw ``grpc`` error, also
while the daemon shuts down or restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio

from ucm_client import arguments as args
from ucm_client import tracing
from ucm_client.buffers import SharedBuffer
from ucm_client.cuda_ipc import CudaUnavailable, as_export
from ucm_client.errors import ArgumentTypeError
from ucm_client.handover import hand_over
from ucm_client.region_records import HandleMap, RegionRecord
from ucm_client.task_events import FinishedTasks
from ucm_client.trust import trusted_uids, verify_daemon
from ucm_client.types import (
    BlockIO,
    BlockState,
    LookupResult,
    RetentionResult,
    Segment,
    TaskResult,
    as_segment,
    lookup_result,
)
from ucm_protocol.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    UcmError,
    Unavailable,
    domain_error,
)
from ucm_protocol.paths import target_for
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_protocol.wire import (
    LOAD_PROGRESS_DONE,
    MAX_MESSAGE_BYTES,  # noqa: F401 (kept as ucm_client.client.MAX_MESSAGE_BYTES)
    SESSION_METADATA,
    WAIT_CAP_S,
    bearer_metadata,
    channel_options,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncUcmClient:
    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        client_name: str = "ucm-client",
        connect_timeout_s: float = 5.0,
        rpc_timeout_s: float = 60.0,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        daemon_uid: int | None = None,
    ) -> None:
        """``token`` (default ``$UCM_TOKEN``) is sent as ``authorization: Bearer``; ``tls_ca`` (PEM)
        makes a TLS connection to a TCP target, with ``tls_cert``/``tls_key`` as client certificate.
        On a Unix socket nothing is sent before the daemon proves to run as this process's uid, root,
        or ``daemon_uid`` (default ``$UCM_DAEMON_UID``), see :mod:`ucm_client.trust`."""
        timeouts = {"connect_timeout_s": connect_timeout_s, "rpc_timeout_s": rpc_timeout_s}
        args.client_options(target, client_name, token, daemon_uid, timeouts)
        self.target = target_for(target)
        self._trusted = trusted_uids(daemon_uid)
        self._token = token if token is not None else os.environ.get("UCM_TOKEN") or None
        self._tls = (
            args.read_tls_file(tls_ca, "tls_ca"),
            args.read_tls_file(tls_key, "tls_key"),
            args.read_tls_file(tls_cert, "tls_cert"),
        )
        self.client_name = client_name
        self.connect_timeout_s = float(connect_timeout_s)
        self.rpc_timeout_s = float(rpc_timeout_s)
        self._closed = False
        self._channel: aio.Channel | None = None
        self._kv: rpc.KVStoreStub | None = None
        self._admin: rpc.AdminStub | None = None
        self._session_id: str | None = None
        self._session_task: asyncio.Task[None] | None = None
        self._stream: Any = None
        self._regions: dict[int, RegionRecord] = {}
        self._next_handle = 1
        self._lock: asyncio.Lock | None = None
        self._finished = FinishedTasks()
        self.server_version = ""
        self.store_saturated = False
        """The daemon's word that it cannot keep up with dumps now (``SessionEvent.store_saturated``):
        updated from every session event and Load/Dump answer, so reading it costs no call. A serving
        engine skips the saves it can do without while it is set."""

    # -- connection -----------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._session_id is not None

    async def connect(self) -> None:
        """Open the channel and the session; raises :class:`Unavailable` if no daemon answers."""
        self._check_open()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._session_id is not None:
                return
            await self._close_channel()
            options = channel_options()
            ca, key, cert = self._tls
            if ca is not None:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=ca, private_key=key, certificate_chain=cert
                )
                channel = aio.secure_channel(self.target, creds, options=options)
            else:
                channel = aio.insecure_channel(self.target, options=options)
            if (path := self.socket_path) is not None:
                try:
                    _check_socket(path)
                    await asyncio.to_thread(verify_daemon, path, self._trusted, self.connect_timeout_s)
                except BaseException:
                    await channel.close()
                    raise
            try:
                await asyncio.wait_for(channel.channel_ready(), self.connect_timeout_s)
            except (TimeoutError, asyncio.CancelledError, grpc.RpcError):
                await channel.close()
                raise Unavailable(
                    f"no ucm-server answering at {self.target} (is it running? try `ucm-server`)"
                ) from None
            self._channel = channel
            self._kv = rpc.KVStoreStub(channel)
            self._admin = rpc.AdminStub(channel)
            stream = self._kv.Attach(
                pb.AttachRequest(client_name=self.client_name, pid=os.getpid(), task_events=True),
                metadata=self._auth_metadata(),
            )
            try:
                first = await asyncio.wait_for(stream.read(), self.connect_timeout_s)
            except grpc.RpcError as exc:
                await self._close_channel()
                err = domain_error(exc)
                if isinstance(err, Unavailable):
                    raise Unavailable(f"ucm-server at {self.target} did not open a session: {err}") from None
                raise err from None  # e.g. Unauthenticated: the daemon's reason, as is
            except TimeoutError:
                await self._close_channel()
                raise Unavailable(f"ucm-server at {self.target} did not open a session in time") from None
            if first is aio.EOF:
                await self._close_channel()
                raise Unavailable(f"ucm-server at {self.target} closed the session at once")
            self._session_id = first.session_id
            self.server_version = first.server_version
            self.store_saturated = first.store_saturated
            self._stream = stream
            self._finished.reset(enabled=True)  # task ids restart with a restarted daemon
            self._session_task = asyncio.create_task(self._watch(stream))
            await self._register_again()

    async def _register_again(self) -> None:
        """After a reconnect (a restarted daemon, a lost session): register every live region again.

        Every old mapping is dropped first, so no handle keeps an id the new daemon may hand to other
        memory. A region the daemon refuses now (its memory is gone, say) is marked lost for good; if
        the daemon goes away again meanwhile, the session is closed and the next call starts over.
        """
        live = [(h, r) for h, r in self._regions.items() if r.lost is None]
        for _, record in live:
            record.server_id = None
        for handle, record in live:
            try:
                server_id = await self._register_record(record)
            except Unavailable:
                await self._close_channel()
                raise
            except UcmError as exc:
                record.lost = f"registering it again with the restarted daemon failed: {exc}"
                log.warning("ucm client %s: region handle %d is lost: %s", self.client_name, handle, exc)
                continue
            record.server_id = server_id

    async def _watch(self, stream: Any) -> None:
        """Read the session stream: heartbeats, and the results of this session's tasks as they end."""
        try:
            while (event := await stream.read()) is not aio.EOF:
                self.store_saturated = event.store_saturated
                for status in event.finished:
                    self._finished.deliver(TaskResult.from_pb(status))
                if event.task_events_stopped:
                    self._finished.reset(enabled=False)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            self._session_id = None  # the next call reconnects
            self._finished.reset(enabled=False)

    async def _close_channel(self) -> None:
        """End the session stream, its task and the channel, and let go of the channel here, on the
        client's loop: gRPC tears its asyncio runtime down when the last channel object is freed, in
        whichever thread frees it, closing the completion queue's socket. Freed by a stub left behind
        in the caller's thread, that raced with this loop reading the socket ("Exception in callback
        None() ... Bad file descriptor" at a client's close)."""
        if self._stream is not None:  # end the session stream first: grpc then has no call left pending
            stream, self._stream = self._stream, None
            stream.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stream.code(), 1.0)  # let grpc settle the cancelled call
        if self._session_task is not None:
            self._session_task.cancel()
            await asyncio.gather(self._session_task, return_exceptions=True)
            self._session_task = None
        if self._channel is not None:
            channel, self._channel, self._kv, self._admin = self._channel, None, None, None
            await channel.close()
            del channel
        self._session_id = None

    async def close(self) -> None:
        """End the session for good: later calls raise FailedPrecondition instead of reconnecting
        (as :class:`~ucm_client.sync.UcmClient` does), so a client closed by one part of a program
        cannot quietly open a new session for another."""
        self._closed = True
        await self._close_channel()

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("this AsyncUcmClient is closed; open a new one")

    async def __aenter__(self) -> AsyncUcmClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a channel to the same daemon (None = plaintext / Unix socket)."""
        ca, key, cert = self._tls
        if ca is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _auth_metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._token)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        # tracing.outgoing(): the caller's trace context (W3C traceparent), empty while tracing is off
        return ((SESSION_METADATA, self._session_id or ""), *self._auth_metadata(), *tracing.outgoing())

    async def _call(self, fn: Callable[[], Awaitable[T]], *, retry: bool = True) -> T:
        """Run one RPC; map errors; on a lost daemon or session reconnect once and retry.

        A call made while another coroutine reconnects waits for it (regions are being registered
        again); a failed call only drops the session it ran in, never a newer one.
        """
        self._check_open()
        if self._session_id is None or (self._lock is not None and self._lock.locked()):
            await self.connect()
        session = self._session_id
        try:
            return await self._rpc(fn)
        except (Unavailable, FailedPrecondition) as err:
            if not (retry and _session_lost(err)):
                raise
        if self._session_id == session:
            self._session_id = None
        await self.connect()
        return await self._rpc(fn)

    async def _rpc(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await one RPC, turning every gRPC failure into a :class:`UcmError` (the single place where
        gRPC errors are mapped: a channel closed under the call or a daemon going away included)."""
        try:
            return await fn()
        except grpc.RpcError as exc:
            err = domain_error(exc)
            if isinstance(err, Unavailable):
                raise Unavailable(
                    f"ucm-server at {self.target} is unavailable ({err.message}); "
                    "it may be restarting: the next call reconnects"
                ) from None
            raise err from None
        except aio.UsageError as exc:  # the channel was closed under the call (a reconnect, close())
            raise Unavailable(f"connection to ucm-server at {self.target} was closed: {exc}") from None
        except aio.BaseError as exc:
            raise Internal(f"gRPC failed talking to ucm-server at {self.target}: {exc}") from None

    @property
    def socket_path(self) -> Path | None:
        """The daemon's Unix socket, or None for a TCP target."""
        if self.target.startswith("unix://"):
            return Path(self.target.removeprefix("unix://"))
        if self.target.startswith("unix:"):
            return Path(self.target.removeprefix("unix:"))
        return None

    def verify_daemon(self) -> None:
        """Blocking: check who serves the Unix socket (no-op for TCP); see :mod:`ucm_client.trust`."""
        if (path := self.socket_path) is not None:
            verify_daemon(path, self._trusted, self.connect_timeout_s)

    @property
    def kv(self) -> rpc.KVStoreStub:
        if self._kv is None:
            raise Unavailable(f"not connected to ucm-server at {self.target}")
        return self._kv

    @property
    def admin(self) -> rpc.AdminStub:
        if self._admin is None:
            raise Unavailable("not connected")
        return self._admin

    # -- regions --------------------------------------------------------------------------------------
    async def register(self, buffer: SharedBuffer, size: int | None = None, *, label: str = "") -> int:
        """Register a :class:`SharedBuffer` (its first ``size`` bytes, default all); returns a handle for
        :class:`~ucm_client.types.Segment` ``region``.

        The buffer's memfd itself is handed to the daemon over its fd socket; nothing is named, so only
        memory this process owns can be registered, and only over a local Unix socket."""
        if not isinstance(buffer, SharedBuffer):
            raise InvalidArgument(
                f"register() takes a ucm_client.SharedBuffer, got {type(buffer).__name__}: memory is handed "
                "to the daemon as a sealed memfd, never registered by name"
            )
        size = buffer.size if size is None else args.size_arg(size, "size")
        if not 0 < size <= buffer.size:
            raise InvalidArgument(f"register(size={size}): the buffer holds {buffer.size} bytes")
        if buffer.fileno() < 0:
            raise InvalidArgument(f"{buffer!r} is closed")
        if self.socket_path is None:
            raise PermissionDenied(
                f"memory registration needs a local Unix-socket client; {self.target} is TCP: "
                "use put_blocks/get_blocks"
            )
        record = RegionRecord(size, label or buffer.label, 0, buffer=buffer)

        async def call() -> int:
            return await self._register_record(record)

        record.server_id = await self._call(call)
        handle = self._next_handle
        self._next_handle += 1
        self._regions[handle] = record
        return handle

    async def _register_record(self, record: RegionRecord) -> int:
        """One RegisterRegion for ``record`` (host memory: handed over first); the daemon's region id."""
        token = b""
        if record.cuda is None:
            path = self.socket_path
            assert record.buffer is not None and path is not None
            fd = record.buffer.fileno()
            if fd < 0:
                raise InvalidArgument(f"{record.buffer!r} was closed; it cannot be registered again")
            token = await asyncio.to_thread(
                hand_over, path, fd, record.size, self._trusted, timeout_s=self.rpc_timeout_s
            )
        request = record.request(token)
        call = functools.partial(
            self.kv.RegisterRegion, request, metadata=self._metadata(), timeout=self.rpc_timeout_s
        )
        resp = await self._rpc(call)
        return int(resp.region_id)

    async def register_cuda(self, target: Any, *, label: str = "") -> int:
        """Register GPU memory (a torch CUDA tensor's storage, or a :class:`CudaIpcExport`) by CUDA IPC.

        Returns a region handle like :meth:`register`; segment offsets count from the storage's first
        byte. The daemon opens the handle once and copies with ``cudaMemcpyAsync``. Raises
        ``CudaUnavailable`` (a ``FailedPrecondition``) when this process has no CUDA device, or when
        the daemon cannot serve GPU regions (no cupy, no device, ``gpu: off``: its reason is the
        message), so a caller falls back to host memory on one exception. See :mod:`ucm_client.cuda_ipc`
        for the ordering rules (``producers_done`` before a dump).
        """
        export = as_export(target)
        record = RegionRecord(export.size, label, 0, export)
        try:
            resp = await self._call(
                lambda: self.kv.RegisterRegion(
                    record.request(), metadata=self._metadata(), timeout=self.rpc_timeout_s
                )
            )
        except FailedPrecondition as exc:
            raise CudaUnavailable(exc.message) from None
        record.server_id = resp.region_id
        handle = self._next_handle
        self._next_handle += 1
        self._regions[handle] = record
        return handle

    async def unregister(self, handle: int) -> None:
        """Forget a handle (it is never valid again); a lost one needs no word to the daemon.

        When this returns the daemon no longer touches the memory: tasks of this client still loading
        into or dumping from it are cancelled first (their blocks not yet copied end CANCELLED), so
        the memory can be reused at once."""
        record = self._regions.pop(handle, None)
        if record is None:
            raise InvalidArgument(f"region handle {handle!r} is not registered")
        region_id = record.server_id
        if self._session_id is not None and region_id is not None:
            await self._call(
                lambda: self.kv.UnregisterRegion(
                    pb.UnregisterRegionRequest(region_id=region_id),
                    metadata=self._metadata(),
                    timeout=self.rpc_timeout_s,
                ),
                retry=False,
            )

    def _server_ids(self) -> Mapping[int, int]:
        return HandleMap(self._regions)

    @property
    def kept_results(self) -> int:
        """How many pushed task results are kept for tasks nobody waited on yet (oldest dropped first;
        waiting on a dropped one asks the daemon at once). Settable, e.g. lower in tests."""
        return self._finished.keep

    @kept_results.setter
    def kept_results(self, value: int) -> None:
        self._finished.keep = max(1, int(value))

    # -- the store ------------------------------------------------------------------------------------
    async def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> LookupResult:
        """Which keys the store holds, and how many leading ones (the hit prefix)."""
        request = args.lookup_request(namespace, keys)
        resp = await self._call(
            lambda: self.kv.Lookup(request, metadata=self._metadata(), timeout=self.rpc_timeout_s)
        )
        return lookup_result(resp)

    async def load(
        self, namespace: bytes, blocks: Sequence[BlockIO], *, progress: Segment | None = None
    ) -> int:
        """Start copying blocks from the store into registered memory; returns the task id.

        ``progress``: 8 zeroed bytes of a registered buffer where the daemon counts the segments of
        every block already copied (:mod:`ucm_client.load_progress`). If the daemon does not take
        it (an older one) or the call fails, this client writes ``LOAD_PROGRESS_DONE`` there itself,
        so whoever watches the word goes on to the task's result instead of waiting."""

        def request() -> pb.LoadRequest:  # built per attempt: a reconnect renumbers the regions
            ids = self._server_ids()
            word = None if progress is None else as_segment(progress, ids)
            return pb.LoadRequest(blocks=args.block_batch(namespace, blocks, ids), progress=word)

        try:
            resp = await self._call(
                lambda: self.kv.Load(request(), metadata=self._metadata(), timeout=self.rpc_timeout_s)
            )
        except BaseException:
            self._progress_done(progress)
            raise
        if not resp.progress:
            self._progress_done(progress)
        self.store_saturated = resp.store_saturated
        return self._finished.expect(int(resp.task_id))

    def _progress_done(self, progress: Segment | None) -> None:
        """Write ``LOAD_PROGRESS_DONE`` into a progress word the daemon will not write (only into
        a well-formed word of a registered buffer: a bad one was refused and is left alone)."""
        record = self._regions.get(progress.region) if progress is not None else None
        if progress is None or record is None or record.buffer is None:
            return
        offset = progress.offset
        if progress.length == 8 and offset % 8 == 0 and 0 <= offset <= record.size - 8:
            struct.pack_into("<Q", record.buffer.buf, offset, LOAD_PROGRESS_DONE)

    async def dump(
        self,
        namespace: bytes,
        blocks: Sequence[BlockIO],
        *,
        wait_durable: bool = False,
        cache_only: bool = False,
    ) -> int:
        """Start storing blocks from registered memory; returns the task id. ``cache_only``: keep
        them in the daemon's Cache only, never written to disk (a one-off prompt)."""
        resp = await self._call(
            lambda: self.kv.Dump(
                pb.DumpRequest(
                    blocks=args.block_batch(namespace, blocks, self._server_ids()),
                    wait_durable=bool(wait_durable),
                    cache_only=bool(cache_only),
                ),
                metadata=self._metadata(),
                timeout=self.rpc_timeout_s,
            )
        )
        self.store_saturated = resp.store_saturated
        return self._finished.expect(int(resp.task_id))

    async def prefetch(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        namespace, keys = args.namespace_arg(namespace), args.keys_arg(keys)
        resp = await self._call(
            lambda: self.kv.Prefetch(
                pb.PrefetchRequest(namespace=namespace, keys=keys),
                metadata=self._metadata(),
                timeout=self.rpc_timeout_s,
            )
        )
        return self._finished.expect(int(resp.task_id))

    async def wait(self, task_id: int, timeout_s: float, *, cancel_on_timeout: bool = False) -> TaskResult:
        """Wait up to ``timeout_s`` (may be called again); ``done`` is False if it timed out.

        The daemon pushes each finished task's result on the session stream, so a task that ends
        within the timeout is answered without a ``Wait`` call; otherwise (timeout, events lost, a
        task this client is not waiting for, or one whose result was dropped long ago) the daemon is
        asked, and it also applies ``cancel_on_timeout``.
        """
        task_id = args.task_id_arg(task_id)
        timeout_s = min(max(args.seconds_arg(timeout_s, "timeout_s"), 0.0), WAIT_CAP_S)
        deadline = time.monotonic() + timeout_s
        pushed = await self._finished.wait(task_id, timeout_s)
        if pushed is not None:
            return pushed
        remaining = max(deadline - time.monotonic(), 0.0)
        resp = await self._call(
            lambda: self.kv.Wait(
                pb.WaitRequest(task_id=task_id, timeout_s=remaining, cancel_on_timeout=cancel_on_timeout),
                metadata=self._metadata(),
                timeout=remaining + self.rpc_timeout_s,
            ),
            retry=False,
        )
        return TaskResult.from_pb(resp)

    async def check(self, task_id: int) -> TaskResult:
        """Where the task stands now, without waiting (answered from a pushed result if it ended)."""
        task_id = args.task_id_arg(task_id)
        pushed = self._finished.peek(task_id)
        if pushed is not None:
            return pushed
        resp = await self._call(
            lambda: self.kv.Check(
                pb.TaskHandle(task_id=task_id), metadata=self._metadata(), timeout=self.rpc_timeout_s
            ),
            retry=False,
        )
        return TaskResult.from_pb(resp)

    async def cancel(self, task_id: int) -> TaskResult:
        """Stop a task; when this returns the daemon no longer touches the task's memory."""
        task_id = args.task_id_arg(task_id)
        resp = await self._call(
            lambda: self.kv.Cancel(
                pb.CancelRequest(task_id=task_id), metadata=self._metadata(), timeout=self.rpc_timeout_s
            ),
            retry=False,
        )
        return TaskResult.from_pb(resp)

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        namespace, keys = args.namespace_arg(namespace), args.keys_arg(keys)
        resp = await self._call(
            lambda: self.kv.Delete(
                pb.DeleteRequest(namespace=namespace, keys=keys),
                metadata=self._metadata(),
                timeout=self.rpc_timeout_s,
            )
        )
        return int(resp.deleted)

    async def set_retention(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        *,
        pin: bool | None = None,
        ttl_s: float | None = None,
        priority: int | None = None,
        require_all_tiers: bool = False,
    ) -> RetentionResult:
        """Pin (``pin=True``) or unpin (``False``) stored blocks, expire them ``ttl_s`` seconds from
        now (``0``: never), or set their eviction ``priority`` (-100..100; lower goes first); ``None``
        leaves that part as it is. ``require_all_tiers``: refuse a pin some tier cannot hold."""
        namespace, keys = args.namespace_arg(namespace), args.keys_arg(keys)
        if pin is not None and not isinstance(pin, bool):
            raise ArgumentTypeError(f"pin must be True, False or None, got {type(pin).__name__}")
        if ttl_s is not None:
            ttl_s = args.seconds_arg(ttl_s, "ttl_s")
        if priority is not None:
            priority = args.integer_arg(priority, "priority", -(1 << 31), 1 << 31)
        request = pb.SetRetentionRequest(
            namespace=namespace,
            keys=keys,
            pin=pin is True,
            unpin=pin is False,
            ttl_s=ttl_s or 0.0,
            clear_ttl=ttl_s == 0,
            set_priority=priority is not None,
            priority=priority or 0,
            require_all_tiers=require_all_tiers,
        )
        resp = await self._call(
            lambda: self.kv.SetRetention(request, metadata=self._metadata(), timeout=self.rpc_timeout_s)
        )
        return RetentionResult(int(resp.applied), int(resp.missing), list(resp.not_enforced))

    # -- the slow path (bytes in messages) ----------------------------------------------------------------
    async def put_blocks(self, namespace: bytes, items: Sequence[tuple[bytes, bytes]]) -> TaskResult:
        """Store ``(key, data)`` pairs by sending the bytes over gRPC (slow: for remote clients)."""
        namespace, items = args.namespace_arg(namespace), args.put_items_arg(items)

        async def call() -> pb.PutBlocksReply:
            reqs = [pb.BlockBytes(namespace=namespace, key=k, data=d) for k, d in items]
            reply: pb.PutBlocksReply = await self.kv.PutBlocks(
                iter(reqs), metadata=self._metadata(), timeout=self.rpc_timeout_s
            )
            return reply

        reply = await self._call(call)
        return TaskResult(
            task_id=0,
            done=True,
            cancelled=False,
            states=[BlockState(s) for s in reply.block_status],
            reasons=dict(reply.reasons),
        )

    async def get_blocks(self, namespace: bytes, keys: Sequence[bytes]) -> list[bytes | None]:
        """Fetch blocks' bytes over gRPC (slow path); ``None`` where missing or failed."""
        namespace, keys = args.namespace_arg(namespace), args.keys_arg(keys)

        async def call() -> list[bytes | None]:
            out: list[bytes | None] = [None] * len(keys)
            async for reply in self.kv.GetBlocks(
                pb.GetBlocksRequest(namespace=namespace, keys=keys),
                metadata=self._metadata(),
                timeout=self.rpc_timeout_s,
            ):
                if reply.status == pb.BLOCK_OK:
                    out[reply.index] = reply.data
            return out

        return await self._call(call)

    # -- admin ----------------------------------------------------------------------------------------
    async def stats(self) -> pb.StatsResponse:
        return await self._call(
            lambda: self.admin.Stats(pb.StatsRequest(), metadata=self._metadata(), timeout=self.rpc_timeout_s)
        )


def _check_socket(path: Path) -> None:
    """Say precisely why a Unix socket cannot be used, rather than a generic 'not answering'."""
    if not path.exists():
        raise Unavailable(f"no ucm-server socket at {path} (is it running? try `ucm-server`)")
    if not os.access(path, os.R_OK | os.W_OK):
        st = path.stat()
        raise PermissionDenied(
            f"socket {path} belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:o}; this process "
            f"(uid {os.geteuid()}) may not use it: run as the daemon's user"
        )


def _session_lost(err: UcmError) -> bool:
    return isinstance(err, Unavailable) or "not attached" in err.message
