"""Who serves this socket? The client's check before it sends a token or hands over memory.

A Unix socket path proves nothing by itself: whoever could create it (or its directory) may be
listening, collecting the bearer token and the memory of every client that connects. So before the
first byte goes out the client checks

- the socket's directory: owned by a trusted uid and writable by nobody else (else another user could
  have swapped the socket), and
- the listening process itself: ``SO_PEERCRED`` of a probe connection says its uid, which must be
  trusted.

Trusted uids: this process's effective uid, root, and the uid configured as ``daemon_uid`` (or
``$UCM_DAEMON_UID``) for a daemon that runs as a dedicated user. A mismatch raises
:class:`~ucm_protocol.errors.PermissionDenied` naming the socket, the uid found and the uids expected.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from ucm_protocol.errors import InvalidArgument, PermissionDenied, Unavailable
from ucm_protocol.fdpass import peer_credentials

DAEMON_UID_ENV = "UCM_DAEMON_UID"


def trusted_uids(daemon_uid: int | None = None) -> frozenset[int]:
    """This process's euid, root, and ``daemon_uid`` (default ``$UCM_DAEMON_UID``)."""
    uids = {os.geteuid(), 0}
    if daemon_uid is None and (env := os.environ.get(DAEMON_UID_ENV, "").strip()):
        try:
            daemon_uid = int(env)
        except ValueError:
            raise InvalidArgument(f"{DAEMON_UID_ENV}={env!r}: expected a numeric uid") from None
    if daemon_uid is not None:
        uids.add(daemon_uid)
    return frozenset(uids)


def _expected(trusted: frozenset[int]) -> str:
    return " or ".join(str(u) for u in sorted(trusted))


def check_socket_dir(path: Path, trusted: frozenset[int]) -> None:
    """The directory holding the socket must be a trusted uid's, not writable by group or others."""
    directory = path.parent
    try:
        st = directory.stat()
    except OSError as exc:
        raise Unavailable(f"socket directory {directory}: {exc.strerror}") from None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted:
        raise PermissionDenied(
            f"socket {path}: its directory belongs to uid {st.st_uid}, expected uid {_expected(trusted)}; "
            f"refusing to talk to a daemon another user may control (set daemon_uid / {DAEMON_UID_ENV} "
            "if the daemon runs as that user)"
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise PermissionDenied(
            f"socket {path}: its directory {directory} has mode {mode:04o} (writable by other users, who "
            f"could replace the socket); expected 0700: chmod 700 {directory}"
        )


def check_peer(sock: socket.socket, path: Path, trusted: frozenset[int]) -> None:
    """The process at the other end of ``sock`` must run as a trusted uid."""
    peer = peer_credentials(sock)
    if peer.uid not in trusted:
        raise PermissionDenied(
            f"socket {path} is served by process {peer.pid} running as uid {peer.uid}, expected uid "
            f"{_expected(trusted)}; nothing was sent (set daemon_uid / {DAEMON_UID_ENV} if the daemon "
            "runs as that user)"
        )


def verify_daemon(path: Path, trusted: frozenset[int], timeout_s: float = 5.0) -> None:
    """Check the socket's directory and the uid of the process listening on it; send nothing."""
    check_socket_dir(path, trusted)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(timeout_s)
    try:
        try:
            probe.connect(str(path))
        except OSError as exc:
            raise Unavailable(
                f"no ucm-server answering at {path} ({exc.strerror or exc}; is it running? try `ucm-server`)"
            ) from None
        check_peer(probe, path, trusted)
    finally:
        probe.close()
