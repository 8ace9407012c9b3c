"""A client cannot make the daemon hold its memory, shown under a real memory limit (a cgroup).

Shared memory is charged to whoever first touches a page. A client that hands over a memfd it sealed
but never allocated, or punches holes into its memory after registering it, gets the daemon's copy
to allocate those pages: charged to the daemon, which the kernel then OOM-kills under its container
limit. Here the daemon runs in a 384 MiB memory cgroup and stores 16 blocks of 1 MiB; a well-behaved
client loads them 32 times over into 512 MiB of its own memory (the baseline: the daemon's peak
barely moves). Then, as attackers: memory never allocated is refused at the fd socket; memory
allocated at handover and punched before ``RegisterRegion`` is refused there; memory punched after
registration has its next load refused and the region dropped; and holes punched while loads run
cost the daemon at most the loads in flight, which it gives back. The daemon is never OOM-killed and
its peak stays within the baseline's plus what is in flight.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in
from support.cgroup import CgroupUnavailable, MemoryCgroup, memory_cgroup

from ucm_client import SharedBuffer, UcmClient
from ucm_client.errors import UcmError
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_protocol.errors import InvalidArgument
from ucm_protocol.fdpass import REPLY, REQUEST, REQUEST_MAGIC, VERSION, fd_socket_path
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

LIMIT = 384 << 20
BLOCK = 1 << 20
STORED = 16  # blocks the daemon holds; every load is all 16 of them
REGION = 512 << 20  # more than the daemon's whole limit
IN_FLIGHT = STORED * BLOCK
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


class LimitedDaemon(DaemonProcess):
    """The daemon inside ``cgroup`` from its first instruction."""

    def __init__(self, workdir: Path, cgroup: MemoryCgroup, args: list[str]) -> None:
        super().__init__(workdir, args=args)
        self.cgroup = cgroup

    def command(self) -> list[str]:
        return self.cgroup.command(super().command())


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LimitedDaemon]:
    try:
        with memory_cgroup(LIMIT) as cgroup:
            d = LimitedDaemon(tmp_path_factory.mktemp("limited"), cgroup, ["--cache-capacity", "64MiB"])
            with d:
                assert d.proc is not None and d.proc.pid in cgroup.processes()
                with UcmClient(d.target) as c, SharedBuffer(STORED * BLOCK) as src:
                    src.buf[:] = os.urandom(src.size)
                    assert c.wait(c.dump(NS, blocks_in(c.register(src), STORED, BLOCK)), 60).ok
                yield d
    except CgroupUnavailable as exc:
        pytest.skip(f"no memory cgroup for the daemon: {exc}")


def _punch(fd: int, size: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _punch_until(fd: int, stop: threading.Event) -> None:
    while not stop.is_set():
        _punch(fd, REGION)


def _load_everywhere(c: UcmClient, region: int) -> list[str]:
    """The 16 stored blocks loaded into every 16 MiB of the region, one load after another; the
    refusals (an empty list: every load copied)."""
    refused = []
    for base in range(0, REGION, IN_FLIGHT):
        try:
            result = c.wait(c.load(NS, blocks_in(region, STORED, BLOCK, offset=base)), 60)
            if not result.ok:
                refused.append(f"load at {base}: {result.reasons}")
        except UcmError as exc:
            refused.append(f"load at {base}: {type(exc).__name__}: {exc}")
    return refused


def _alive(d: LimitedDaemon) -> None:
    assert d.proc is not None and d.proc.poll() is None, f"the daemon died:\n{d.log()}"
    assert d.cgroup.oom_kills() == 0, f"the kernel OOM-killed in the daemon's cgroup:\n{d.log()}"
    assert d.healthy()


def _baseline(d: LimitedDaemon) -> int:
    """The daemon's peak while a well-behaved client loads 512 MiB into its own SharedBuffer."""
    d.cgroup.reset_peak()
    with UcmClient(d.target) as c, SharedBuffer(REGION) as buf:
        assert _load_everywhere(c, c.register(buf)) == []
        assert bytes(buf.buf[REGION - BLOCK : REGION - BLOCK + 64]) != bytes(64)
    return d.cgroup.peak()


