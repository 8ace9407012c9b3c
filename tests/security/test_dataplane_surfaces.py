"""The local data plane's new surfaces, attacked: its socket, the shared table, each session's ring.

The daemon (a real ``ucm-server`` process) is sent garbage, half hellos, huge token lengths, other
sessions' and tenants' ids; a client tries to write the table it was given read-only; a client
scribbles over its ring (random bytes, indices out of range, huge counts, bodies outside the arena,
another session's regions), races its own requests, never reads its answers, floods the doorbell and
dies mid-request. After each, the daemon is healthy, holds no descriptor it did not hold before, and
an honest client beside the attacker still stores and loads exactly its bytes; the attacker's own
gRPC calls still work. A client that breaks its ring loses its ring, nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.dataplane import needs_native, raw_channel
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient, key_digest
from ucm_client.dataplane.channel import handshake
from ucm_client.trust import trusted_uids
from ucm_protocol import dataplane as dp
from ucm_protocol.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated
from ucm_server.testing.daemon import DaemonProcess

pytestmark = needs_native


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(
        tmp_path / "ucm", args=["--cache-capacity", "64MiB", "--store-pipeline", "Cache"]
    ) as d:
        yield d


def _fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return len(list(Path(f"/proc/{d.proc.pid}/fd").iterdir()))


def _dp_path(d: DaemonProcess) -> Path:
    return dp.dataplane_socket_path(d.socket)


def _honest_round_trip(d: DaemonProcess, tag: str) -> None:
    """A client beside the attacker: its bytes go in and come back exactly (through its own ring)."""
    with UcmClient(d.target, client_name="honest") as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        buf.buf[:65536] = os.urandom(65536)
        blocks = [b for b in blocks_in(region, 16, 4096)]
        blocks = [type(b)(key_digest(tag, i), b.segments) for i, b in enumerate(blocks)]
        task = c.dump(NS, blocks)
        assert c._plane.owns(task) and c.wait(task, 10).ok
        back = [
            type(b)(b.key, (type(b.segments[0])(region, 65536 + i * 4096, 4096),))
            for i, b in enumerate(blocks)
        ]
        assert c.wait(c.load(NS, back), 10).ok
        assert bytes(buf.buf[65536:131072]) == bytes(buf.buf[:65536])


def _send_raw(path: Path, data: bytes, *, read_s: float = 2.0) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(read_s)
    try:
        s.connect(str(path))
        with contextlib.suppress(OSError):
            s.sendall(data)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
        return out
    finally:
        s.close()


# -- the socket ----------------------------------------------------------------------------------------
def test_the_socket_is_private(daemon: DaemonProcess) -> None:
    st = _dp_path(daemon).stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()


def test_garbage_on_the_socket_is_answered_or_dropped(daemon: DaemonProcess) -> None:
    _honest_round_trip(daemon, "before")  # the table the daemon keeps from the first channel on
    time.sleep(0.2)
    before = _fds(daemon)
    rng = random.Random(11)
    path = _dp_path(daemon)
    for n in (0, 1, 7, dp.HELLO.size - 1, dp.HELLO.size, 4096, 200_000):
        _send_raw(path, rng.randbytes(n), read_s=0.5)
    wrong_magic = dp.HELLO.pack(b"NOTUCM!!", dp.VERSION, dp.KIND_CHANNEL, 0, b"0" * 32)
    reply = _send_raw(path, wrong_magic)
    assert reply[:8] == dp.REPLY_MAGIC and b"not a UCM data-plane hello" in reply
    huge = dp.HELLO.pack(dp.HELLO_MAGIC, dp.VERSION, dp.KIND_CHANNEL, 1 << 31, b"0" * 32)
    reply = _send_raw(path, huge)
    assert b"token of 2147483648 bytes; at most 4096" in reply
    assert daemon.healthy()
    _honest_round_trip(daemon, "garbage")
    deadline = time.monotonic() + 5
    while _fds(daemon) > before and time.monotonic() < deadline:  # the honest channel's end is seen
        time.sleep(0.05)
    assert _fds(daemon) <= before  # nothing the garbage brought is still held


def test_hellos_that_name_the_wrong_session_are_refused(daemon: DaemonProcess) -> None:
    path = _dp_path(daemon)
    with pytest.raises(FailedPrecondition, match="is not attached"):
        handshake(path, trusted_uids(), dp.KIND_CHANNEL, "f" * 32, None, 5)
    with pytest.raises(FailedPrecondition, match="needs a session"):
        handshake(path, trusted_uids(), dp.KIND_TABLE, "", None, 5)
    with UcmClient(daemon.target, dataplane=False) as c:
        session = c.aio._session_id
        assert session is not None
        with pytest.raises(InvalidArgument, match="unknown data-plane request kind 9"):
            handshake(path, trusted_uids(), 9, session, None, 5)
        conn, ring, table = raw_channel(c)
        try:
            with pytest.raises(FailedPrecondition, match="already has a data-plane channel"):
                raw_channel(c)
        finally:
            conn.close()  # type: ignore[attr-defined]
            ring.map.close()
            table.map.close()
    assert daemon.healthy()


def test_a_token_must_match_the_session_tenant(tmp_path: Path) -> None:
    tokens = tokens_file(tmp_path / "t.yaml", [("tok-a", "team-a", {}), ("tok-b", "team-b", {})])
    with (
        DaemonProcess(tmp_path / "d", args=["--auth-tokens-file", str(tokens)]) as d,
        UcmClient(d.target, token="tok-a", dataplane=False) as a,
    ):
        session = a.aio._session_id
        assert session is not None
        path = _dp_path(d)
        with pytest.raises(Unauthenticated):
            handshake(path, trusted_uids(), dp.KIND_CHANNEL, session, None, 5)
        with pytest.raises(Unauthenticated, match="unknown token"):
            handshake(path, trusted_uids(), dp.KIND_CHANNEL, session, "forged", 5)
        with pytest.raises(PermissionDenied, match="belongs to another tenant"):
            handshake(path, trusted_uids(), dp.KIND_TABLE, session, "tok-b", 5)
        conn, ring, table = raw_channel(a, "tok-a")  # the right one works
        conn.close()  # type: ignore[attr-defined]
        ring.map.close()
        table.map.close()
        assert d.healthy()


def test_a_flood_of_idle_connections_does_not_stop_the_socket(daemon: DaemonProcess) -> None:
    path = _dp_path(daemon)
    idle = []
    for _ in range(150):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(b"U")  # half a hello, then silence
        idle.append(s)
    try:
        assert daemon.healthy()
        time.sleep(6)  # past the handshake timeout: the daemon dropped them all
        _honest_round_trip(daemon, "after the flood")
    finally:
        for s in idle:
            s.close()


# -- the table -----------------------------------------------------------------------------------------
def test_a_client_cannot_write_the_table(daemon: DaemonProcess) -> None:
    with UcmClient(daemon.target, dataplane=False) as c:
        conn, ring, table = raw_channel(c)
        path = _dp_path(daemon)
        session = c.aio._session_id
        assert session is not None
        s, fds, _ = handshake(path, trusted_uids(), dp.KIND_TABLE, session, None, 5)
        s.close()
        (fd,) = fds
        try:
            assert os.fstat(fd).st_size == len(table.map)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, len(table.map), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # reopened writable: the seals still hold
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, len(table.map), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.pwrite(rw, b"x", 0)
                with pytest.raises(PermissionError):
                    os.ftruncate(rw, 0)
                with pytest.raises(PermissionError):
                    os.ftruncate(rw, len(table.map) * 2)
            finally:
                os.close(rw)
            libc = ctypes.CDLL(None, use_errno=True)
            addr = _mapping(len(table.map), "ucmd-presence")[0]  # the read-only mapping it was given
            assert libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(4096), 3) != 0  # PROT_READ|PROT_WRITE
            assert ctypes.get_errno() == 13  # EACCES: a read-only descriptor's mapping stays read-only
        finally:
            os.close(fd)
            conn.close()  # type: ignore[attr-defined]
            ring.map.close()
            table.map.close()
    assert daemon.healthy()


def _mapping(size: int, name: str) -> tuple[int, str]:
    """Where this process maps a memfd called ``name`` of ``size`` bytes: address and address range."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span = line.split()[0]
        start, end = (int(x, 16) for x in span.split("-"))
        if end - start == size and name in line:
            return start, span
    raise AssertionError(f"no mapping of {name} in /proc/self/maps")


