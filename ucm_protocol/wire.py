"""Wire constants both ends must agree on: metadata names, the message size limit, channel options.

Each used to be written out on both sides (and the bearer header three times); a change now reaches
the daemon and every client at once.
"""

from __future__ import annotations

SESSION_METADATA = "ucm-session"
"""Metadata entry carrying the session id from ``Attach`` on every KVStore call that needs one."""

AUTH_METADATA = "authorization"
"""Metadata entry carrying ``Bearer <token>`` for daemons that require tokens."""

MAX_MESSAGE_BYTES = 512 << 20
"""Largest gRPC message either side sends or accepts (PutBlocks/GetBlocks carry payloads inline)."""

PRIORITY_MIN, PRIORITY_MAX = -100, 100
"""The eviction priorities a block may have (``Retention.priority``): the daemon refuses others, and
``ucm-admin`` checks them before anything is sent (a number past int32 cannot even be encoded)."""

WAIT_CAP_S = 3600.0
"""The longest one ``Wait`` lasts: the daemon waits at most this long, and the client asks for no more,
so an infinite timeout keeps a finite gRPC deadline (waiting again is always allowed)."""


def channel_options() -> list[tuple[str, int]]:
    """The gRPC channel/server options that apply :data:`MAX_MESSAGE_BYTES` in both directions."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <token>`` as call metadata, or nothing when there is no token."""
    return ((AUTH_METADATA, f"Bearer {token}"),) if token else ()


LOAD_PROGRESS_DONE = (1 << 64) - 1
"""Value of a Load's progress word (``LoadRequest.progress``) once its task has ended, whatever the
outcome; below it, the word counts the leading segments of every block already copied."""
