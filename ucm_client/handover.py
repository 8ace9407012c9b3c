"""Hand a memfd to the daemon over its fd socket (``SCM_RIGHTS``) and get the token to register it.

Blocking and short (one small message each way on a local socket), so the async client runs it in a
thread. The daemon's uid is checked (``SO_PEERCRED``) before the descriptor is sent; see
:mod:`ucm_client.trust` and, for the wire format, :mod:`ucm_protocol.fdpass`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc

from ucm_client.trust import check_peer
from ucm_protocol.errors import InvalidArgument, UcmError, Unavailable, error_for_status
from ucm_protocol.fdpass import (
    MAX_REPLY_PAYLOAD,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    TOKEN_BYTES,
    VERSION,
    fd_socket_path,
)

_CODES = {int(c.value[0]): c for c in grpc.StatusCode}


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def hand_over(
    grpc_socket: Path, fd: int, size: int, trusted: frozenset[int], *, timeout_s: float = 10.0
) -> bytes:
    """Send ``fd`` (a memfd sealed against shrinking, ``size`` bytes, every page allocated) to the
    daemon; its token. Memory with holes is refused here already, naming them: the daemon refuses
    it too (pages it touched first would be charged to it)."""
    st = os.fstat(fd)
    if st.st_blocks * 512 < st.st_size:
        raise InvalidArgument(
            f"the memory has holes: only {st.st_blocks * 512} of {st.st_size} bytes are allocated; "
            "allocate all of it (posix_fallocate, as SharedBuffer does) and keep it allocated while "
            "the daemon holds it"
        )
    path = fd_socket_path(grpc_socket)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise Unavailable(
                f"the daemon's fd socket {path} does not answer ({exc.strerror or exc}); is the daemon at "
                f"{grpc_socket} a ucm-server of this version?"
            ) from None
        check_peer(sock, path, trusted)  # raises before anything is sent
        try:
            socket.send_fds(sock, [REQUEST.pack(REQUEST_MAGIC, VERSION, size)], [fd])
            header = _recv_exactly(sock, REPLY.size)
            if len(header) < REPLY.size:
                raise Unavailable(f"the daemon closed its fd socket {path} without answering")
            magic, status, length = REPLY.unpack(header)
            if magic != REPLY_MAGIC or length > MAX_REPLY_PAYLOAD:
                raise Unavailable(f"{path} answered something that is not a UCM fd reply")
            payload = _recv_exactly(sock, length)
        except OSError as exc:
            raise Unavailable(f"handing memory to the daemon over {path} failed: {exc}") from None
    finally:
        sock.close()
    if status != 0:
        code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
        err: UcmError = error_for_status(code, payload.decode(errors="replace"))
        raise err
    if len(payload) != TOKEN_BYTES:
        raise Unavailable(f"{path} answered a token of {len(payload)} bytes")
    return payload