# -- the ring ------------------------------------------------------------------------------------------
class RawRing:
    """An attacker's hands on a ring: raw entries, raw indices, raw bodies."""

    def __init__(self, client: UcmClient) -> None:
        self.conn, ring, self.table = raw_channel(client)
        self.map = ring.map
        header = dp.RING_HEADER.unpack_from(self.map, 0)
        _, _, _, _, self.sq, self.cq, self.sq_at, self.cq_at, self.msg_at, self.arena_at, self.arena = header
        self.tail = 0

    def submit(self, entry: bytes) -> None:
        at = self.sq_at + (self.tail % self.sq) * dp.SQE_BYTES
        self.map[at : at + dp.SQE_BYTES] = entry
        self.tail = (self.tail + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self.map, dp.R_SQ_TAIL, self.tail)
        self.bell()

    def bell(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(b"\x01", socket.MSG_DONTWAIT)  # type: ignore[attr-defined]

    def answers(self, want: int, timeout_s: float = 10.0) -> list[tuple[int, ...]]:
        """At least ``want`` completions (reading the queue as a client does), with their reasons."""
        out: list[tuple[int, ...]] = []
        head = struct.unpack_from("<I", self.map, dp.R_CQ_HEAD)[0]
        deadline = time.monotonic() + timeout_s
        while len(out) < want and time.monotonic() < deadline:
            tail = struct.unpack_from("<I", self.map, dp.R_CQ_TAIL)[0]
            while head != tail:
                slot = head % self.cq
                fields = dp.CQE.unpack_from(self.map, self.cq_at + slot * dp.CQE_BYTES)
                at = self.msg_at + slot * dp.MESSAGE_BYTES
                out.append((*fields, bytes(self.map[at : at + fields[9]])))  # type: ignore[arg-type]
                head = (head + 1) & 0xFFFFFFFF
            struct.pack_into("<I", self.map, dp.R_CQ_HEAD, head)
            time.sleep(0.01)
        return out

    def closed_by_daemon(self, timeout_s: float = 5.0) -> bool:
        self.conn.settimeout(timeout_s)  # type: ignore[attr-defined]
        try:
            while True:
                if not self.conn.recv(4096):  # type: ignore[attr-defined]
                    return True
        except OSError:
            return False

    def close(self) -> None:
        self.conn.close()  # type: ignore[attr-defined]
        self.map.close()
        self.table.map.close()


def _sqe(op: int, nblocks: int, user: int, at: int, nbytes: int, nseg: int, flags: int = 0) -> bytes:
    return dp.SQE.pack(op, flags, 0, nblocks, user, at, nbytes, nseg, 0, 0, 0, 0)


@pytest.fixture
def attacker(daemon: DaemonProcess) -> Iterator[tuple[UcmClient, RawRing, int, SharedBuffer]]:
    with UcmClient(daemon.target, client_name="attacker", dataplane=False) as c, SharedBuffer(1 << 20) as buf:
        region_handle = c.register(buf)
        region_id = c.aio._regions[region_handle].server_id
        assert region_id is not None
        ring = RawRing(c)
        try:
            yield c, ring, region_id, buf
        finally:
            ring.close()


def _body(region_id: int, n: int, *, offset: int = 0, size: int = 4096) -> bytes:
    keys = b"".join(key_digest("raw", i) for i in range(n))
    cols = struct.pack(
        f"<{3 * n}Q", *([region_id] * n), *(offset + i * size for i in range(n)), *([size] * n)
    )
    return NS + keys + cols


def test_a_well_formed_raw_request_works(attacker: tuple[UcmClient, RawRing, int, SharedBuffer]) -> None:
    _, ring, region_id, _ = attacker
    body = _body(region_id, 4)
    ring.map[ring.arena_at : ring.arena_at + len(body)] = body
    ring.submit(_sqe(dp.OP_DUMP, 4, 77, 0, len(body), 4))
    answers = ring.answers(2)
    assert [(a[0], a[1]) for a in answers] == [(77, dp.CQ_SUBMITTED), (77, dp.CQ_FINISHED)]
    assert answers[1][3] == 1  # all OK


@pytest.mark.parametrize(
    ("name", "entry", "reason"),
    [
        ("unknown op", _sqe(99, 1, 1, 0, 0, 1), b"unknown data-plane request 99"),
        ("huge counts", _sqe(dp.OP_DUMP, 0xFFFFFFFF, 1, 0, 1 << 40, 0xFFFFFFFF), b"inside the"),
        ("body past the arena", _sqe(dp.OP_LOAD, 1, 1, (8 << 20) - 8, 72, 1), b"inside the"),
        ("offset wraps", _sqe(dp.OP_LOAD, 1, 1, (1 << 64) - 8, 72, 1), b"inside the"),
        ("misaligned body", _sqe(dp.OP_LOAD, 1, 1, 3, 72, 1), b"inside the"),
        ("size not the counts'", _sqe(dp.OP_LOAD, 2, 1, 0, 72, 2), b"inside the"),
        ("segments not blocks", _sqe(dp.OP_LOAD, 2, 1, 0, 72, 1), b"1 segments for 2 blocks"),
        ("no blocks", _sqe(dp.OP_DUMP, 0, 1, 0, 16, 0), b"empty batch"),
        ("multi, counts wrong", _sqe(dp.OP_DUMP, 1, 1, 0, 16 + 32 + 8 + 48, 2, dp.SQF_MULTI), b"segment"),
    ],
)
def test_malformed_entries_are_refused(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer],
    daemon: DaemonProcess,
    name: str,
    entry: bytes,
    reason: bytes,
) -> None:
    client, ring, _, _ = attacker
    ring.map[ring.arena_at : ring.arena_at + 4096] = os.urandom(4096)
    ring.submit(entry)
    (answer,) = ring.answers(1)
    assert answer[1] == dp.CQ_REFUSED, name
    assert reason in answer[-1], (name, answer[-1])
    assert daemon.healthy()
    assert client.lookup(NS, [key_digest(1)]).hit_prefix == 0  # its gRPC calls still work


