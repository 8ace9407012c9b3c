"""Who can reach the KV event sockets, and which audience (:mod:`.audience`) each connection is.

Two ways, chosen by the settings:

* **Without CURVE** every connection of an endpoint pair is one audience, fixed by the transport:
  ``ipc://`` (and ``local``, an ipc socket in the daemon's private socket directory) gets
  :data:`~.audience.ALL` — its socket file is 0600 in a directory only the daemon's uid (or root)
  can write, so only the daemon's own uid connects, the uid that already administers the store. A
  ``tcp://`` endpoint cannot tell who connects, so it gets :data:`~.audience.NO_TENANT`: never a
  tenant's namespaces. Binding every interface (``tcp://*:PORT``) without CURVE is refused unless
  ``kv_events_allow_open_tcp`` says otherwise.
* **With CURVE** (``kv_events_curve_secret_key_file``) every endpoint encrypts and a ZAP handler
  admits only the public keys of ``kv_events_subscribers_file``, each tied to one audience (a tenant,
  no tenant, or all). The audience's label becomes the connection's ZeroMQ ``User-Id``, which the
  publisher reads from every subscription and replay request it serves.

:class:`EndpointGuard` does the checks that must pass before anything is bound: an ipc path held by
a live process (another daemon) or that is not a socket is refused, never taken over or deleted,
and a lock next to it keeps a second daemon out for this one's whole life.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils import z85

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import read_yaml_mapping
from ucm_protocol.text import printable
from ucm_server.journal import read_regular
from ucm_server.kv_events.audience import ALL, NO_TENANT, Audience

if TYPE_CHECKING:
    from ucm_server.config import ServerConfig

__all__ = ["AccessPlan", "Endpoint", "EndpointGuard", "plan_access", "read_secret_key", "read_subscribers"]

LOCAL_NAMES = {"kv_events_endpoint": "kv-events.pub", "kv_events_replay_endpoint": "kv-events.replay"}
"""The ipc socket a ``local`` endpoint names, in the daemon's socket directory."""
WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", "[*]", ""}
KEY_FIX = "write 40 Z85 characters with python -m ucm_server.kv_events.keygen, chmod 600"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One configured address: the setting it came from, the ZeroMQ address, bind or connect."""

    setting: str
    address: str
    bind: bool

    @property
    def ipc_path(self) -> Path | None:
        return Path(self.address.removeprefix("ipc://")) if self.address.startswith("ipc://") else None

    @property
    def local(self) -> bool:
        """Reachable by this machine's processes only (ipc, inproc), never over the network."""
        return self.address.startswith(("ipc://", "inproc://"))

    @property
    def wildcard(self) -> bool:
        """A TCP bind on every interface."""
        if not self.bind or not self.address.startswith("tcp://"):
            return False
        host = self.address.removeprefix("tcp://").rpartition(":")[0]
        return host in WILDCARD_HOSTS


def endpoint(setting: str, value: str, socket_dir: Path, *, always_bind: bool) -> Endpoint:
    """``value`` of ``setting`` resolved: ``local`` is an ipc socket in ``socket_dir``; ipc, inproc and
    ``tcp://*`` addresses bind, other TCP addresses connect (vLLM's rule) unless ``always_bind``."""
    address = f"ipc://{socket_dir / LOCAL_NAMES[setting]}" if value == "local" else value
    bind = always_bind or "*" in address or address.startswith(("ipc://", "inproc://"))
    return Endpoint(setting, address, bind)


@dataclass(frozen=True, slots=True)
class AccessPlan:
    """The endpoints, the audiences to publish, and how a connection's audience is known."""

    endpoints: tuple[Endpoint, ...]
    audiences: tuple[Audience, ...]
    fixed: Audience | None
    """Every connection's audience when there is no CURVE; None: each key's (``curve_audiences``)."""
    curve_secret_key: bytes = b""
    """The daemon's CURVE secret key (Z85) or empty: no CURVE."""
    curve_audiences: dict[bytes, Audience] | None = None
    """Subscriber public key (Z85) -> its audience."""


def plan_access(config: ServerConfig, tenants: set[str] | None) -> AccessPlan:
    """The access plan of ``config``'s KV event settings; :class:`ConfigError` for an endpoint that
    would expose events to anyone who reaches it, or a bad key or subscribers file. ``tenants``: the
    tenants of ``auth_tokens_file`` (None without one)."""
    socket_dir = config.socket.parent
    eps = [endpoint("kv_events_endpoint", config.kv_events_endpoint, socket_dir, always_bind=False)]
    if config.kv_events_replay_endpoint:
        replay = config.kv_events_replay_endpoint
        eps.append(endpoint("kv_events_replay_endpoint", replay, socket_dir, always_bind=True))
    if config.kv_events_curve_secret_key_file:
        secret = read_secret_key(Path(config.kv_events_curve_secret_key_file))
        keys = read_subscribers(Path(config.kv_events_subscribers_file), tenants)
        audiences = tuple(sorted(set(keys.values()), key=lambda a: a.label))
        return AccessPlan(tuple(eps), audiences, None, secret, keys)
    for ep in eps:
        if ep.wildcard and not config.kv_events_allow_open_tcp:
            raise ConfigError(
                f"{ep.setting}: {ep.address} binds every interface without authentication, so anyone "
                "who reaches the port reads this node's block hashes. Use local (an ipc socket only "
                "this uid can open), bind one address, set kv_events_curve_secret_key_file and "
                "kv_events_subscribers_file (CURVE), or kv_events_allow_open_tcp: true to accept it"
            )
    fixed = ALL if all(ep.local for ep in eps) else NO_TENANT
    return AccessPlan(tuple(eps), (fixed,), fixed)


