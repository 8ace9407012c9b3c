"""Issue #11, section 4: memory is registered only by the local process that owns it.

Against a real ``ucm-server``: a shared-memory object named by a client (the old way, which let a TCP
tenant map any owner-only ``/dev/shm`` object of the daemon's user) is refused; any memory
registration over TCP is refused, even with a valid memfd token stolen from a local client, and the
TCP tenant still has the streaming-bytes path; the daemon's fd socket survives everything an
attacker can put on it (garbage, half messages, pipes, ``/dev/zero``, unsealed or too small memfds,
too many descriptors, another uid) without leaking a descriptor or stalling its event loop; a memfd
token works once; and pending handovers are bounded per process and in total (section 9).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient, key_digest
from ucm_client.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_protocol.fdpass import REPLY, REQUEST, fd_socket_path
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

TOKEN = "tenant-a-secret"
INVALID_ARGUMENT, PERMISSION_DENIED, RESOURCE_EXHAUSTED = 3, 7, 8
NOBODY = 65534


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with a tenant token, on its Unix socket and on TCP (plaintext, loopback)."""
    work = tmp_path_factory.mktemp("memreg")
    tokens = work / "tokens.yaml"
    tokens.write_text(f"tokens:\n  - token: {TOKEN}\n    tenant: team-a\n    admin: true\n")
    address = f"127.0.0.1:{_free_port()}"
    args = ["--listen", address, "--insecure", "--auth-tokens-file", str(tokens)]
    with DaemonProcess(work / "ucm", args=args) as d:
        yield d, address


def _attach(kv: rpc.KVStoreStub, token: str = "") -> tuple[object, tuple[tuple[str, str], ...]]:
    auth = (("authorization", f"Bearer {token}"),) if token else ()
    stream = kv.Attach(pb.AttachRequest(client_name="attacker", pid=os.getpid()), metadata=auth)
    first = next(stream)
    return stream, (("ucm-session", first.session_id), *auth)


def _owner_only_shm(name: str, data: bytes) -> Path:
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    return path