def test_another_sessions_region_cannot_be_named(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess
) -> None:
    _, ring, _, _ = attacker
    with UcmClient(daemon.target) as victim, SharedBuffer(1 << 20) as buf:
        victim_region = victim.aio._regions[victim.register(buf)].server_id
        assert victim_region is not None
        body = _body(victim_region, 2)
        ring.map[ring.arena_at : ring.arena_at + len(body)] = body
        ring.submit(_sqe(dp.OP_LOAD, 2, 5, 0, len(body), 2))
        (answer,) = ring.answers(1)
        assert answer[1] == dp.CQ_REFUSED and b"region" in answer[-1]


@pytest.mark.parametrize("index", [dp.R_SQ_TAIL, dp.R_CQ_HEAD])
def test_indices_out_of_range(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess, index: int
) -> None:
    client, ring, region_id, _ = attacker
    struct.pack_into("<I", ring.map, index, 0x7FFFFFFF)
    if index == dp.R_CQ_HEAD:
        body = _body(region_id, 1)
        ring.map[ring.arena_at : ring.arena_at + len(body)] = body
        ring.submit(_sqe(dp.OP_DUMP, 1, 1, 0, len(body), 1))  # answered into a queue it made look full
        time.sleep(0.5)
    else:
        ring.bell()
        assert ring.closed_by_daemon()  # a tail that cannot be: the ring is closed, nothing else
    assert daemon.healthy()
    assert client.lookup(NS, [key_digest(1)]).hit_prefix == 0
    _honest_round_trip(daemon, f"indices {index}")