def read_secret_key(path: Path) -> bytes:
    """The Z85 CURVE secret key in ``path`` (40 characters, a trailing newline allowed); the file must
    be a regular file only its owner reads. Errors name the file, never its content."""
    where = f"kv_events_curve_secret_key_file {path}"
    data = read_regular(path, where, KEY_FIX, 4096, private=True)
    if data is None:
        raise ConfigError(f"{where}: no such file; {KEY_FIX}")
    key = data.strip()
    if not _is_z85_key(key):
        raise ConfigError(f"{where}: not a CURVE key; {KEY_FIX}")
    return key


def read_subscribers(path: Path, tenants: set[str] | None) -> dict[bytes, Audience]:
    """Public key (Z85) -> audience, from ``path``::

        subscribers:
          - public_key: "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
            tenant: team-a        # team-a's namespaces only ("" = the namespaces no tenant owns)
          - public_key: "..."
            all: true             # every namespace (the operator's router)

    The file decides who may read what, so one others could write is refused."""
    where = f"kv_events_subscribers_file {path}"
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode
        if mode & 0o022:
            raise ConfigError(f"{where}: writable by others (mode {mode & 0o777:o}); chmod go-w it")
    doc = read_yaml_mapping(path, "kv_events_subscribers_file")
    entries = doc.get("subscribers")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: expected a non-empty 'subscribers:' list")
    out: dict[bytes, Audience] = {}
    for i, entry in enumerate(entries):
        here = f"{where}: subscribers[{i}]"
        key, audience = _subscriber(here, entry, tenants)
        if key in out:
            raise ConfigError(f"{here}.public_key: listed twice")
        out[key] = audience
    return out


def _subscriber(here: str, entry: Any, tenants: set[str] | None) -> tuple[bytes, Audience]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{here}: expected a mapping")
    unknown = set(entry) - {"public_key", "tenant", "all"}
    if unknown:
        raise ConfigError(f"{here}: unknown key(s) {sorted(map(str, unknown))}")
    key = str(entry.get("public_key", "")).strip().encode()
    if not _is_z85_key(key):
        raise ConfigError(f"{here}.public_key: expected the subscriber's 40-character Z85 CURVE public key")
    if ("tenant" in entry) == (entry.get("all") is True):
        raise ConfigError(f"{here}: give exactly one of tenant: NAME or all: true")
    if entry.get("all") is True:
        return key, ALL
    tenant = entry["tenant"]
    if not isinstance(tenant, str):
        raise ConfigError(f"{here}.tenant: expected a string")
    if tenant and (tenants is None or tenant not in tenants):
        raise ConfigError(
            f"{here}.tenant: {printable(tenant, 64)!r} is not a tenant of auth_tokens_file"
            + (" (there is none)" if tenants is None else "")
        )
    return key, Audience(tenant) if tenant else NO_TENANT


def _is_z85_key(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        return False


class EndpointGuard:
    """Checks an ipc endpoint before it is bound and keeps other daemons off it while this one lives."""

    def __init__(self) -> None:
        self._locks: list[int] = []

    def claim(self, endpoints: tuple[Endpoint, ...]) -> None:
        """Check every ipc endpoint and lock it; :class:`ConfigError` (nothing held) if one fails."""
        try:
            for ep in endpoints:
                path = ep.ipc_path
                if path is not None and ep.bind:
                    self._locks.append(_claim_ipc(ep.setting, path))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks = []


def _claim_ipc(setting: str, path: Path) -> int:
    """Lock ``path`` (``<path>.lock``) and clear a stale socket there; refuse a directory others can
    write (they could put their own socket in its place), a live socket, or anything not a socket."""
    where = f"{setting}: ipc://{path}"
    try:
        st = path.parent.stat()
    except OSError as exc:
        raise ConfigError(f"{where}: directory {path.parent}: {exc.strerror}") from None
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
        raise ConfigError(
            f"{where}: directory {path.parent} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) "
            "can be written by others, who could replace the socket: use local (the daemon's socket "
            "directory) or a directory only this uid can write"
        )
    try:
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"{where}: lock {path}.lock: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{where}: another ucm-server publishes there (lock {path}.lock)") from None
    try:
        _clear_stale(where, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clear_stale(where: str, path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{where}: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left by a daemon that was killed
    else:
        raise ConfigError(f"{where}: another process is listening there; refusing to take it over")
    finally:
        probe.close()


def bind_private(sock: zmq.Socket[Any], ep: Endpoint) -> None:
    """Bind (or connect) ``sock`` to ``ep``; an ipc socket file is created 0600."""
    if not ep.bind:
        sock.connect(ep.address)
        return
    path = ep.ipc_path
    old = os.umask(0o177) if path is not None else None
    try:
        sock.bind(ep.address)
    finally:
        if old is not None:
            os.umask(old)
    if path is not None and path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