def _peak_within_baseline(d: LimitedDaemon, baseline: int, what: str) -> None:
    _alive(d)
    peak = d.cgroup.peak()
    allowance = baseline + 2 * IN_FLIGHT + (16 << 20)
    assert peak <= allowance, f"{what}: the daemon peaked at {peak >> 20} MiB (baseline {baseline >> 20} MiB)"
    assert peak < LIMIT


def _raw_hand_over(d: LimitedDaemon, fd: int, size: int) -> tuple[int, str]:
    """The fd socket spoken directly, as an attacker would (the client library refuses holes itself):
    the reply's status and text."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(fd_socket_path(d.socket)))
        socket.send_fds(s, [REQUEST.pack(REQUEST_MAGIC, VERSION, size)], [fd])
        head = s.recv(REPLY.size, socket.MSG_WAITALL)
        _, status, length = REPLY.unpack(head)
        return status, s.recv(length, socket.MSG_WAITALL).decode(errors="replace")


def test_memory_never_allocated_is_refused_before_the_daemon_touches_it(limited: LimitedDaemon) -> None:
    baseline = _baseline(limited)
    limited.cgroup.reset_peak()
    fd = os.memfd_create("never-allocated", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, REGION)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        status, text = _raw_hand_over(limited, fd, REGION)
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], (status, text)
        assert "only 0 of 536870912 bytes are allocated" in text, text
        with pytest.raises(InvalidArgument, match="only 0 of 536870912 bytes are allocated"):
            hand_over(limited.socket, fd, REGION, trusted_uids())  # the library says so before sending
    finally:
        os.close(fd)
    _peak_within_baseline(limited, baseline, "a memfd never allocated")


def test_memory_punched_between_handover_and_registration_is_refused(limited: LimitedDaemon) -> None:
    baseline = _baseline(limited)
    limited.cgroup.reset_peak()
    with grpc.insecure_channel(limited.target) as channel, SharedBuffer(REGION) as buf:
        kv = rpc.KVStoreStub(channel)
        stream = kv.Attach(pb.AttachRequest(client_name="attacker", pid=os.getpid()))
        metadata = (("ucm-session", next(stream).session_id),)
        token = hand_over(limited.socket, buf.fileno(), REGION, trusted_uids())  # allocated: accepted
        _punch(buf.fileno(), REGION)
        with pytest.raises(grpc.RpcError) as refused:
            kv.RegisterRegion(
                pb.RegisterRegionRequest(memfd_token=token, size=REGION), metadata=metadata, timeout=30
            )
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "only 0 of 536870912 bytes are allocated" in (refused.value.details() or ""), (
            refused.value.details()
        )
        stream.cancel()  # type: ignore[attr-defined]
    _peak_within_baseline(limited, baseline, "memory punched before RegisterRegion")


def test_memory_punched_after_registration_is_refused_and_dropped(limited: LimitedDaemon) -> None:
    baseline = _baseline(limited)
    limited.cgroup.reset_peak()
    with UcmClient(limited.target) as c, SharedBuffer(REGION) as buf:
        region = c.register(buf)
        _punch(buf.fileno(), REGION)
        refused = _load_everywhere(c, region)
        assert len(refused) == REGION // IN_FLIGHT, refused  # none copied
        # Refused by the check before the copy, or dropped already by the one between prefault steps.
        assert "has holes" in refused[0] or "unknown region" in refused[0], refused[0]
        assert all("unknown region" in r for r in refused[1:]), refused[1:3]
    assert "changed after registration (only" in limited.log()
    _peak_within_baseline(limited, baseline, "memory punched after registration")


def test_holes_punched_while_loads_run_cost_at_most_the_loads_in_flight(limited: LimitedDaemon) -> None:
    baseline = _baseline(limited)
    for attempt in range(3):
        limited.cgroup.reset_peak()
        with UcmClient(limited.target) as c, SharedBuffer(REGION) as buf:
            region = c.register(buf)
            stop = threading.Event()
            puncher = threading.Thread(target=_punch_until, args=(buf.fileno(), stop))
            puncher.start()
            try:
                refused = _load_everywhere(c, region)
            finally:
                stop.set()
                puncher.join()
            assert refused, f"attempt {attempt}: every load into memory being punched was accepted"
        _peak_within_baseline(limited, baseline, f"holes punched during loads (attempt {attempt})")