def test_random_bytes_over_the_whole_ring(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess
) -> None:
    client, ring, _, _ = attacker
    rng = random.Random(5)
    for _ in range(20):
        start = rng.randrange(0, len(ring.map) - 65536)
        ring.map[start : start + 65536] = rng.randbytes(65536)
        ring.map[: dp.RING_HEADER_BYTES] = rng.randbytes(dp.RING_HEADER_BYTES)
        ring.bell()
        time.sleep(0.02)
    assert daemon.healthy()
    assert client.lookup(NS, [key_digest(1)]).hit_prefix == 0
    _honest_round_trip(daemon, "random ring")


def test_racing_writes_to_a_body_being_submitted(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess
) -> None:
    """A thread rewrites the arena (keys, region ids, offsets, lengths) while requests are taken: each
    request is decided on one copy (refused, or done as that copy said); the daemon goes on."""
    _, ring, region_id, _ = attacker
    stop = threading.Event()
    good = _body(region_id, 8)

    def scribble() -> None:
        rng = random.Random(9)
        while not stop.is_set():
            if rng.random() < 0.5:
                ring.map[ring.arena_at : ring.arena_at + len(good)] = good
            else:
                at = ring.arena_at + rng.randrange(0, len(good))
                ring.map[at : at + 8] = rng.randbytes(8)

    t = threading.Thread(target=scribble)
    t.start()
    try:
        for i in range(200):
            ring.submit(_sqe(dp.OP_DUMP if i % 2 else dp.OP_LOAD, 8, i, 0, len(good), 8))
            if i % 50 == 49:
                ring.answers(1, timeout_s=1)
    finally:
        stop.set()
        t.join()
    time.sleep(1)
    assert daemon.healthy()
    _honest_round_trip(daemon, "racing")


