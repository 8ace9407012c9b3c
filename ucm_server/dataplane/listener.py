"""The data-plane socket (``<socket path>.dp``): a session's ring and presence table handed to its client.

A client proves here what it proves on every gRPC call: the session id it got from ``Attach`` and,
on a daemon with tokens, its bearer token (the same :class:`~ucm_server.auth.Authenticator` checks
it, and the session must be that token's tenant's). The kernel tells the rest: the peer must run as
the daemon's uid or root (``SO_PEERCRED``), as on the fd socket. The socket is mode 0600 in the
daemon's 0700 directory.

Whatever arrives (garbage, half a hello, a token past :data:`~ucm_protocol.dataplane.MAX_TOKEN_BYTES`,
nothing at all) is answered with a status and a reason, or dropped after
:data:`CONNECTION_TIMEOUT_S`; at most :data:`MAX_HANDSHAKES` connections wait at once. A session gets
one channel; the connection that carried it stays open as the doorbell.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import grpc

from ucm_protocol import dataplane as dp
from ucm_protocol.errors import InvalidArgument, PermissionDenied, UcmError
from ucm_protocol.fdpass import peer_credentials
from ucm_server.handover import accepted, listen_private, ready_for, stop_listening

log = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 64


class Handshakes(Protocol):
    """What the listener asks of the data plane (:class:`ucm_server.dataplane.service.DataPlane`)."""

    def open_channel(
        self, session_id: str, token: str, conn: socket.socket
    ) -> tuple[list[int], bytes, Callable[[bool], None]]:
        """The descriptors and info for a new channel, and what to call once the reply went out
        (True) or could not (False); takes ``conn`` over (it stays open as the doorbell)."""

    def fetch_table(self, session_id: str, token: str) -> tuple[list[int], bytes]:
        """The descriptor and info of the session's current table."""


class DataPlaneListener:
    def __init__(
        self, path: Path, handshakes: Handshakes, *, timeout_s: float = CONNECTION_TIMEOUT_S
    ) -> None:
        self.path = path
        self.handshakes = handshakes
        self.timeout_s = timeout_s
        self.uid = os.geteuid()
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    def bind(self) -> None:
        """Create the socket, mode 0600 (the daemon checked its directory and cleared a stale one)."""
        self._sock = listen_private(self.path)

    async def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._accepting = asyncio.create_task(self._accept_loop())

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._conns) if t is not None]
        await stop_listening(self._sock, self.path, tasks)
        self._sock = None

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        async for conn in accepted(self._sock, "data-plane socket"):
            if len(self._conns) >= MAX_HANDSHAKES:
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        kept = False
        try:
            conn.setblocking(False)
            try:
                hello = await asyncio.wait_for(self._read_hello(conn), self.timeout_s)
            except TimeoutError:
                return
            if hello is None:
                return
            kind, session_id, token = hello
            ready: Callable[[bool], None] | None = None
            try:
                self._check_peer(conn)
                if kind == dp.KIND_CHANNEL:
                    fds, info, ready = self.handshakes.open_channel(session_id, token, conn)
                    kept = True
                elif kind == dp.KIND_TABLE:
                    fds, info = self.handshakes.fetch_table(session_id, token)
                else:
                    raise InvalidArgument(f"unknown data-plane request kind {kind}")
            except UcmError as exc:
                await self._reply(
                    conn, int(exc.code.value[0]), kind, exc.message.encode()[: dp.MAX_REASON_BYTES]
                )
                return
            sent = False
            try:
                await self._reply(conn, 0, kind, info, fds)
                sent = True
            finally:
                for fd in fds:
                    os.close(fd)
                if ready is not None:
                    ready(sent)  # the ring starts serving, or is closed (and the connection with it)
        except (OSError, asyncio.CancelledError):
            pass
        except Exception:  # never let one connection take the listener down
            log.exception("data-plane socket: unexpected error")
        finally:
            if not kept:
                conn.close()

    def _check_peer(self, conn: socket.socket) -> None:
        peer = peer_credentials(conn)
        if peer.uid not in (self.uid, 0):
            raise PermissionDenied(
                f"process {peer.pid} runs as uid {peer.uid}; this daemon (uid {self.uid}) serves its data "
                "plane only to its own uid or root"
            )

    async def _read_hello(self, conn: socket.socket) -> tuple[int, str, str] | None:
        loop = asyncio.get_running_loop()
        head = await _read_exactly(loop, conn, dp.HELLO.size)
        if head is None:
            return None
        magic, version, kind, token_len, session = dp.HELLO.unpack(head)
        if magic != dp.HELLO_MAGIC or version != dp.VERSION:
            await self._reply(
                conn, int(grpc.StatusCode.INVALID_ARGUMENT.value[0]), 0, b"not a UCM data-plane hello"
            )
            return None
        if token_len > dp.MAX_TOKEN_BYTES:
            reason = f"token of {token_len} bytes; at most {dp.MAX_TOKEN_BYTES}".encode()
            await self._reply(conn, int(grpc.StatusCode.INVALID_ARGUMENT.value[0]), kind, reason)
            return None
        token = await _read_exactly(loop, conn, token_len) if token_len else b""
        if token is None:
            return None
        return kind, session.rstrip(b"\0").decode("ascii", "replace"), token.decode("utf-8", "replace")

    async def _reply(
        self, conn: socket.socket, status: int, kind: int, payload: bytes, fds: list[int] | None = None
    ) -> None:
        message = dp.REPLY.pack(dp.REPLY_MAGIC, status, kind, len(payload)) + payload
        await asyncio.wait_for(_send(conn, message, fds or []), self.timeout_s)


async def _send(conn: socket.socket, message: bytes, fds: list[int]) -> None:
    """All of ``message``, the descriptors with its first byte."""
    loop = asyncio.get_running_loop()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    while message:
        try:
            sent = conn.sendmsg([message], ancillary)
        except BlockingIOError:
            await ready_for(loop, conn, write=True)
            continue
        message, ancillary = message[sent:], []


async def _read_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(conn, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