def test_registration_by_name_is_refused(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    """Even a local client, naming an owner-only object of the daemon's own uid, is refused."""
    d, _ = tcp_daemon
    victim = _owner_only_shm(f"ucm-victim-{os.getpid()}", b"secret KV of another process".ljust(4096, b"\0"))
    try:
        with grpc.insecure_channel(d.target) as ch:
            kv = rpc.KVStoreStub(ch)
            stream, md = _attach(kv, TOKEN)
            for name in (str(victim), "/" + victim.name):
                with pytest.raises(grpc.RpcError) as info:
                    kv.RegisterRegion(
                        pb.RegisterRegionRequest(shm_name=name, size=4096), metadata=md, timeout=5
                    )
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "registration by name is not accepted" in (info.value.details() or "")
            stream.cancel()  # type: ignore[attr-defined]
    finally:
        victim.unlink()
    assert d.healthy()


def test_tcp_tenant_cannot_register_memory(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    d, address = tcp_daemon
    victim = _owner_only_shm(f"ucm-victim-tcp-{os.getpid()}", b"\x11" * 4096)
    try:
        # The client library refuses at once, naming the streaming path.
        with UcmClient(address, token=TOKEN) as remote, SharedBuffer(4096) as buf:
            with pytest.raises(PermissionDenied, match="local Unix-socket"):
                remote.register(buf)
            # The streaming-bytes path works over TCP.
            key = key_digest("tcp", 0)
            assert remote.put_blocks(NS, [(key, b"remote bytes")]).ok
            assert remote.get_blocks(NS, [key]) == [b"remote bytes"]
        # A raw TCP caller gets PERMISSION_DENIED for every kind of registration, even with a valid token
        # handed over by a local process (which stays usable by that local process).
        with SharedBuffer(4096) as local_buf:
            stolen = hand_over(d.socket, local_buf.fileno(), 4096, trusted_uids())
            with grpc.insecure_channel(address) as ch:
                kv = rpc.KVStoreStub(ch)
                stream, md = _attach(kv, TOKEN)
                for request in (
                    pb.RegisterRegionRequest(shm_name=str(victim), size=4096),
                    pb.RegisterRegionRequest(memfd_token=stolen, size=4096),
                    pb.RegisterRegionRequest(cuda_ipc_handle=b"\1" * 64, size=4096),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        kv.RegisterRegion(request, metadata=md, timeout=5)
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
                    assert "needs a local Unix-socket client" in (info.value.details() or "")
                stream.cancel()  # type: ignore[attr-defined]
            with grpc.insecure_channel(d.target) as ch:
                kv = rpc.KVStoreStub(ch)
                stream, md = _attach(kv, TOKEN)
                kv.RegisterRegion(
                    pb.RegisterRegionRequest(memfd_token=stolen, size=4096), metadata=md, timeout=5
                )
                stream.cancel()  # type: ignore[attr-defined]
    finally:
        victim.unlink()
    assert d.healthy()


# -- the fd socket under attack ---------------------------------------------------------------------


def _exchange(
    path: Path, chunks: list[tuple[bytes, list[int]]], *, wait_reply: bool = True
) -> tuple[int, str] | None:
    """Send ``chunks`` (bytes, fds) on a fresh connection; the reply (status, text), or None if closed."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    s.connect(str(path))
    try:
        for data, fds in chunks:
            try:
                if fds:
                    socket.send_fds(s, [data], fds)
                else:
                    s.sendall(data)
            except OSError:
                break  # the daemon answered and closed already
        if not wait_reply:
            return None
        header = b""
        while len(header) < REPLY.size:
            part = s.recv(REPLY.size - len(header))
            if not part:
                return None
            header += part
        _magic, status, length = REPLY.unpack(header)
        body = b""
        while len(body) < length:
            part = s.recv(length - len(body))
            if not part:
                break
            body += part
        return status, body.decode(errors="replace")
    except ConnectionResetError:
        return None
    finally:
        s.close()


def _memfd(size: int, seals: int, *, allocate: bool = True) -> int:
    """A memfd of ``size`` bytes with ``seals``, every page allocated unless told otherwise."""
    fd = os.memfd_create("attacker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _open_fds(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def _memfds(pid: int) -> int:
    """Memfds the process holds open (pending handovers, and one per memfd behind registered regions)."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += str(fd.readlink()).startswith("/memfd:")
        except OSError:
            pass
    return n


def _header(size: int = 4096, magic: bytes = b"UCMF", version: int = 1) -> bytes:
    return REQUEST.pack(magic, version, size)


def test_fd_socket_survives_garbage(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = fd_socket_path(daemon.socket)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    assert (path.stat().st_mode & 0o777) == 0o600
    # Warm up (the first handover loads what it needs), then count the daemon's descriptors.
    with SharedBuffer(4096) as warm:
        hand_over(daemon.socket, warm.fileno(), 4096, trusted_uids())
    base = _open_fds(pid)

    seal_shrink = fcntl.F_SEAL_SHRINK
    read_end, write_end = os.pipe()
    zero = os.open("/dev/zero", os.O_RDONLY)
    disk_file = tmp_path / "plain-file"
    disk_file.write_bytes(b"\0" * 8192)
    disk = os.open(disk_file, os.O_RDWR)
    shm_file = _owner_only_shm(f"ucm-attack-{os.getpid()}", b"\0" * 8192)
    shm = os.open(shm_file, os.O_RDWR)
    unsealed = _memfd(8192, 0)
    grow_only = _memfd(8192, fcntl.F_SEAL_GROW)
    small = _memfd(1024, seal_shrink)
    unallocated = _memfd(8192, seal_shrink, allocate=False)
    half = _memfd(8192, seal_shrink)
    _punch(half, 4096)
    good = _memfd(8192, seal_shrink)
    unix_a, unix_b = socket.socketpair()
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    many = [os.dup(good) for _ in range(20)]
    refusals: dict[str, tuple[int, str] | None] = {}
    try:
        cases: dict[str, list[tuple[bytes, list[int]]]] = {
            "random bytes": [(os.urandom(REQUEST.size), [])],
            "a megabyte of random bytes": [(os.urandom(1 << 20), [])],
            "wrong magic with a good memfd": [(_header(magic=b"XXXX"), [good])],
            "wrong version": [(_header(version=9), [good])],
            "no descriptor": [(_header(), [])],
            "a pipe": [(_header(), [read_end])],
            "/dev/zero": [(_header(), [zero])],
            "a file on disk": [(_header(), [disk])],
            "a /dev/shm file (not a memfd)": [(_header(), [shm])],
            "a socket": [(_header(), [unix_a.fileno()])],
            "a directory": [(_header(), [directory])],
            "an unsealed memfd": [(_header(), [unsealed])],
            "a memfd sealed against growing only": [(_header(), [grow_only])],
            "a sealed memfd smaller than declared": [(_header(4096), [small])],
            "a memfd never allocated": [(_header(), [unallocated])],
            "a memfd with a hole": [(_header(), [half])],
            "a declared size of 0": [(_header(0), [good])],
            "two descriptors": [(_header(), [good, read_end])],
            "twenty descriptors": [(_header(), many)],
            "descriptors in two messages": [(_header()[:8], [good]), (_header()[8:], [good])],
        }
        for name, chunks in cases.items():
            refusals[name] = _exchange(path, chunks)
        # Half a request then close, connect-and-close: no answer, no harm.
        assert _exchange(path, [(_header()[:7], [good])], wait_reply=False) is None
        socket.socket(socket.AF_UNIX).connect(str(path))
        # Half requests left open do not stall anyone: health and a normal handover answer meanwhile.
        stalled = []
        for _ in range(10):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(path))
            s.send(b"UCMF")
            stalled.append(s)
        t0 = time.monotonic()
        assert daemon.healthy(timeout_s=2)
        with UcmClient(daemon.target) as c, SharedBuffer(4096) as buf:
            c.register(buf)
        assert time.monotonic() - t0 < 3, "the fd socket's slow clients stalled the daemon"
        for s in stalled:
            s.close()
    finally:
        for fd in (
            read_end,
            write_end,
            zero,
            disk,
            shm,
            unsealed,
            grow_only,
            small,
            unallocated,
            half,
            good,
            directory,
            *many,
        ):
            os.close(fd)
        unix_a.close()
        unix_b.close()
        shm_file.unlink()

    expected = {
        "random bytes": "not a UCM fd request",
        "a megabyte of random bytes": "not a UCM fd request",
        "wrong magic with a good memfd": "not a UCM fd request",
        "wrong version": "not a UCM fd request",
        "no descriptor": "exactly one file descriptor, got 0",
        "a pipe": "not a memfd",
        "/dev/zero": "not a memfd",
        "a file on disk": "",  # not a memfd, or (on tmpfs) not sealed: either way refused
        "a /dev/shm file (not a memfd)": "F_SEAL_SHRINK",
        "a socket": "not a memfd",
        "a directory": "not a memfd",
        "an unsealed memfd": "not sealed with F_SEAL_SHRINK",
        "a memfd sealed against growing only": "not sealed with F_SEAL_SHRINK",
        "a sealed memfd smaller than declared": "holds 1024 bytes, less than the declared 4096",
        "a memfd never allocated": "only 0 of 8192 bytes are allocated",
        "a memfd with a hole": "only 4096 of 8192 bytes are allocated",
        "a declared size of 0": "declared size must be positive",
        "two descriptors": "exactly one file descriptor, got 2",
        "twenty descriptors": "exactly one file descriptor",
        "descriptors in two messages": "exactly one file descriptor, got 2",
    }
    for name, want in expected.items():
        got = refusals[name]
        assert got is not None, f"{name}: the daemon closed without a reason"
        status, text = got
        assert status == INVALID_ARGUMENT, f"{name}: status {status}: {text}"
        assert want in text, f"{name}: {text!r}"
    assert daemon.healthy()
    # Every descriptor the attacks carried in was closed again (give the closes a moment).
    deadline = time.monotonic() + 10
    while _open_fds(pid) > base + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_fds(pid) <= base + 2, f"the daemon holds {_open_fds(pid) - base} more descriptors"
    with UcmClient(daemon.target) as c, SharedBuffer(4 * 4096) as src:
        src.buf[:] = os.urandom(src.size)
        assert c.wait(c.dump(NS, blocks_in(c.register(src), 4, 4096)), 10).ok


def test_memfd_token_rules(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.target) as ch, SharedBuffer(8192) as buf:
        kv = rpc.KVStoreStub(ch)
        stream, md = _attach(kv)

        def register(token: bytes, size: int = 8192) -> grpc.RpcError | int:
            try:
                return int(
                    kv.RegisterRegion(
                        pb.RegisterRegionRequest(memfd_token=token, size=size), metadata=md, timeout=5
                    ).region_id
                )
            except grpc.RpcError as exc:
                return exc

        def refused(result: grpc.RpcError | int, code: grpc.StatusCode, text: str) -> None:
            assert isinstance(result, grpc.RpcError), result
            assert result.code() == code and text in (result.details() or ""), result.details()

        token = hand_over(daemon.socket, buf.fileno(), 8192, trusted_uids())
        assert isinstance(register(token), int)
        refused(register(token), grpc.StatusCode.FAILED_PRECONDITION, "unknown or expired memfd_token")
        refused(register(os.urandom(16)), grpc.StatusCode.FAILED_PRECONDITION, "unknown or expired")
        refused(register(b"abc"), grpc.StatusCode.INVALID_ARGUMENT, "16 bytes")
        refused(register(b""), grpc.StatusCode.INVALID_ARGUMENT, "needs memfd_token")
        token = hand_over(daemon.socket, buf.fileno(), 8192, trusted_uids())
        refused(register(token, 8193), grpc.StatusCode.INVALID_ARGUMENT, "larger than the memory handed over")
        refused(register(token, 0), grpc.StatusCode.INVALID_ARGUMENT, "must be positive")
        # Memory sealed against writes cannot be mapped for loads: refused, not a crash.
        ro = _memfd(8192, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
        try:
            token = hand_over(daemon.socket, ro, 8192, trusted_uids())
        finally:
            os.close(ro)
        refused(register(token), grpc.StatusCode.INVALID_ARGUMENT, "cannot be mapped read-write")
        stream.cancel()  # type: ignore[attr-defined]
    assert daemon.healthy()


_STDLIB_HANDOVER = textwrap.dedent(
    """
    import fcntl, os, socket, struct, sys
    path, count = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:  # become another user (the interpreter is loaded already)
        uid = int(sys.argv[3])
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for _ in range(count):
        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        os.posix_fallocate(fd, 0, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        socket.send_fds(s, [struct.pack("!4sB3xQ", b"UCMF", 1, 4096)], [fd])
        head = s.recv(7)
        _, status, n = struct.unpack("!4sBH", head)
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        print(status, body.decode(errors="replace") if status else "token", flush=True)
    """
)


def test_fd_socket_checks_the_peer_uid(tmp_path: Path) -> None:
    """Were the socket's permissions loosened by mistake, another uid is still refused (SO_PEERCRED)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="ucm-peer-", dir="/tmp"))  # parents another uid can traverse
    with DaemonProcess(tmp_path / "ucm", socket=sock_dir / "ucm.sock") as daemon:
        path = fd_socket_path(daemon.socket)
        os.chmod(sock_dir, 0o755)
        os.chmod(path, 0o666)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", _STDLIB_HANDOVER, str(path), "1", str(NOBODY)],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            os.chmod(path, 0o600)
            os.chmod(sock_dir, 0o700)
        assert daemon.healthy()
    shutil.rmtree(sock_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    status, _, text = proc.stdout.strip().partition(" ")
    assert int(status) == PERMISSION_DENIED, proc.stdout
    assert f"uid {NOBODY}" in text and "only from its own uid or root" in text


def test_pending_handovers_are_bounded(tmp_path: Path) -> None:
    """8 pending in all, 2 per process (a quarter of 8): a process past its share is refused
    with RESOURCE_EXHAUSTED, and the daemon never holds more descriptors than that. A full table
    locks nobody out: a newcomer takes the place of the oldest handover of a process holding the
    most, whose token then fails clearly."""
    with DaemonProcess(tmp_path / "ucm", args=["--max-pending-handovers", "8"]) as d:
        assert d.proc is not None
        path = fd_socket_path(d.socket)

        def run_child(count: int) -> list[str]:
            out = subprocess.run(
                [sys.executable, "-I", "-c", _STDLIB_HANDOVER, str(path), str(count)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return out.stdout.strip().splitlines()

        own = _memfds(d.proc.pid)  # the daemon's own (its Cache arena)
        first = run_child(3)  # one process: 2 pending at most
        assert first[:2] == ["0 token", "0 token"]
        assert first[2].startswith(f"{RESOURCE_EXHAUSTED} ") and "per process" in first[2]
        with SharedBuffer(4096) as buf, grpc.insecure_channel(d.target) as ch:
            tokens = [hand_over(d.socket, buf.fileno(), 4096, trusted_uids()) for _ in range(2)]
            with pytest.raises(ResourceExhausted, match="per process"):
                hand_over(d.socket, buf.fileno(), 4096, trusted_uids())
            kv = rpc.KVStoreStub(ch)
            stream, md = _attach(kv)

            def register(token: bytes) -> None:
                kv.RegisterRegion(
                    pb.RegisterRegionRequest(memfd_token=token, size=4096), metadata=md, timeout=5
                )

            register(tokens.pop(0))  # registering one frees its place
            tokens.insert(0, hand_over(d.socket, buf.fileno(), 4096, trusted_uids()))
            for _ in range(2):  # two more processes fill the table: 8 pending in all
                assert run_child(2) == ["0 token", "0 token"]
            # Full: newcomers get in; the first child's two handovers (the oldest of the processes
            # holding the most) give way, then this process's oldest (tokens[1], handed over first).
            for _ in range(3):
                assert run_child(1) == ["0 token"]
            assert _memfds(d.proc.pid) == own + 8 + 1  # and the registered region's memfd, kept to check it
            with pytest.raises(grpc.RpcError) as gone:
                register(tokens[1])
            assert gone.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "unknown or expired memfd_token" in (gone.value.details() or "")
            register(tokens[0])  # the newer one still works
            stream.cancel()  # type: ignore[attr-defined]
        assert d.healthy()
        with UcmClient(d.target) as c, SharedBuffer(4096) as buf:
            c.register(buf)  # a full table of other processes' handovers locks no one out


def test_handover_wire_format_is_what_the_client_sends() -> None:
    """The stdlib attacker scripts above speak the real format (so their refusals are real ones)."""
    assert struct.pack("!4sB3xQ", b"UCMF", 1, 4096) == REQUEST.pack(b"UCMF", 1, 4096)
    assert REPLY.size == 7


def test_pending_handovers_expire_and_close_their_descriptor() -> None:
    """The pending table on its own (the daemon's TTL is 60 s, too long for a test): an unclaimed
    handover is dropped after its TTL and its descriptor closed; a token then fails clearly."""
    from ucm_protocol.errors import FailedPrecondition
    from ucm_protocol.fdpass import PeerCredentials
    from ucm_server.handover import HandoverTable

    table = HandoverTable(8, ttl_s=0.2)
    fd = _memfd(4096, fcntl.F_SEAL_SHRINK)
    token = table.add(fd, 4096, PeerCredentials(os.getpid(), os.getuid(), os.getgid()))
    assert len(table) == 1
    time.sleep(0.3)
    with pytest.raises(FailedPrecondition, match="unknown or expired"):
        table.take(token)
    assert len(table) == 0
    with pytest.raises(OSError):  # the table closed it
        os.fstat(fd)


def _punch(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    assert libc.fallocate(fd, 0x02 | 0x01, 0, size) == 0  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


@pytest.mark.parametrize("when", ["before the load", "between two loads"])
def test_memory_with_holes_is_refused_for_loads_and_dropped(tmp_path: Path, when: str) -> None:
    """Holes punched into registered memory (which the daemon's copy would allocate on its own
    account): the next Load is FAILED_PRECONDITION naming the region, the region is gone, other
    regions of the session and other clients carry on. The background prefault is off, so the check
    before the copy is the one that answers (tests/security/test_client_memory_limits.py shows the
    memory bound under a real cgroup limit)."""
    with DaemonProcess(tmp_path / "ucm", args=["--no-region-prefault"]) as d:
        with UcmClient(d.target) as c, SharedBuffer(8 * 4096) as src, SharedBuffer(8 * 4096) as dst:
            src.buf[:] = os.urandom(src.size)
            assert c.wait(c.dump(NS, blocks_in(c.register(src), 8, 4096)), 10).ok
            region = c.register(dst)
            if when == "between two loads":
                assert c.wait(c.load(NS, blocks_in(region, 8, 4096)), 10).ok
                assert bytes(dst.buf) == bytes(src.buf)
            _punch(dst.fileno(), 4096)  # one page is enough
            with pytest.raises(FailedPrecondition, match=r"region \d+: its memory has holes now \(only"):
                c.load(NS, blocks_in(region, 8, 4096))
            with pytest.raises(InvalidArgument, match="unknown region"):
                c.load(NS, blocks_in(region, 8, 4096))
            other = c.register(src)  # the session's other memory is untouched
            assert c.wait(c.dump(NS, blocks_in(other, 8, 4096, first=50)), 10).ok
        assert "changed after registration (only" in d.log()
        with UcmClient(d.target) as c, SharedBuffer(8 * 4096) as buf:
            assert c.wait(c.load(NS, blocks_in(c.register(buf), 8, 4096)), 10).ok
        assert d.healthy()
