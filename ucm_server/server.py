"""Run the daemon: the gRPC server on uvloop, health and reflection, signals and a clean shutdown.

Shutdown order (SIGTERM or SIGINT): health goes NOT_SERVING and new tasks are refused; running tasks
get ``grace_s`` to finish (the rest are cancelled between chunks, so no block is left half-written);
the gRPC server stops; write-back drains into the lower tiers; the tiers close. A block is visible in a
persistent tier only once complete (temp file, fsync, rename), so even ``kill -9`` at any point leaves
nothing torn behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import signal
import socket
import stat
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ucm_protocol.dataplane import dataplane_socket_path
from ucm_protocol.errors import ConfigError
from ucm_protocol.fdpass import fd_socket_path
from ucm_protocol.ucm.v1 import ucm_pb2, ucm_pb2_grpc
from ucm_protocol.wire import (
    MAX_MESSAGE_BYTES,  # noqa: F401 (kept as ucm_server.server.MAX_MESSAGE_BYTES)
    channel_options,
)
from ucm_server import tracing
from ucm_server.auth import Authenticator
from ucm_server.config import ServerConfig
from ucm_server.dataplane import make_dataplane
from ucm_server.directories import make_private_dirs
from ucm_server.engine import Engine
from ucm_server.handover import HandoverListener
from ucm_server.kv_events.publisher import kv_event_publisher
from ucm_server.service.admin import AdminServicer
from ucm_server.service.interceptors import ErrorMappingInterceptor
from ucm_server.service.kvstore import KVStoreServicer

log = logging.getLogger(__name__)

SERVICES = ("ucm.v1.KVStore", "ucm.v1.Admin")


def _prepare_socket_dir(directory: Path) -> None:
    """The socket's directory must be the daemon's alone (owner = our euid, mode 0700): whoever else
    can write there could replace the socket with their own and collect clients' tokens and memory.
    Created 0700 when missing (its parents normally); an existing one is never changed, only checked."""
    euid = os.geteuid()
    if not directory.exists():
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass  # created concurrently: checked below like any existing directory
        except OSError as exc:
            raise ConfigError(f"socket directory {directory}: cannot create it: {exc.strerror}") from exc
    try:
        st = directory.stat()
    except OSError as exc:
        raise ConfigError(f"socket directory {directory}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {directory} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != euid or mode & 0o077:
        raise ConfigError(
            f"socket directory {directory} has owner uid {st.st_uid} and mode {mode:04o}; it must be owned "
            f"by this daemon's uid {euid} with mode 0700, so no other user can replace the socket. Fix: "
            f"chown {euid} {directory} && chmod 700 {directory} (or choose another --socket)"
        )


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket nobody listens on (left by a crash); refuse a live one and anything that is not
    a socket (a regular file named by mistake is never deleted)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kinds = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}
        kind = kinds.get(stat.S_IFMT(st.st_mode), "not a socket")
        raise ConfigError(
            f"socket {path} exists and is {kind}, not a socket; refusing to remove it: "
            "choose another --socket, or move the file away yourself"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left over from a crash
    else:
        raise ConfigError(f"socket {path}: another ucm-server is already listening there")
    finally:
        probe.close()


def _prepare_socket(path: Path) -> None:
    """Check (or create) the socket's 0700 directory and clear stale sockets (gRPC, fd and data
    plane), refusing a live one."""
    _prepare_socket_dir(path.parent)
    _clear_stale_socket(path)
    _clear_stale_socket(fd_socket_path(path))
    _clear_stale_socket(dataplane_socket_path(path))


def _lock_dir(path: Path) -> int:
    """An exclusive lock on ``path/.ucm.lock`` for the daemon's lifetime: two daemons sharing a data
    directory would each index and evict the other's files."""
    try:
        make_private_dirs(path)
        fd = os.open(path / ".ucm.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"directory {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"directory {path} is in use by another ucm-server (lock {path / '.ucm.lock'})"
        ) from None
    return fd


def _tls_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    try:
        key = Path(config.tls_key).read_bytes()
        cert = Path(config.tls_cert).read_bytes()
        ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    except OSError as exc:
        raise ConfigError(f"TLS file {exc.filename}: {exc.strerror}") from exc
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


class Daemon:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        tracing.start(config)  # before the engine: its tiers and tasks are traced from the start
        self.authenticator = (
            Authenticator.from_file(Path(config.auth_tokens_file)) if config.auth_tokens_file else None
        )
        self.engine = Engine(config, authenticator=self.authenticator)
        self.server = aio.server(
            interceptors=[
                *tracing.interceptors(),  # outermost: its span sees the status code errors become
                ErrorMappingInterceptor(self.engine.metrics, self.engine.authz),
            ],
            options=[
                *channel_options(),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.health = health.aio.HealthServicer()
        self._stop = asyncio.Event()
        self.metrics_port: int | None = None
        self.tcp_port: int | None = None
        self._locks: list[int] = []
        self.fds = HandoverListener(fd_socket_path(config.socket), self.engine.handovers)
        self.kv_events = kv_event_publisher(  # checks its settings; binds nothing until start()
            config,
            self.engine.pipeline,
            {t for t in self.authenticator.tenants if t} if self.authenticator is not None else None,
            lambda ns: self.engine.ledger.owner_of(ns) if self.engine.ledger is not None else None,
        )
        self.dataplane = make_dataplane(config, self.engine, self.authenticator)

    async def start(self, *, own_process: bool = False) -> None:
        """``own_process``: the daemon is the process (``ucm-server``), so it may tune the process's
        garbage collector (:func:`settle_heap`); a daemon started inside a test's process does not."""
        cfg = self.config
        roots = {cfg.data_dir, *(cfg.posix_roots if "Posix" in cfg.tiers else [])}
        self._locks = [_lock_dir(p) for p in sorted(roots)]
        if cfg.metrics_address not in ("", "off"):  # bind before serving: a busy port fails cleanly
            try:
                self.metrics_port = self.engine.metrics.serve(cfg.metrics_address)
            except OSError as exc:
                raise ConfigError(f"metrics_address {cfg.metrics_address}: {exc.strerror}") from exc
        await self.engine.open()
        ucm_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(self.engine), self.server)
        ucm_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.engine), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [ucm_pb2.DESCRIPTOR.services_by_name[s.split(".")[-1]].full_name for s in SERVICES]
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )

        _prepare_socket(cfg.socket)
        if self.kv_events is not None:  # after the socket checks; what the tiers re-adopted is announced
            self.kv_events.start()
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            self.server.add_insecure_port(f"unix://{cfg.socket}")
        finally:
            os.umask(old_umask)
        if cfg.listen:
            if cfg.tls_cert:
                self.tcp_port = self.server.add_secure_port(cfg.listen, _tls_credentials(cfg))
            else:
                log.warning(
                    "TCP listener %s has no TLS (insecure: true): anyone who can reach it can read the cache",
                    cfg.listen,
                )
                self.tcp_port = self.server.add_insecure_port(cfg.listen)
            if cfg.tcp_anonymous:
                log.warning(
                    "TCP listener %s accepts anonymous peers (allow_anonymous_tcp: true): anyone who can "
                    "reach it can read, overwrite and delete the default tenant's blocks (Admin calls are "
                    "refused to them); set auth_tokens_file or tls_client_ca to require credentials",
                    cfg.listen,
                )
            host = cfg.listen.rpartition(":")[0]
            log.info("listening on tcp %s:%d (%s)", host, self.tcp_port, "TLS" if cfg.tls_cert else "no TLS")
        self.fds.bind()  # before gRPC serves, so a client that sees the socket finds the fd socket too
        if self.dataplane is not None:
            self.dataplane.bind()
        await self.server.start()
        os.chmod(cfg.socket, 0o600)
        await self.fds.start()
        if self.dataplane is not None:
            await self.dataplane.start()
        if own_process:
            settle_heap()  # before SERVING: no client waits for the collection
        for name in ("", *SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ucm-server %s ready on unix://%s%s, pipeline %s (pid %d)",
            self.engine.version,
            cfg.socket,
            f" and {cfg.listen}" if cfg.listen else "",
            self.engine.pipeline.spec,
            os.getpid(),
        )

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_until_stopped(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        log.info("shutting down: finishing running tasks (up to %.0fs)", grace_s)
        await self.health.enter_graceful_shutdown()
        await self.engine.stop_serving(grace_s)
        await self.server.stop(1.0)
        await self.fds.close()
        if self.dataplane is not None:
            await self.dataplane.close()
        await self.engine.close(grace_s)
        if self.kv_events is not None:
            await self.kv_events.close()
        with contextlib.suppress(FileNotFoundError):
            self.config.socket.unlink()
        for fd in self._locks:  # the data directories are free for the next daemon
            os.close(fd)
        self._locks = []
        tracing.stop()  # exports the spans still queued
        log.info("stopped")


async def run(config: ServerConfig) -> None:
    daemon = Daemon(config)
    if daemon.authenticator is not None:
        log.info("token authentication on: %d tenant(s)", len(daemon.authenticator.tenants))
    await daemon.start(own_process=True)
    await daemon.serve_until_stopped()


GC_YOUNG_OBJECTS = 5000
"""Allocations between two young-generation collections (Python's default: 700)."""


def settle_heap() -> None:
    """Take what start-up built (modules, gRPC, the configuration: hundreds of thousands of objects
    that live as long as the daemon) out of the collector's sight, and collect the young
    generation less often. A full collection walked all of it: ~50 ms with the event loop stopped,
    every few hundred milliseconds of small-block copies (each block's lease, entry and views are
    a few short-lived objects), a tenth of a 64 KiB-block Dump's time; ~7 ms once frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
