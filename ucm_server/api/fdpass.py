"""Moved to :mod:`ucm_protocol.fdpass`; this path re-exports the same names and is kept until 0.2."""

from __future__ import annotations

from ucm_protocol.fdpass import (
    FD_SOCKET_SUFFIX,
    MAX_REPLY_PAYLOAD,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    TOKEN_BYTES,
    VERSION,
    PeerCredentials,
    fd_socket_path,
    peer_credentials,
)

__all__ = [
    "FD_SOCKET_SUFFIX",
    "MAX_REPLY_PAYLOAD",
    "REPLY",
    "REPLY_MAGIC",
    "REQUEST",
    "REQUEST_MAGIC",
    "TOKEN_BYTES",
    "VERSION",
    "PeerCredentials",
    "fd_socket_path",
    "peer_credentials",
]
