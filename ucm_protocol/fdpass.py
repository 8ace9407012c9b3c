"""The fd socket's wire format, shared by the daemon and its clients.

Host memory reaches the daemon as a file descriptor, never by name: the client connects to the
daemon's second Unix socket, ``<socket path>.fds``, and sends one request of :data:`REQUEST` bytes with
exactly one sealed memfd attached (``SCM_RIGHTS``). The daemon answers one reply (:data:`REPLY` header,
then ``length`` bytes: a 16-byte token when ``status`` is 0, else a UTF-8 reason; ``status`` is the gRPC
status code value of the refusal) and closes the connection. The token then goes in
``RegisterRegionRequest.memfd_token``.

Both ends check the other: the daemon reads the client's ``SO_PEERCRED`` (uid and pid) and the client
the daemon's, before anything is sent.

The socket is shared by every local process, so the daemon shares it out by peer: a client sends its
request whole, in one message with its descriptor, at once (the daemon waits a second at most), and
a connection of a process holding more than its share may be closed unanswered to make room for
another process (then connect again). See :mod:`ucm_server.handover` for the limits.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path

REQUEST = struct.Struct("!4sB3xQ")  # magic, version, declared size in bytes
REQUEST_MAGIC = b"UCMF"
REPLY = struct.Struct("!4sBH")  # magic, status (0 = OK, else a grpc.StatusCode value), payload length
REPLY_MAGIC = b"UCMR"
VERSION = 1
TOKEN_BYTES = 16
MAX_REPLY_PAYLOAD = 4096
FD_SOCKET_SUFFIX = ".fds"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def fd_socket_path(grpc_socket: Path) -> Path:
    """Where the daemon listening on ``grpc_socket`` takes file descriptors."""
    return Path(str(grpc_socket) + FD_SOCKET_SUFFIX)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """Who is at the other end of a Unix socket, as the kernel saw it at ``connect``/``listen``."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)
