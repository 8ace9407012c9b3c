"""The client's end of the data-plane handshake: a session's ring and presence table, mapped.

Blocking and short (one small message each way on a local socket). Like the fd socket, the daemon's
uid is checked (``SO_PEERCRED``) before anything is sent: the bearer token goes out only to the
daemon this client trusts. The ring is mapped read-write (the client writes its requests there); the
table read-only, from a read-only descriptor of a memfd the daemon sealed against writes.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

from ucm_client.trust import check_peer
from ucm_protocol import dataplane as dp
from ucm_protocol.errors import UcmError, Unavailable, error_for_status

_CODES = {int(c.value[0]): c for c in grpc.StatusCode}
MAX_FDS = 4


@dataclass(slots=True)
class Mapped:
    """A memfd mapped, with the generation the daemon named for it."""

    map: mmap.mmap
    generation: int
    size: int


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise Unavailable("the daemon closed its data-plane socket without answering")
        data += chunk
    return data


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def handshake(
    path: Path, trusted: frozenset[int], kind: int, session_id: str, token: str | None, timeout_s: float
) -> tuple[socket.socket, list[int], bytes]:
    """Send the hello; the connection, the descriptors and the info the daemon answered."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    fds: list[int] = []
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise Unavailable(
                f"the daemon's data-plane socket {path} does not answer ({exc.strerror or exc})"
            ) from None
        check_peer(sock, path, trusted)  # raises before anything is sent
        secret = (token or "").encode()
        hello = dp.HELLO.pack(dp.HELLO_MAGIC, dp.VERSION, kind, len(secret), session_id.encode()[:32])
        try:
            sock.sendall(hello + secret)
            head = b""
            space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            while len(head) < dp.REPLY.size:
                chunk, ancillary, _flags, _ = sock.recvmsg(dp.REPLY.size - len(head), space)
                for level, ctype, data in ancillary:
                    if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(data[: len(data) - len(data) % got.itemsize])
                        fds.extend(got)
                if not chunk:
                    raise Unavailable(f"the daemon closed its data-plane socket {path} without answering")
                head += chunk
            magic, status, _kind, length = dp.REPLY.unpack(head)
            if magic != dp.REPLY_MAGIC or length > max(dp.MAX_REASON_BYTES, 1024):
                raise Unavailable(f"{path} answered something that is not a UCM data-plane reply")
            payload = _recv_exactly(sock, length)
        except OSError as exc:
            raise Unavailable(f"the data-plane handshake over {path} failed: {exc}") from None
        if status != 0:
            err: UcmError = error_for_status(
                _CODES.get(status, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace")
            )
            raise err
        return sock, fds, payload
    except BaseException:
        _close_all(fds)
        sock.close()
        raise


def map_fd(fd: int, size: int, generation: int, *, writable: bool, magic: bytes) -> Mapped:
    """Map ``size`` bytes of ``fd`` (then closed) and check it is what the daemon said."""
    try:
        if os.fstat(fd).st_size < size or size < 4096:
            raise Unavailable("the daemon handed over memory smaller than it said")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    if mm[:8] != magic or int.from_bytes(mm[16:24], "little") != generation:
        mm.close()
        raise Unavailable("the daemon handed over memory that is not what it said (magic or generation)")
    return Mapped(mm, generation, size)


def open_channel(
    path: Path, trusted: frozenset[int], session_id: str, token: str | None, timeout_s: float
) -> tuple[socket.socket, Mapped, Mapped]:
    """The session's channel: its connection (kept open: doorbell and sign of life), ring, table."""
    sock, fds, info = handshake(path, trusted, dp.KIND_CHANNEL, session_id, token, timeout_s)
    try:
        if len(fds) != 2 or len(info) != dp.CHANNEL_INFO.size:
            raise Unavailable("the daemon's data-plane reply carries the wrong descriptors")
        ring_gen, ring_size, table_gen, table_size = dp.CHANNEL_INFO.unpack(info)
        ring_fd, table_fd = fds
        fds = []
        try:
            ring = map_fd(ring_fd, ring_size, ring_gen, writable=True, magic=dp.RING_MAGIC)
        except BaseException:
            os.close(table_fd)
            raise
        try:
            table = map_fd(table_fd, table_size, table_gen, writable=False, magic=dp.TABLE_MAGIC)
        except BaseException:
            ring.map.close()
            raise
    except BaseException:
        _close_all(fds)
        sock.close()
        raise
    sock.settimeout(None)
    sock.setblocking(True)
    return sock, ring, table


def fetch_table(
    path: Path, trusted: frozenset[int], session_id: str, token: str | None, timeout_s: float
) -> Mapped:
    """The session's current table (the one held was superseded)."""
    sock, fds, info = handshake(path, trusted, dp.KIND_TABLE, session_id, token, timeout_s)
    sock.close()
    if len(fds) != 1 or len(info) != dp.TABLE_INFO.size:
        _close_all(fds)
        raise Unavailable("the daemon's data-plane reply carries the wrong descriptors")
    generation, size = dp.TABLE_INFO.unpack(info)
    return map_fd(fds[0], size, generation, writable=False, magic=dp.TABLE_MAGIC)
