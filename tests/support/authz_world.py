"""The authorization matrix's harness: its callers, the world they live in, targets, and the data
plane's probes (``tests/security/test_authorization.py`` plays the table with these)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from support.blocks import NS
from ucm_client import SharedBuffer
from ucm_client.dataplane.channel import open_channel
from ucm_client.dataplane.ring import RingClient
from ucm_client.dataplane.table import Miss, TableView
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_client.types import BlockIO, Segment
from ucm_protocol import dataplane as dp
from ucm_protocol.errors import UcmError
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

REACHED, UNREACHED = "reached", "unreached"
Outcome = str | None
BLOCK = 4096


# -- the callers ---------------------------------------------------------------------------------------
@dataclass
class Caller:
    name: str
    channel: grpc.Channel
    token: str = ""
    local: bool = True
    """Over the Unix socket (only such a caller has memory of its own registered)."""
    session: str = ""
    region: int = 0
    buffer: SharedBuffer | None = None
    stored_ns: bytes = b""
    """How ``NS`` is stored for this caller's tenant (found by listing, not computed)."""
    _attach: Iterator[pb.SessionEvent] | None = None

    @property
    def kv(self) -> rpc.KVStoreStub:
        return rpc.KVStoreStub(self.channel)

    @property
    def admin(self) -> rpc.AdminStub:
        return rpc.AdminStub(self.channel)

    def md(self, session: str | None = None) -> list[tuple[str, str]]:
        out = [("authorization", f"Bearer {self.token}")] if self.token else []
        session = self.session if session is None else session
        return out + ([("ucm-session", session)] if session else [])


@dataclass
class World:
    """One daemon's callers, and what the harness (an admin of that daemon) sees of its blocks."""

    daemon: DaemonProcess
    callers: dict[str, Caller]
    harness: Caller
    keep: list[SharedBuffer] = field(default_factory=list)

    def state(self, ns: bytes, digest: bytes) -> tuple[object, ...] | None:
        """What each tier holds of a block (size, stored_at) and its priority; ``None`` when absent.
        Taken once write-back has settled, so that only a call's own effect changes it."""
        md = self.harness.md("")
        while self.harness.admin.Stats(pb.StatsRequest(), metadata=md, timeout=10).pending_writeback:
            time.sleep(0.01)
        try:
            block = self.harness.admin.Inspect(
                pb.InspectRequest(namespace=ns, key=digest), metadata=md, timeout=10
            )
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.NOT_FOUND, exc
            return None
        held = []
        for tier in block.block.tiers:
            request = pb.ListBlocksRequest(namespace=ns, tier=tier, page_size=10000)
            listed = self.harness.admin.ListBlocks(request, metadata=md, timeout=10).blocks
            held += [(tier, b.size, b.stored_at) for b in listed if bytes(b.key) == digest]
        return block.block.retention.priority, tuple(held)

    def tier_of(self, ns: bytes, digest: bytes) -> str:
        """The first tier that holds a block."""
        request = pb.InspectRequest(namespace=ns, key=digest)
        return str(
            self.harness.admin.Inspect(request, metadata=self.harness.md(""), timeout=10).block.tiers[0]
        )

    def stored_ns(self, digest: bytes) -> bytes:
        """The namespace a block of this digest is stored under (as the admin lists it)."""
        reply = self.harness.admin.ListBlocks(
            pb.ListBlocksRequest(page_size=10000), metadata=self.harness.md(""), timeout=10
        )
        (ns,) = {bytes(b.namespace) for b in reply.blocks if bytes(b.key) == digest}
        return ns

    def region(self, owner: Caller) -> int:
        """A fresh region of ``owner``'s session (its memory handed over on the fd socket)."""
        buf = SharedBuffer(BLOCK)
        self.keep.append(buf)
        token = hand_over(self.daemon.socket, buf.fileno(), BLOCK, trusted_uids())
        return int(
            owner.kv.RegisterRegion(
                pb.RegisterRegionRequest(memfd_token=token, size=BLOCK), metadata=owner.md(), timeout=10
            ).region_id
        )


def put(owner: Caller, digest: bytes, ns: bytes = NS) -> bytes:
    data = os.urandom(BLOCK)
    reply = owner.kv.PutBlocks(
        iter([pb.BlockBytes(namespace=ns, key=digest, data=data)]), metadata=owner.md()
    )
    assert list(reply.block_status) == [pb.BLOCK_OK], reply
    return data


@dataclass
class Target:
    ns: bytes = b""
    """The namespace as the caller names it in a data call."""
    stored_ns: bytes = b""
    """... as stored: how an Admin call names it."""
    digest: bytes = b""
    data: bytes = b""
    session: str = ""
    region: int = 0
    task: int = 0
    tier: str = ""
    before: tuple[object, ...] | None = None


Probe = Callable[[World, Caller, Target], Outcome]


