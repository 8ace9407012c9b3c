"""``UcmClient``: the blocking client, for code that is not async (vLLM's connector, scripts).

It runs an :class:`AsyncUcmClient` on a private event loop in a daemon thread and forwards each call,
so both APIs share one implementation (and one session). Thread-safe: calls from several threads are
serialised by the loop, not by a lock held across the network. On a Unix socket, lookups and
Load/Dump go through the daemon's local data plane where it can serve them (:mod:`ucm_client.dataplane`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from ucm_client import arguments as args
from ucm_client import tracing
from ucm_client.buffers import SharedBuffer
from ucm_client.client import AsyncUcmClient
from ucm_client.client_loop import close_at_exit, shared_loop
from ucm_client.dataplane.plane import ClientDataPlane
from ucm_client.types import (
    BlockIO,
    LookupResult,
    RetentionResult,
    Segment,
    TaskResult,
    lookup_result,
)
from ucm_protocol import dataplane as dp
from ucm_protocol.errors import FailedPrecondition, Unavailable, domain_error
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc

T = TypeVar("T")


class UcmClient:
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
        dataplane: bool = True,
    ) -> None:
        """Same arguments as :class:`AsyncUcmClient` (timeouts checked before the loop thread starts).

        ``dataplane``: on a Unix socket, look up from the daemon's shared table and send Load/Dump
        through a shared ring, without a gRPC call (:mod:`ucm_client.dataplane`; also off with
        ``UCM_DATAPLANE=off``). Where the data plane cannot serve a call, gRPC does."""
        # Built here, before the loop is taken: a refused argument (a missing TLS file) starts nothing.
        self._async = AsyncUcmClient(
            target,
            client_name=client_name,
            connect_timeout_s=connect_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            daemon_uid=daemon_uid,
        )
        self._loop = shared_loop()
        self._closed = False
        self._calls: set[concurrent.futures.Future[Any]] = set()
        """This client's calls still running on the shared loop (close() cancels them)."""
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._plane = ClientDataPlane(self._async, enabled=dataplane)
        close_at_exit(self)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it (:meth:`_submit`)."""
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the client's loop; a closed client says so (a typed error), rather than
        asyncio's "Event loop is closed" and a coroutine reported as never awaited."""
        if self._closed:
            coro.close()
            raise FailedPrecondition("this UcmClient is closed; open a new one")
        call = asyncio.run_coroutine_threadsafe(tracing.carry(coro), self._loop)  # the caller's trace too
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def target(self) -> str:
        return self._async.target

    @property
    def connected(self) -> bool:
        return self._async.connected

    @property
    def aio(self) -> AsyncUcmClient:
        """The async client underneath (its coroutines must run on this client's loop)."""
        return self._async

    def connect(self) -> UcmClient:
        self._run(self._async.connect())
        return self

    def close(self) -> None:
        """End the session and its channels; calls still running (``*_nowait``) are cancelled. The
        loop goes on serving the process's other clients (:mod:`ucm_client.client_loop`)."""
        if self._closed:
            return
        self._closed = True
        self._plane.close()
        if self._channel is not None:
            self._channel.close()
        for call in list(self._calls):
            call.cancel()
        self._on_loop(self._async.close(), timeout=10)

    def __enter__(self) -> UcmClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, buffer: SharedBuffer, size: int | None = None, *, label: str = "") -> int:
        return self._run(self._async.register(buffer, size, label=label))

    def register_cuda(self, target: Any, *, label: str = "") -> int:
        """GPU memory by CUDA IPC (see :meth:`AsyncUcmClient.register_cuda`); exported in this thread."""
        from ucm_client.cuda_ipc import as_export

        return self._run(self._async.register_cuda(as_export(target), label=label))

    def unregister(self, handle: int) -> None:
        self._run(self._async.unregister(handle))

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> LookupResult:
        """Answered on a plain blocking channel, not through the event-loop thread: this is the
        scheduler's hot path (one call per request), where a thread hop would cost as much as the call."""
        if self._closed:  # before a channel is opened: a closed client never opens a new one
            raise FailedPrecondition("this UcmClient is closed; open a new one")
        local = self._plane.lookup(namespace, keys)  # from the daemon's shared table, when it can tell
        if local is not None:
            return local
        if self._stub is None:
            self._async.verify_daemon()  # who serves the socket, before the token goes out
            creds = self._async.channel_credentials()
            target = self._async.target
            self._channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
            self._stub = rpc.KVStoreStub(self._channel)
        request = args.lookup_request(namespace, keys)  # a caller's mistake is named, not "closed"
        try:
            resp = self._stub.Lookup(
                request,
                metadata=(*self._async._auth_metadata(), *tracing.outgoing()),
                timeout=self._async.rpc_timeout_s,
            )
        except grpc.RpcError as exc:
            err = domain_error(exc)
            if isinstance(err, Unavailable):
                raise Unavailable(f"ucm-server at {self.target} is unavailable ({err.message})") from None
            raise err from None
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!": closed by another thread
            raise FailedPrecondition(f"this UcmClient is closed: {exc}") from None
        return lookup_result(resp)

    def load(self, namespace: bytes, blocks: Sequence[BlockIO], *, progress: Segment | None = None) -> int:
        return self.load_nowait(namespace, blocks, progress=progress).result()

    def load_nowait(
        self, namespace: bytes, blocks: Sequence[BlockIO], *, progress: Segment | None = None
    ) -> concurrent.futures.Future[int]:
        """Send a ``Load`` without waiting for the daemon's answer; its task id (or the error that
        refused it) lands in the future. Loads sent one after another reach the daemon in that order.

        The vLLM connector sends a step's loads this way and lets the forward start at once: the
        round trip overlaps the forward instead of preceding it (one per layer with ``use_layerwise``:
        about eight milliseconds on a small CPU). ``progress``: see
        :meth:`AsyncUcmClient.load`."""
        if self._closed:
            raise FailedPrecondition("this UcmClient is closed; open a new one")

        def by_grpc() -> concurrent.futures.Future[int]:
            return self._submit(self._async.load(namespace, blocks, progress=progress))

        sent = self._plane.submit(dp.OP_LOAD, namespace, blocks, progress=progress)
        return by_grpc() if sent is None else self._plane.answer(sent, by_grpc, progress)

    def dump(
        self,
        namespace: bytes,
        blocks: Sequence[BlockIO],
        *,
        wait_durable: bool = False,
        cache_only: bool = False,
    ) -> int:
        """Store blocks from registered memory (see :meth:`AsyncUcmClient.dump`); returns the task id."""
        return self.dump_nowait(namespace, blocks, wait_durable=wait_durable, cache_only=cache_only).result()

    def dump_nowait(
        self,
        namespace: bytes,
        blocks: Sequence[BlockIO],
        *,
        wait_durable: bool = False,
        cache_only: bool = False,
    ) -> concurrent.futures.Future[int]:
        """Send a ``Dump`` without waiting for the daemon's answer (the task id, or the error that
        refused it, lands in the future), in order with this client's other calls. The vLLM
        connector saves a step's new blocks this way, so no step waits for a round trip of a save."""
        if self._closed:
            raise FailedPrecondition("this UcmClient is closed; open a new one")

        def by_grpc() -> concurrent.futures.Future[int]:
            dump = self._async.dump(namespace, blocks, wait_durable=wait_durable, cache_only=cache_only)
            return self._submit(dump)

        sent = self._plane.submit(
            dp.OP_DUMP, namespace, blocks, durable=bool(wait_durable), cache_only=bool(cache_only)
        )
        return by_grpc() if sent is None else self._plane.answer(sent, by_grpc, None)

    @property
    def store_saturated(self) -> bool:
        """The daemon says it cannot keep up with dumps now (:attr:`AsyncUcmClient.store_saturated`)."""
        return self._async.store_saturated

    def prefetch(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return self._run(self._async.prefetch(namespace, keys))

    def prefetch_nowait(self, namespace: bytes, keys: Sequence[bytes]) -> concurrent.futures.Future[int]:
        """Send a ``Prefetch`` without waiting for its answer (the task id, or the error, lands in
        the future): a caller on a latency-critical path, like vLLM's scheduler, does not pay the
        round trip for a task it never waits for."""
        return self._submit(self._async.prefetch(namespace, keys))

    def wait(self, task_id: int, timeout_s: float, *, cancel_on_timeout: bool = False) -> TaskResult:
        """A task sent through the ring that ended all OK is answered here; anything else asks the
        daemon (with the time left), as before."""
        local, timeout_s = self._plane.wait(task_id, timeout_s)
        if local is not None:
            return local
        return self._run(self._async.wait(task_id, timeout_s, cancel_on_timeout=cancel_on_timeout))

    def check(self, task_id: int) -> TaskResult:
        local = self._plane.check(task_id)
        return local if local is not None else self._run(self._async.check(task_id))

    def cancel(self, task_id: int) -> TaskResult:
        return self._run(self._async.cancel(task_id))

    def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        return self._run(self._async.delete(namespace, keys))

    def set_retention(
        self,
        namespace: bytes,
        keys: Sequence[bytes],
        *,
        pin: bool | None = None,
        ttl_s: float | None = None,
        priority: int | None = None,
        require_all_tiers: bool = False,
    ) -> RetentionResult:
        """:meth:`AsyncUcmClient.set_retention`, blocking."""
        return self._run(
            self._async.set_retention(
                namespace, keys, pin=pin, ttl_s=ttl_s, priority=priority, require_all_tiers=require_all_tiers
            )
        )

    def put_blocks(self, namespace: bytes, items: Sequence[tuple[bytes, bytes]]) -> TaskResult:
        return self._run(self._async.put_blocks(namespace, items))

    def get_blocks(self, namespace: bytes, keys: Sequence[bytes]) -> list[bytes | None]:
        return self._run(self._async.get_blocks(namespace, keys))

    def stats(self) -> pb.StatsResponse:
        return self._run(self._async.stats())