def test_a_client_that_never_reads_its_answers(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess
) -> None:
    _, ring, region_id, _ = attacker
    body = _body(region_id, 1)
    ring.map[ring.arena_at : ring.arena_at + len(body)] = body
    for i in range(3000):  # far more answers than its queue holds; never read
        at = ring.sq_at + (ring.tail % ring.sq) * dp.SQE_BYTES
        head = struct.unpack_from("<I", ring.map, dp.R_SQ_HEAD)[0]
        if (ring.tail - head) & 0xFFFFFFFF >= ring.sq:
            ring.bell()
            time.sleep(0.01)
            continue
        ring.map[at : at + dp.SQE_BYTES] = _sqe(dp.OP_DUMP, 1, i, 0, len(body), 1)
        ring.tail = (ring.tail + 1) & 0xFFFFFFFF
        struct.pack_into("<I", ring.map, dp.R_SQ_TAIL, ring.tail)
        ring.bell()
    time.sleep(1)
    assert daemon.healthy()
    _honest_round_trip(daemon, "unread")
    assert len(ring.answers(5)) >= 5  # reading again, it is served again


def test_a_doorbell_flood(
    attacker: tuple[UcmClient, RawRing, int, SharedBuffer], daemon: DaemonProcess
) -> None:
    _, ring, _, _ = attacker
    end = time.monotonic() + 1.5
    sent = 0
    while time.monotonic() < end:
        with contextlib.suppress(BlockingIOError):
            sent += ring.conn.send(b"\x01" * 65536, socket.MSG_DONTWAIT)  # type: ignore[attr-defined]
    assert sent > 1 << 20
    assert daemon.healthy()
    _honest_round_trip(daemon, "doorbells")


def test_the_ring_memory_cannot_be_resized(attacker: tuple[UcmClient, RawRing, int, SharedBuffer]) -> None:
    """The client may write its ring, never shrink or grow it (the daemon's mapping would fault)."""
    _, ring, _, _ = attacker
    _, span = _mapping(len(ring.map), "ucmd-ring")
    rw = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)  # the memfd behind the mapping, writable
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(rw, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(rw, 1 << 30)
    finally:
        os.close(rw)


_DIES = textwrap.dedent(
    """
    import sys, struct, time, os
    sys.path[:0] = sys.argv[2:]
    from ucm_client import UcmClient, SharedBuffer
    from support.blocks import NS, blocks_in
    c = UcmClient(sys.argv[1], client_name="doomed").connect()
    buf = SharedBuffer(64 << 20)
    region = c.register(buf)
    futures = [c.dump_nowait(NS, blocks_in(region, 1024, 65536, first=1024 * i)) for i in range(8)]
    print("submitted", flush=True)
    time.sleep(60)
    """
)


def test_a_client_that_dies_mid_request(daemon: DaemonProcess) -> None:
    tests_dir = str(Path(__file__).parents[1])
    root = str(Path(__file__).parents[2])
    proc = subprocess.Popen(
        [sys.executable, "-c", _DIES, daemon.target, tests_dir, root], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "submitted"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while "doomed" in daemon.log() and "ring of session" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.healthy()
    _honest_round_trip(daemon, "after a death")
    time.sleep(0.5)
    assert "ring of session" in daemon.log()  # its ring was closed when its connection ended