def wait_done(c: Caller, task_id: int) -> pb.TaskStatus:
    status = c.kv.Wait(pb.WaitRequest(task_id=task_id, timeout_s=20), metadata=c.md(), timeout=30)
    assert status.state == pb.TASK_DONE, status
    return status


def batch_of(c: Caller, t: Target) -> pb.BlockBatch:
    return pb.BlockBatch(namespace=t.ns, keys=[t.digest], region_ids=[c.region], offsets=[0], lengths=[BLOCK])


def read_outcome(status: int, got: bytes, t: Target) -> Outcome:
    """A read either hands over exactly the target's bytes, or nothing at all."""
    if status == pb.BLOCK_OK:
        assert got == t.data, "a read returned bytes that are not the block's"
        return REACHED
    assert status == pb.BLOCK_MISSING and got in (b"", bytes(BLOCK)), "a missing block left bytes behind"
    return UNREACHED


def write_outcome(w: World, t: Target) -> Outcome:
    return REACHED if w.state(t.stored_ns, t.digest) != t.before else UNREACHED


# -- the data plane: the same targets through the table and the ring ----------------------------------
@dataclass
class Plane:
    ring: RingClient
    table: TableView

    def close(self) -> None:
        self.ring.close()
        self.table.close()


PLANES: dict[tuple[int, str], Plane | UcmError] = {}
"""Each caller's data-plane channel on a daemon (by the daemon object), or the refusal that met it."""


def _plane(w: World, c: Caller) -> Plane:
    """``c``'s channel for its session, opened once (a session has one), as its token opens it."""
    slot = (id(w.daemon), c.name)
    if slot not in PLANES:
        path = dp.dataplane_socket_path(w.daemon.socket)
        try:
            conn, ring, table = open_channel(path, trusted_uids(), c.session, c.token or None, 5.0)
            PLANES[slot] = Plane(RingClient(conn, ring.map), TableView(table.map, table.generation))
        except UcmError as exc:
            PLANES[slot] = exc
    found = PLANES[slot]
    if isinstance(found, UcmError):
        raise found
    return found


def probe_dp_lookup(w: World, c: Caller, t: Target) -> Outcome:
    plane = _plane(w, c)
    deadline = time.monotonic() + 10
    while True:
        answer = plane.table.lookup(t.ns, [t.digest])
        if answer is Miss.UNKNOWN and not plane.table.flags & dp.FLAG_COMPLETE:
            return UNREACHED  # a table of some tiers (encrypted ones here) says nothing of an absent key
        if not isinstance(answer, Miss) or time.monotonic() > deadline:
            break
        if answer is Miss.UNTRACKED:  # a table of some namespaces: ask for this one, as the client does
            plane.ring.track(t.ns)
        time.sleep(0.02)
    assert not isinstance(answer, Miss), f"the table never answered: {answer}"
    return REACHED if answer[1][0] else UNREACHED


def _ring_task(w: World, c: Caller, op: int, t: Target) -> pb.TaskStatus | None:
    """A Load or Dump of the target through the caller's ring: its status, or None when it ended
    all OK (a refusal raises, as the RPC's does)."""
    plane = _plane(w, c)
    block = BlockIO(t.digest, (Segment(c.region, 0, BLOCK),))
    sent = plane.ring.submit(op, t.ns, [block], {c.region: c.region})
    assert sent is not None, "a one-block request fits the ring"
    task_id = sent.result(10).task_id
    finished = plane.ring.wait_finished(task_id, 20)
    assert finished is not None and finished.state == pb.TASK_DONE, finished
    if finished.all_ok:
        return None
    return wait_done(c, task_id)


def probe_dp_load(w: World, c: Caller, t: Target) -> Outcome:
    assert c.buffer is not None
    c.buffer.buf[:BLOCK] = bytes(BLOCK)
    status = _ring_task(w, c, dp.OP_LOAD, t)
    state = pb.BLOCK_OK if status is None else status.block_status[0]
    return read_outcome(state, bytes(c.buffer.buf[:BLOCK]), t)


def probe_dp_dump(w: World, c: Caller, t: Target) -> Outcome:
    assert c.buffer is not None
    c.buffer.buf[:BLOCK] = os.urandom(BLOCK)
    status = _ring_task(w, c, dp.OP_DUMP, t)
    assert status is None, status
    return write_outcome(w, t)


def close_planes(w: World) -> None:
    """Close the data-plane channels the callers of ``w`` opened."""
    for slot in [s for s in PLANES if s[0] == id(w.daemon)]:
        plane = PLANES.pop(slot)
        if isinstance(plane, Plane):
            plane.close()


DATA_PLANE_PROBES: dict[str, Probe] = {
    "DataPlane/Lookup": probe_dp_lookup,
    "DataPlane/Load": probe_dp_load,
    "DataPlane/Dump": probe_dp_dump,
}
