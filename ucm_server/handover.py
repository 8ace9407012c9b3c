"""Client memory handed over as a file descriptor: the fd socket and its table of pending handovers.

A client never names memory for the daemon to open (a name lets anyone who can reach the daemon map
anything the daemon's user can open). It passes the memory itself: a memfd sealed with
``F_SEAL_SHRINK``, sent over ``<socket path>.fds`` with ``SCM_RIGHTS`` (wire format in
:mod:`ucm_protocol.fdpass`). The seal is what keeps the daemon alive: memory that cannot shrink can
never vanish under the daemon's mapping, so no ``SIGBUS``, whatever the client does to its own copy.

The listener checks the peer (``SO_PEERCRED``: the daemon's own uid, or root) and the descriptor (a
regular shmem file with the seal, at least the declared size, every page allocated), then parks it
under a fresh random token for ``ttl_s``; ``RegisterRegion`` takes it by that token, once. Whatever
arrives on the socket (garbage, half messages, several or no descriptors, a pipe, ``/dev/zero``) is
answered with a reason or dropped, and every descriptor received is closed unless it is kept.

The socket is shared by every local process, so it is fair (:mod:`ucm_server.peer_share`):

- a process may hold :data:`CONNECTIONS_PER_PROCESS` connections (a new one closes its own
  oldest), and all together :data:`MAX_CONNECTIONS`; a newcomer to a full set takes the place of
  the oldest connection of the peer (uid, then pid) holding the most;
- a request must arrive whole within :data:`HANDSHAKE_S` (a client sends it at once); at most two
  descriptors are received per connection, and a connection that sends a second one is refused then;
- a process may have a quarter of ``max_pending_handovers`` pending; a newcomer to a full table takes
  the place of the oldest handover of the peer holding the most, so nobody is locked out until
  tokens expire (:data:`TTL_S`);
- every descriptor those hold comes out of a part of the daemon's descriptor budget carved out for
  the fd socket (:mod:`ucm_server.descriptors`): the daemon's own reserve is never touched, and
  client memory registered for good cannot starve handovers either.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from ucm_protocol.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    UcmError,
)
from ucm_protocol.fdpass import (
    MAX_REPLY_PAYLOAD,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    TOKEN_BYTES,
    VERSION,
    PeerCredentials,
    peer_credentials,
)
from ucm_server.client_memory import ALLOCATE, unallocated
from ucm_server.descriptors import DescriptorBudget, process_budget
from ucm_server.peer_share import PeerShares

log = logging.getLogger(__name__)

TTL_S = 10.0
"""How long a handed-over memfd waits for its RegisterRegion (a client registers at once)."""
HANDSHAKE_S = 1.0
"""How long a connection may take to send its request, and to take the reply."""
MAX_CONNECTIONS = 64
CONNECTIONS_PER_PROCESS = 4
PENDING_SHARE = 4
"""A process may have a quarter of max_pending_handovers pending (at least 2). A full table locks no
one out (the heaviest peer gives way), so the share need not be small: a process whose registrations
were refused leaves its tokens behind until they expire and still has room."""
FDS_RECEIVED = 2
"""Descriptors taken in per connection at most: one too many is refused (the kernel closes more)."""
FDS_PER_CONNECTION = 1 + FDS_RECEIVED
HUGETLBFS_MAGIC = 0x958458F6
_ERROR_LOG_S = 60.0


@dataclass(slots=True)
class Handover:
    """A descriptor waiting for its ``RegisterRegion``."""

    fd: int
    size: int
    """Bytes the memory holds (``fstat`` at handover; sealed, so it cannot shrink)."""
    uid: int
    pid: int
    expires: float

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fs_magic(fd: int) -> int | None:
    """The file system type of ``fd`` (``fstatfs``; its first field), or None where it cannot be read."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    try:
        if _libc().fstatfs(fd, buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return int(ctypes.c_ulong.from_buffer(buf).value) & 0xFFFFFFFF


def check_memfd(fd: int, declared: int) -> int:
    """Refuse anything but shmem memory sealed against shrinking, at least ``declared`` bytes and
    fully allocated (pages the daemon touched first would be charged to it); return its size."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(
            "the descriptor is not a memfd (not a regular file): hand over memory made by "
            "memfd_create(MFD_ALLOW_SEALING), as ucm_client.SharedBuffer does"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument(
            "the descriptor is not a memfd (its file system has no seals): hand over memory made by "
            "memfd_create(MFD_ALLOW_SEALING), as ucm_client.SharedBuffer does"
        ) from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidArgument(
            "the memfd is not sealed with F_SEAL_SHRINK: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) before "
            "handing it over, so it can never shrink under the daemon's mapping"
        )
    if _fs_magic(fd) == HUGETLBFS_MAGIC:
        raise InvalidArgument("hugetlb memfds are not accepted (a fault on one can crash the daemon)")
    if declared <= 0:
        raise InvalidArgument(f"declared size must be positive, got {declared}")
    if st.st_size < declared:
        raise InvalidArgument(f"the memfd holds {st.st_size} bytes, less than the declared {declared}")
    if (why := unallocated(st)) is not None:
        raise InvalidArgument(f"the memfd has holes: {why}; {ALLOCATE}")
    return int(st.st_size)


class HandoverTable:
    """Descriptors handed over and not yet registered, by token; bounded, fair among peers, expiring."""

    def __init__(
        self, max_pending: int, *, ttl_s: float = TTL_S, budget: DescriptorBudget | None = None
    ) -> None:
        self.max_pending = max_pending
        self.max_per_pid = max(2, max_pending // PENDING_SHARE)
        self.ttl_s = ttl_s
        self.budget = budget if budget is not None else process_budget().carve(max_pending)
        """One descriptor per pending handover, carved out for this table alone."""
        self._pending: dict[bytes, Handover] = {}
        self._shares: PeerShares[bytes] = PeerShares()
        self.evicted = 0
        """Handovers dropped to make room for a peer holding fewer (a figure for tests)."""

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, fd: int, declared: int, peer: PeerCredentials) -> bytes:
        """Check ``fd`` and keep it (this table owns it from now on, also when refused: then closed)."""
        try:
            size = check_memfd(fd, declared)
            self.expire()
            mine = self._shares.of_process(peer.uid, peer.pid)
            if mine >= self.max_per_pid:
                raise ResourceExhausted(
                    f"process {peer.pid} has {mine} memory handovers pending registration, the limit "
                    f"per process (a quarter of max_pending_handovers = {self.max_pending}); call "
                    "RegisterRegion with the tokens already received"
                )
            while len(self._pending) >= self.max_pending or not self.budget.take():
                victim = self._shares.victim(peer.uid, peer.pid)
                if victim is None:
                    raise ResourceExhausted(
                        f"{len(self._pending)} memory handovers are pending registration, the limit "
                        "(max_pending_handovers, or the descriptors for them), and no other process holds "
                        "more than this one; register or drop them, or raise max_pending_handovers"
                    )
                self._pop(victim).close()
                self.evicted += 1
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        self._pending[token] = Handover(fd, size, peer.uid, peer.pid, time.monotonic() + self.ttl_s)
        self._shares.add(token, peer.uid, peer.pid)
        return token

    def take(self, token: bytes) -> Handover:
        """The handover for ``token``, once; the caller closes its descriptor."""
        self.expire()
        if len(token) != TOKEN_BYTES:
            raise InvalidArgument(f"memfd_token must be {TOKEN_BYTES} bytes, got {len(token)}")
        if bytes(token) not in self._pending:
            raise FailedPrecondition(
                "unknown or expired memfd_token: hand the memory over again on the fd socket "
                f"(a token works once, for {self.ttl_s:.0f}s, and may give way to other processes' "
                "handovers when the table is full)"
            )
        return self._pop(bytes(token))

    def _pop(self, token: bytes) -> Handover:
        handover = self._pending.pop(token)
        self._shares.remove(token)
        self.budget.give()
        return handover

    def expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, h in self._pending.items() if h.expires <= now]:
            self._pop(token).close()

    def close(self) -> None:
        for token in list(self._pending):
            self._pop(token).close()
        self.budget.close()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


async def ready_for(loop: asyncio.AbstractEventLoop, conn: socket.socket, *, write: bool = False) -> None:
    """Until ``conn`` has data (or EOF) to read, or with ``write`` room to send."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = conn.fileno()
    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def listen_private(path: Path) -> socket.socket:
    """A non-blocking Unix stream socket listening at ``path``, mode 0600 from its first moment (the
    caller has checked its directory and cleared a stale socket there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def stop_listening(sock: socket.socket | None, path: Path, tasks: list[asyncio.Task[None]]) -> None:
    """Cancel a listener's ``tasks`` (its accept loop, its connections) and wait for them, then close
    its socket and remove the socket's path."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if sock is not None:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def accepted(sock: socket.socket, what: str) -> AsyncIterator[socket.socket]:
    """Every connection ``sock`` accepts, for as long as the caller iterates. An accept that fails
    (EMFILE and the like, as under a descriptor flood) is said now and then, not each time, and the
    loop backs off a little and keeps serving."""
    loop = asyncio.get_running_loop()
    last_said = -_ERROR_LOG_S
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            if time.monotonic() - last_said >= _ERROR_LOG_S:
                last_said = time.monotonic()
                log.warning("%s: accept failed: %s (said once a minute)", what, exc)
            await asyncio.sleep(0.1)
            continue
        yield conn


class HandoverListener:
    """The fd socket: accepts connections on the event loop, one request each, never blocking."""

    def __init__(
        self,
        path: Path,
        table: HandoverTable,
        *,
        timeout_s: float = HANDSHAKE_S,
        budget: DescriptorBudget | None = None,
    ) -> None:
        self.path = path
        self.table = table
        self.timeout_s = timeout_s
        self.budget = (
            budget if budget is not None else process_budget().carve(MAX_CONNECTIONS * FDS_PER_CONNECTION)
        )
        """The descriptors of open connections (theirs, and what they carry), for this socket alone."""
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._expiring: asyncio.Task[None] | None = None
        self._conns: PeerShares[asyncio.Task[None]] = PeerShares()
        self.uid = os.geteuid()
        self.turned_away = 0
        """Connections closed unserved: over a process's share, or making room for a lighter peer."""

    def bind(self) -> None:
        """Create the socket, mode 0600 (the caller has checked its directory and cleared a stale one)."""
        self._sock = listen_private(self.path)

    async def start(self) -> None:
        if self._sock is None:
            self.bind()
        self._accepting = asyncio.create_task(self._accept_loop())
        self._expiring = asyncio.create_task(self._expire_loop())

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, self._expiring) if t is not None]
        await stop_listening(self._sock, self.path, tasks + self._conns.entries())
        self._sock = None
        self.table.close()
        self.budget.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.table.ttl_s, 10.0))
            self.table.expire()

    async def _accept_loop(self) -> None:
        assert self._sock is not None
        async for conn in accepted(self._sock, "fd socket"):
            try:
                peer = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not self._room_for(peer):
                self.turned_away += 1
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task, peer.uid, peer.pid)
            task.add_done_callback(self._ended)

    def _room_for(self, peer: PeerCredentials) -> bool:
        """Whether a connection of ``peer`` may be served now, making room by closing the oldest
        connection of a heavier peer when all are taken; its descriptors are then taken."""
        if self._conns.of_process(peer.uid, peer.pid) >= CONNECTIONS_PER_PROCESS:
            # A process at its share: its own oldest connection gives way (the newest is the one
            # most likely to be sent at once; a process can only ever displace itself here).
            self._close_conn(self._conns.oldest_of(peer.uid, peer.pid))
        while len(self._conns) >= MAX_CONNECTIONS or not self.budget.take(FDS_PER_CONNECTION):
            victim = self._conns.victim(peer.uid, peer.pid)
            if victim is None:
                return False
            self._close_conn(victim)
        return True

    def _close_conn(self, task: asyncio.Task[None] | None) -> None:
        if task is not None:
            self._ended(task)
            task.cancel()  # its descriptors close as it ends, at the next turn of the loop
            self.turned_away += 1

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self._conns.remove(task):
            self.budget.give(FDS_PER_CONNECTION)

    async def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.setblocking(False)
            try:
                data = await asyncio.wait_for(self._read_request(conn, fds), self.timeout_s)
            except TimeoutError:
                return  # a client that sends half a request and waits gets the connection closed
            except UcmError as exc:  # too many descriptors: refused as soon as they arrive
                _close_fds(fds)
                fds = []
                await self._reply(conn, exc.code, exc.message.encode())
                return
            if data is None:
                return  # closed early
            try:
                token = self._admit(conn, data, fds)
            except UcmError as exc:
                await self._reply(conn, exc.code, exc.message.encode())
                return
            fds = []  # the table owns the descriptor now
            await self._reply(conn, grpc.StatusCode.OK, token)
        except (OSError, asyncio.CancelledError):
            pass
        except Exception:  # never let one connection take the listener down
            log.exception("fd socket: unexpected error")
        finally:
            _close_fds(fds)
            conn.close()

    async def _read_request(self, conn: socket.socket, fds: list[int]) -> bytes | None:
        """Up to REQUEST.size bytes and the descriptors that came with them (into ``fds``); more
        than one descriptor is refused at once (``INVALID_ARGUMENT``)."""
        loop = asyncio.get_running_loop()
        data = b""
        space = socket.CMSG_SPACE(FDS_RECEIVED * array.array("i").itemsize)
        while len(data) < REQUEST.size:
            try:
                chunk, ancdata, flags, _ = conn.recvmsg(
                    REQUEST.size - len(data), space, socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                await ready_for(loop, conn)
                continue
            fds.extend(_fds_of(ancdata))
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                got = f"more than {len(fds)}" if flags & socket.MSG_CTRUNC else str(len(fds))
                raise InvalidArgument(f"a handover carries exactly one file descriptor, got {got}")
            if not chunk:
                return None
            data += chunk
        return data

    def _admit(self, conn: socket.socket, data: bytes, fds: list[int]) -> bytes:
        peer = peer_credentials(conn)
        if peer.uid not in (self.uid, 0):
            raise PermissionDenied(
                f"process {peer.pid} runs as uid {peer.uid}; this daemon (uid {self.uid}) takes memory "
                "only from its own uid or root"
            )
        magic, version, declared = REQUEST.unpack(data)
        if magic != REQUEST_MAGIC or version != VERSION:
            raise InvalidArgument(
                f"not a UCM fd request (magic {magic!r}, version {version}); "
                f"expected {REQUEST_MAGIC!r} v{VERSION}"
            )
        if len(fds) != 1:
            raise InvalidArgument(f"a handover carries exactly one file descriptor, got {len(fds)}")
        fd = fds.pop()
        token = self.table.add(fd, declared, peer)  # owns (and on refusal closes) fd
        log.debug("fd socket: memfd of %d bytes from pid %d (uid %d) pending", declared, peer.pid, peer.uid)
        return token

    async def _reply(self, conn: socket.socket, code: grpc.StatusCode, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        payload = payload[:MAX_REPLY_PAYLOAD]
        status = 0 if code == grpc.StatusCode.OK else int(code.value[0])
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(
                loop.sock_sendall(conn, REPLY.pack(REPLY_MAGIC, status, len(payload)) + payload),
                self.timeout_s,
            )
