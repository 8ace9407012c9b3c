"""The admin tool's line to the daemon: one gRPC channel, opened on first use, errors made domain errors.

``ucm-admin`` needs no session (it registers no memory), so it does not use :class:`UcmClient`'s
``Attach`` stream: it speaks to the Admin, KVStore and Health services on a plain blocking channel.
Connecting checks the socket first, so "daemon not running" is told apart from "wrong path" and
"permission denied" with a message that says what to do.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ucm_client.admin.errors import DaemonUnreachable
from ucm_client.trust import trusted_uids, verify_daemon
from ucm_protocol.errors import Unavailable, domain_error
from ucm_protocol.paths import default_socket_path, server_config_path, socket_from_config, target_for
from ucm_protocol.wire import bearer_metadata

T = TypeVar("T")
CONNECTIVITY_POLL_S = 0.25
"""A little over grpc's connectivity poll period (0.2 s in ``grpc._channel._poll_connectivity``)."""
START_HINT = (
    "start it with `ucm-server`, or point --socket/--target/--config (or $UCM_SOCKET, $UCM_SERVER_CONFIG) "
    "at a running one"
)


def resolve_target(socket: str | None, target: str | None, config: str | None = None) -> str:
    """The gRPC target: ``--target`` > ``--socket`` > the socket of the daemon config ``--config`` >
    ``$UCM_TARGET`` > the socket of the daemon config ``$UCM_SERVER_CONFIG`` (the file ``ucm-server``
    reads when started without ``--config``: the image sets it, so ``docker exec ... ucm-admin stats``
    needs no flag) > ``$UCM_SOCKET`` > the default path.

    ``--config`` resolves the socket exactly as ``ucm-server --config FILE`` does (file, then
    ``$UCM_SOCKET``, then the default), so a container health check reading the same file and environment
    as the daemon probes the socket the daemon really listens on. Only the socket is read: the daemon
    reports the file's other mistakes when it starts. Raises ``ConfigError`` (a ValueError) when the file
    is missing, unreadable or not YAML.
    """
    if target:
        return target_for(target)
    if socket:
        return target_for(socket if socket.startswith(("/", ".", "unix:")) else f"./{socket}")
    if config:
        return target_for(socket_from_config(Path(config)))
    if env := os.environ.get("UCM_TARGET"):
        return target_for(env)
    if server_config := server_config_path():
        return target_for(socket_from_config(server_config))
    return target_for(default_socket_path())


def socket_path(target: str) -> Path | None:
    """The filesystem path of a ``unix:`` target, None for TCP."""
    if target.startswith("unix://"):
        return Path(target.removeprefix("unix://"))
    if target.startswith("unix:"):
        return Path(target.removeprefix("unix:"))
    return None


def check_socket(path: Path) -> None:
    """Raise :class:`DaemonUnreachable` with the precise reason when ``path`` cannot be a live socket."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DaemonUnreachable(
            f"no ucm-server socket at {path} (is the daemon running? {START_HINT})"
        ) from None
    except PermissionError:
        raise DaemonUnreachable(
            f"permission denied reading {path} (the daemon runs as another user?)"
        ) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnreachable(f"{path} exists but is not a socket; {START_HINT}")
    if not os.access(path, os.R_OK | os.W_OK):
        raise DaemonUnreachable(f"permission denied on socket {path} (mode 0600: run as the daemon's user)")


class Daemon:
    """A lazily opened channel to ``target``; every call has ``timeout_s`` as its deadline."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None

    def channel(self) -> grpc.Channel:
        """The ready channel; raises :class:`DaemonUnreachable` if nothing answers within the timeout."""
        if self._channel is not None:
            return self._channel
        path = socket_path(self.target)
        if path is not None:
            check_socket(path)
            try:  # who serves the socket, before a token goes out (PermissionDenied if not trusted)
                verify_daemon(path, trusted_uids(), self.timeout_s)
            except Unavailable as exc:
                raise DaemonUnreachable(f"{exc} ({START_HINT})") from None
        channel = grpc.insecure_channel(self.target)
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            # Stop the future's connectivity polling first: closing the channel under it made grpc's
            # polling thread print a traceback ("Exception in thread ... (_run)") next to our message.
            # The thread notices the cancel at its next poll (every 0.2 s) and ends.
            ready.cancel()
            time.sleep(CONNECTIVITY_POLL_S)
            channel.close()
            where = f"socket {path}" if path is not None else self.target
            raise DaemonUnreachable(
                f"no ucm-server answering at {where} within {self.timeout_s:g}s "
                f"(a stale socket left by a crashed daemon? {START_HINT})"
            ) from None
        self._channel = channel
        return channel

    @property
    def admin(self) -> Any:
        return _stubs().AdminStub(self.channel())

    @property
    def kv(self) -> Any:
        return _stubs().KVStoreStub(self.channel())

    @property
    def health(self) -> Any:
        from grpc_health.v1 import health_pb2_grpc

        return health_pb2_grpc.HealthStub(self.channel())

    def call(self, method: Callable[..., T], request: Any) -> T:
        """One unary RPC with the deadline; a gRPC error becomes the daemon's domain error."""
        try:
            return method(request, timeout=self.timeout_s, metadata=_auth_metadata())
        except grpc.RpcError as exc:
            raise domain_error(exc) from None

    def stream(self, method: Callable[..., Iterator[T]], request: Any) -> Iterator[T]:
        """A server stream with no overall deadline (verify can take long); errors mapped as above."""
        try:
            yield from method(request, metadata=_auth_metadata())
        except grpc.RpcError as exc:
            raise domain_error(exc) from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    """``$UCM_TOKEN`` as a bearer token, for daemons that require one (admin commands need an admin token)."""
    token = os.environ.get("UCM_TOKEN")
    return bearer_metadata(token)


def _stubs() -> Any:
    """The generated gRPC module (untyped: mypy treats it as Any), imported at first use."""
    from ucm_protocol.ucm.v1 import ucm_pb2_grpc

    return ucm_pb2_grpc
