"""Authorization as one matrix: every RPC x every kind of principal x every kind of target.

``TABLE`` is the rule as a caller meets it, written down once: for each RPC of ``ucm.v1`` and each
principal, what happens when it aims at its own blocks (or session), at another tenant's, and at
unowned ones. Every cell is then played against real daemons, as an attacker would play it: a block
of another tenant is named exactly as that tenant's namespace is stored (which anyone can derive from
the tenant's name), a session by its real id. An RPC added to the proto without a row here fails
``test_every_rpc_has_a_row``; one the daemon has no rule for is refused by the daemon itself.

Outcomes: ``REACHED`` (the call acted on the target: returned its bytes, deleted it, changed its
retention, listed it...), ``UNREACHED`` (the call succeeded and the target was neither seen nor
changed: the caller met a namespace of its own that holds nothing), or the exact gRPC status code.
``None``: the combination does not exist (a daemon without tokens has no other tenant; Attach and
Stats name no target).

The principals, on two daemons started one after the other on one data directory:

* a daemon without tokens, with an anonymous TCP listener: ``local`` (a Unix-socket client) and
  ``anonymous_tcp``; it also stores, in a namespace as named, the blocks that are *unowned* later;
* the same data directory under a tokens file and ``encrypt_tiers: Posix``: ``alice`` (a tenant with
  a key file: her blocks are sealed on disk), ``bob``, ``tenantless`` (a token without a tenant),
  ``admin`` (an admin token of tenant ops), ``admin_no_tenant`` (an admin token without a tenant) and
  ``no_token`` (a local client that shows no token).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from support.blocks import NS
from support.tls import tcp_port
from support.tokens import tokens_file

from ucm_client import SharedBuffer, key_digest, namespace_id
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.authz import RULES
from ucm_server.testing.daemon import DaemonProcess

REACHED, UNREACHED = "reached", "unreached"
UNAUTH, DENIED, NO_SESSION = "UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION"
Outcome = str | None
TARGETS = ("own", "other", "unowned")
OPEN = ("local", "anonymous_tcp")
TOKENED = ("no_token", "alice", "bob", "tenantless", "admin", "admin_no_tenant")
BLOCK = 4096
NS_UNOWNED = namespace_id(model="stored-before-tokens")


def _all(outcome: Outcome) -> tuple[Outcome, ...]:
    return (outcome, outcome, outcome)


CONFINED = (REACHED, UNREACHED, UNREACHED)
"""Its own blocks only: another tenant's, named as stored, and unowned ones are not there for it."""
ONE_TENANT = (REACHED, None, REACHED)
"""A daemon without tokens: one principal's tenant, every block its own (the socket's mode guards it)."""

DATA = {
    "local": ONE_TENANT,
    "anonymous_tcp": ONE_TENANT,
    "no_token": _all(UNAUTH),
    **dict.fromkeys(("alice", "bob", "tenantless", "admin", "admin_no_tenant"), CONFINED),
}
"""A call that names blocks by namespace and key."""
MEMORY_DATA = {**DATA, "anonymous_tcp": (DENIED, None, DENIED)}
"""Load and Dump: a TCP peer has no memory of its own; naming a local session's region is refused."""
SESSION = {
    "local": (REACHED, None, NO_SESSION),
    "anonymous_tcp": (REACHED, None, NO_SESSION),
    "no_token": _all(UNAUTH),
    **dict.fromkeys(
        ("alice", "bob", "tenantless", "admin", "admin_no_tenant"), (REACHED, DENIED, NO_SESSION)
    ),
}
"""A call that names a session (its regions, its tasks): another tenant's is refused."""
ONLY_OWN = {p: (REACHED, None, None) for p in (*OPEN, *TOKENED)} | {"no_token": (UNAUTH, None, None)}
"""Attach: it makes a session of the caller's own and names nothing else."""
STORE = {
    "local": ONE_TENANT,
    "anonymous_tcp": (DENIED, None, DENIED),
    "no_token": _all(UNAUTH),
    **dict.fromkeys(("alice", "bob", "tenantless"), _all(DENIED)),
    **dict.fromkeys(("admin", "admin_no_tenant"), _all(REACHED)),
}
"""An Admin call: names blocks as stored, answers names, sizes and figures; admins only."""
STATS = {p: (outcomes[0], None, None) for p, outcomes in STORE.items()}

TABLE: dict[str, dict[str, tuple[Outcome, ...]]] = {
    "KVStore/Attach": ONLY_OWN,
    "KVStore/RegisterRegion": {**SESSION, "anonymous_tcp": (DENIED, None, DENIED)},
    "KVStore/UnregisterRegion": {**SESSION, "anonymous_tcp": (DENIED, None, NO_SESSION)},
    "KVStore/Lookup": DATA,
    "KVStore/Load": MEMORY_DATA,
    "KVStore/Dump": MEMORY_DATA,
    "KVStore/Prefetch": DATA,
    "KVStore/Wait": SESSION,
    "KVStore/Check": SESSION,
    "KVStore/Cancel": SESSION,
    "KVStore/Delete": DATA,
    "KVStore/SetRetention": DATA,
    "KVStore/GetBlocks": DATA,
    "KVStore/PutBlocks": DATA,
    "Admin/Stats": STATS,
    "Admin/ListBlocks": STORE,
    "Admin/Inspect": STORE,
    "Admin/Evict": STORE,
    "Admin/Verify": STORE,
}
"""THE table: RPC -> principal -> outcome for its own, another tenant's and unowned targets."""


def test_every_rpc_has_a_row() -> None:
    """Every method of every ``ucm.v1`` service has a row here and a rule in the daemon, and every
    row has every principal: a method added to the proto fails here until someone decides."""
    methods = {f"{s.name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert len(methods) >= 19  # the walk saw the services
    assert set(TABLE) == methods
    assert set(RULES) == {f"/ucm.v1.{m}" for m in methods}
    for name, row in TABLE.items():
        assert set(row) == {*OPEN, *TOKENED}, name


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


# -- the probes: one per RPC, each says what its call reached --------------------------------------------
Probe = Callable[[World, Caller, Target], Outcome]


def _wait(c: Caller, task_id: int) -> pb.TaskStatus:
    status = c.kv.Wait(pb.WaitRequest(task_id=task_id, timeout_s=20), metadata=c.md(), timeout=30)
    assert status.state == pb.TASK_DONE, status
    return status


def _batch(c: Caller, t: Target) -> pb.BlockBatch:
    return pb.BlockBatch(namespace=t.ns, keys=[t.digest], region_ids=[c.region], offsets=[0], lengths=[BLOCK])


def _read_outcome(status: int, got: bytes, t: Target) -> Outcome:
    """A read either hands over exactly the target's bytes, or nothing at all."""
    if status == pb.BLOCK_OK:
        assert got == t.data, "a read returned bytes that are not the block's"
        return REACHED
    assert status == pb.BLOCK_MISSING and got in (b"", bytes(BLOCK)), "a missing block left bytes behind"
    return UNREACHED


def _write_outcome(w: World, t: Target) -> Outcome:
    return REACHED if w.state(t.stored_ns, t.digest) != t.before else UNREACHED


def probe_lookup(w: World, c: Caller, t: Target) -> Outcome:
    r = c.kv.Lookup(pb.LookupRequest(namespace=t.ns, keys=[t.digest]), metadata=c.md(), timeout=10)
    return REACHED if r.present[0] else UNREACHED


def probe_get(w: World, c: Caller, t: Target) -> Outcome:
    (reply,) = c.kv.GetBlocks(
        pb.GetBlocksRequest(namespace=t.ns, keys=[t.digest]), metadata=c.md(), timeout=10
    )
    return _read_outcome(reply.status, reply.data, t)


def probe_load(w: World, c: Caller, t: Target) -> Outcome:
    assert c.buffer is not None
    c.buffer.buf[:BLOCK] = bytes(BLOCK)
    handle = c.kv.Load(pb.LoadRequest(blocks=_batch(c, t)), metadata=c.md(), timeout=10)
    status = _wait(c, handle.task_id)
    return _read_outcome(status.block_status[0], bytes(c.buffer.buf[:BLOCK]), t)


def probe_dump(w: World, c: Caller, t: Target) -> Outcome:
    assert c.buffer is not None
    c.buffer.buf[:BLOCK] = os.urandom(BLOCK)
    handle = c.kv.Dump(pb.DumpRequest(blocks=_batch(c, t)), metadata=c.md(), timeout=10)
    assert list(_wait(c, handle.task_id).block_status) == [pb.BLOCK_OK]
    return _write_outcome(w, t)


def probe_put(w: World, c: Caller, t: Target) -> Outcome:
    put(c, t.digest, t.ns)
    return _write_outcome(w, t)


def probe_prefetch(w: World, c: Caller, t: Target) -> Outcome:
    handle = c.kv.Prefetch(pb.PrefetchRequest(namespace=t.ns, keys=[t.digest]), metadata=c.md(), timeout=10)
    status = _wait(c, handle.task_id).block_status[0]
    return REACHED if status == pb.BLOCK_OK else UNREACHED


def probe_delete(w: World, c: Caller, t: Target) -> Outcome:
    r = c.kv.Delete(pb.DeleteRequest(namespace=t.ns, keys=[t.digest]), metadata=c.md(), timeout=10)
    after = w.state(t.stored_ns, t.digest)
    if r.deleted:
        assert after is None
        return REACHED
    assert after == t.before, (after, t.before)
    return UNREACHED


def probe_retention(w: World, c: Caller, t: Target) -> Outcome:
    r = c.kv.SetRetention(
        pb.SetRetentionRequest(namespace=t.ns, keys=[t.digest], set_priority=True, priority=7),
        metadata=c.md(),
        timeout=10,
    )
    after = w.state(t.stored_ns, t.digest)
    if r.applied:
        assert after is not None and after[0] == 7
        return REACHED
    assert r.missing == 1 and after == t.before
    return UNREACHED


def probe_attach(w: World, c: Caller, t: Target) -> Outcome:
    call = c.kv.Attach(pb.AttachRequest(client_name="probe", pid=os.getpid()), metadata=c.md(""))
    try:
        return REACHED if next(call).session_id else UNREACHED
    finally:
        call.cancel()


def probe_register(w: World, c: Caller, t: Target) -> Outcome:
    buf = SharedBuffer(BLOCK)
    w.keep.append(buf)
    token = hand_over(w.daemon.socket, buf.fileno(), BLOCK, trusted_uids())  # a token, however obtained
    request = pb.RegisterRegionRequest(memfd_token=token, size=BLOCK)
    return REACHED if c.kv.RegisterRegion(request, metadata=c.md(t.session), timeout=10).region_id else None


def probe_unregister(w: World, c: Caller, t: Target) -> Outcome:
    c.kv.UnregisterRegion(
        pb.UnregisterRegionRequest(region_id=t.region), metadata=c.md(t.session), timeout=10
    )
    return REACHED


def probe_wait(w: World, c: Caller, t: Target) -> Outcome:
    c.kv.Wait(pb.WaitRequest(task_id=t.task, timeout_s=0), metadata=c.md(t.session), timeout=10)
    return REACHED


def probe_check(w: World, c: Caller, t: Target) -> Outcome:
    c.kv.Check(pb.TaskHandle(task_id=t.task), metadata=c.md(t.session), timeout=10)
    return REACHED


def probe_cancel(w: World, c: Caller, t: Target) -> Outcome:
    c.kv.Cancel(pb.CancelRequest(task_id=t.task), metadata=c.md(t.session), timeout=10)
    return REACHED


def probe_stats(w: World, c: Caller, t: Target) -> Outcome:
    return REACHED if c.admin.Stats(pb.StatsRequest(), metadata=c.md(""), timeout=10).tiers else None


def probe_list(w: World, c: Caller, t: Target) -> Outcome:
    request = pb.ListBlocksRequest(namespace=t.stored_ns, page_size=10000)
    reply = c.admin.ListBlocks(request, metadata=c.md(""), timeout=10)
    return REACHED if t.digest in {bytes(b.key) for b in reply.blocks} else UNREACHED


def probe_inspect(w: World, c: Caller, t: Target) -> Outcome:
    request = pb.InspectRequest(namespace=t.stored_ns, key=t.digest)
    return REACHED if c.admin.Inspect(request, metadata=c.md(""), timeout=10).block.size == BLOCK else None


def probe_evict(w: World, c: Caller, t: Target) -> Outcome:
    request = pb.EvictRequest(tier=t.tier, namespace=t.stored_ns, keys=[t.digest])
    return REACHED if c.admin.Evict(request, metadata=c.md(""), timeout=10).blocks == 1 else UNREACHED


def probe_verify(w: World, c: Caller, t: Target) -> Outcome:
    request = pb.VerifyRequest(tier=t.tier, namespace=t.stored_ns, quarantine=False)
    events = list(c.admin.Verify(request, metadata=c.md(""), timeout=30))
    assert events[-1].done and events[-1].corrupt == 0
    return REACHED if events[-1].checked else UNREACHED


PROBES: dict[str, Probe] = {
    "KVStore/Attach": probe_attach,
    "KVStore/RegisterRegion": probe_register,
    "KVStore/UnregisterRegion": probe_unregister,
    "KVStore/Lookup": probe_lookup,
    "KVStore/Load": probe_load,
    "KVStore/Dump": probe_dump,
    "KVStore/Prefetch": probe_prefetch,
    "KVStore/Wait": probe_wait,
    "KVStore/Check": probe_check,
    "KVStore/Cancel": probe_cancel,
    "KVStore/Delete": probe_delete,
    "KVStore/SetRetention": probe_retention,
    "KVStore/GetBlocks": probe_get,
    "KVStore/PutBlocks": probe_put,
    "Admin/Stats": probe_stats,
    "Admin/ListBlocks": probe_list,
    "Admin/Inspect": probe_inspect,
    "Admin/Evict": probe_evict,
    "Admin/Verify": probe_verify,
}
SESSION_CALLS = {"KVStore/RegisterRegion", "KVStore/UnregisterRegion", "KVStore/Wait", "KVStore/Check"}
SESSION_CALLS |= {"KVStore/Cancel", "KVStore/Attach"}


# -- playing the table ---------------------------------------------------------------------------------
def _owner(w: World, caller: str, kind: str) -> Caller:
    """Whose block (or session) a target is: the caller's own, or another tenant's."""
    if kind == "own":
        return w.callers["tenantless" if caller == "no_token" else caller]
    return w.callers["bob" if caller == "alice" else "alice"]


def _target(w: World, rpc_name: str, caller: str, kind: str) -> Target:
    cell = f"{rpc_name}/{caller}/{kind}"
    if rpc_name in SESSION_CALLS:
        if kind == "unowned":  # a session nobody attached
            return Target(session="f" * 32, region=1, task=1)
        owner = _owner(w, caller, kind)
        region = w.region(owner) if owner.local else w.callers["local"].region
        prefetch = pb.PrefetchRequest(namespace=NS, keys=[key_digest(cell, 0)])
        task = owner.kv.Prefetch(prefetch, metadata=owner.md(), timeout=10).task_id
        return Target(session=owner.session, region=region, task=task)
    digest = key_digest(cell, 0)
    if kind == "unowned":  # stored without tokens, under the namespace as named: nobody's
        if "local" in w.callers:  # the daemon without tokens stores it now
            UNOWNED[digest] = put(w.callers["local"], digest, NS_UNOWNED)
        t = Target(ns=NS_UNOWNED, stored_ns=NS_UNOWNED, digest=digest, data=UNOWNED[digest])
    else:
        owner = _owner(w, caller, kind)
        data = put(owner, digest)
        t = Target(ns=NS, stored_ns=owner.stored_ns, digest=digest, data=data)
        if kind == "other" or rpc_name.startswith("Admin/"):  # named exactly as it is stored
            t.ns = owner.stored_ns
    t.before = w.state(t.stored_ns, t.digest)
    assert t.before is not None, cell
    t.tier = w.tier_of(t.stored_ns, t.digest)
    return t


def play(w: World, principals: tuple[str, ...]) -> dict[tuple[str, str, str], Outcome]:
    found: dict[tuple[str, str, str], Outcome] = {}
    for rpc_name, row in TABLE.items():
        for caller in principals:
            for kind, expected in zip(TARGETS, row[caller], strict=True):
                if expected is None:
                    continue
                t = _target(w, rpc_name, caller, kind)
                try:
                    found[rpc_name, caller, kind] = PROBES[rpc_name](w, w.callers[caller], t)
                except grpc.RpcError as exc:
                    found[rpc_name, caller, kind] = exc.code().name
    return found


UNOWNED: dict[bytes, bytes] = {}
"""The blocks the daemon without tokens stores for the tokened one's "unowned" targets."""


def _attach(c: Caller) -> None:
    call = c.kv.Attach(pb.AttachRequest(client_name=c.name, pid=os.getpid()), metadata=c.md(""))
    c.session = next(call).session_id
    c._attach = call


def _close(w: World) -> None:
    for c in [*w.callers.values(), w.harness]:
        if c._attach is not None:
            c._attach.cancel()  # type: ignore[attr-defined]
        c.channel.close()
    for buf in w.keep:
        buf.close()


def _local(w: World, c: Caller) -> None:
    """A local caller: attached, with a region of its own and its stored namespace found."""
    _attach(c)
    c.buffer = SharedBuffer(BLOCK)
    w.keep.append(c.buffer)
    token = hand_over(w.daemon.socket, c.buffer.fileno(), BLOCK, trusted_uids())
    request = pb.RegisterRegionRequest(memfd_token=token, size=BLOCK)
    c.region = c.kv.RegisterRegion(request, metadata=c.md(), timeout=10).region_id
    digest = key_digest(f"namespace of {c.name}", 0)
    put(c, digest)
    c.stored_ns = w.stored_ns(digest)


def _open_world(daemon: DaemonProcess) -> World:
    unix = grpc.insecure_channel(daemon.target)
    local = Caller("local", unix)
    tcp = grpc.insecure_channel(f"127.0.0.1:{tcp_port(daemon)}")
    anonymous = Caller("anonymous_tcp", tcp, local=False)
    w = World(daemon, {"local": local, "anonymous_tcp": anonymous}, Caller("harness", unix))
    _local(w, local)
    _attach(anonymous)
    anonymous.stored_ns = local.stored_ns  # one tenant: the default, namespaces as named
    anonymous.region, anonymous.buffer = local.region, local.buffer  # it has none: a local one's
    return w


TOKENS = {
    "alice": ("tok-alice", "alice", {}),
    "bob": ("tok-bob", "bob", {}),
    "tenantless": ("tok-tenantless", "", {}),
    "admin": ("tok-admin-ops", "ops", {"admin": True}),
    "admin_no_tenant": ("tok-admin", "", {"admin": True}),
}


def _sealed_tokens(directory: Path) -> Path:
    """The tokens file of :data:`TOKENS`, alice with a key file of her own (her blocks sealed)."""
    key_file = directory / "alice.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    entries = [
        (token, tenant, {"key_file": str(key_file)} if tenant == "alice" else extra)
        for token, tenant, extra in TOKENS.values()
    ]
    return tokens_file(directory / "tokens.yaml", entries)


def _tokened_world(daemon: DaemonProcess) -> World:
    unix = grpc.insecure_channel(daemon.target)
    callers = {name: Caller(name, unix, token=token) for name, (token, _, _) in TOKENS.items()}
    callers["no_token"] = Caller("no_token", unix)
    w = World(daemon, callers, Caller("harness", unix, token=TOKENS["admin_no_tenant"][0]))
    for name in TOKENS:
        _local(w, callers[name])
    no_token = callers["no_token"]  # it cannot attach: it names the tenantless caller's session
    no_token.session, no_token.region, no_token.buffer = (
        callers["tenantless"].session,
        callers["tenantless"].region,
        callers["tenantless"].buffer,
    )
    return w


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Outcome]:
    tmp = tmp_path_factory.mktemp("authz")
    common = ["--cache-capacity", "128MiB"]
    tcp = ["--listen", "127.0.0.1:0", "--insecure", "--allow-anonymous-tcp"]
    found: dict[tuple[str, str, str], Outcome] = {}
    with DaemonProcess(tmp / "ucm", args=[*common, *tcp]) as d:
        w = _open_world(d)
        try:
            found |= play(w, OPEN)
            for rpc_name in TABLE:  # the later daemon's unowned blocks, stored in a namespace as named
                for caller in TOKENED:
                    digest = key_digest(f"{rpc_name}/{caller}/unowned", 0)
                    UNOWNED[digest] = put(w.callers["local"], digest, NS_UNOWNED)
        finally:
            _close(w)
    tokens = _sealed_tokens(tmp)
    args = [*common, "--auth-tokens-file", str(tokens), "--encrypt-tiers", "Posix"]
    with DaemonProcess(tmp / "ucm", args=args) as d:
        w = _tokened_world(d)
        try:
            found |= play(w, TOKENED)
        finally:
            _close(w)
    return found


@pytest.mark.parametrize("rpc_name", list(TABLE))
def test_authorization_matrix(rpc_name: str, outcomes: dict[tuple[str, str, str], Outcome]) -> None:
    """Each RPC's row, as played against the daemons: every principal, every target."""
    expected = {
        (caller, kind): outcome
        for caller, row in TABLE[rpc_name].items()
        for kind, outcome in zip(TARGETS, row, strict=True)
        if outcome is not None
    }
    played = {(caller, kind): outcomes[rpc_name, caller, kind] for caller, kind in expected}
    assert played == expected


def test_the_table_was_played_whole(outcomes: dict[tuple[str, str, str], Outcome]) -> None:
    cells = sum(1 for row in TABLE.values() for r in row.values() for o in r if o is not None)
    assert len(outcomes) == cells > 300
    assert set(outcomes.values()) >= {REACHED, UNREACHED, UNAUTH, DENIED, NO_SESSION}


# -- the plaintext of a sealed tenant -------------------------------------------------------------------
PLAIN = b"alice's system prompt, sealed at rest " * 64
PLAIN_BLOCK = PLAIN + bytes(BLOCK * 2 - len(PLAIN))


def alice_namespace(ns: bytes) -> bytes:
    """How alice's namespace is stored: anyone can derive it from her name (keyed blake2b)."""
    return hashlib.blake2b(ns, digest_size=16, key=b"alice").digest()


def test_a_sealed_tenants_blocks_reach_nobody_else_in_plaintext(tmp_path: Path) -> None:
    """Alice's blocks are encrypted at rest with her key. A token without a tenant, an admin
    without a tenant, an admin of another tenant and another tenant all name her namespace exactly
    as it is stored, by every data call, while the block is in the Cache and once only its sealed
    copy on disk is left: nobody gets a byte of it. Admin calls show the block (name, size,
    tiers), never its bytes. Alice herself reads it back (the negative control)."""
    tokens = _sealed_tokens(tmp_path)
    args = ["--auth-tokens-file", str(tokens), "--encrypt-tiers", "Posix", "--cache-capacity", "64MiB"]
    digest = key_digest("sealed", 0)
    stolen = alice_namespace(NS)
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        w = _tokened_world(d)
        try:
            alice = w.callers["alice"]
            reply = alice.kv.PutBlocks(
                iter([pb.BlockBytes(namespace=NS, key=digest, data=PLAIN_BLOCK)]), metadata=alice.md()
            )
            assert list(reply.block_status) == [pb.BLOCK_OK]
            assert w.stored_ns(digest) == stolen  # the attackers' name for it is the right one
            w.state(stolen, digest)  # write-back settled: the sealed copy is on disk
            for in_cache in (True, False):
                if not in_cache:
                    w.harness.admin.Evict(
                        pb.EvictRequest(tier="Cache", all=True), metadata=w.harness.md(""), timeout=10
                    )
                    assert w.tier_of(stolen, digest) == "Posix"
                for name in ("tenantless", "admin_no_tenant", "admin", "bob"):
                    _attack(w, w.callers[name], stolen, digest)
            sealed = [p.read_bytes() for p in d.data_dir.rglob("*.blk")]
            assert sealed and not any(PLAIN[:64] in b for b in sealed)  # sealed on disk
            (got,) = alice.kv.GetBlocks(pb.GetBlocksRequest(namespace=NS, keys=[digest]), metadata=alice.md())
            assert got.status == pb.BLOCK_OK and got.data == PLAIN_BLOCK  # opened for its owner
        finally:
            _close(w)


def _attack(w: World, c: Caller, ns: bytes, digest: bytes) -> None:
    """Every call that could hand over a block's bytes, aimed at ``ns``/``digest``."""
    md = c.md()
    (got,) = c.kv.GetBlocks(pb.GetBlocksRequest(namespace=ns, keys=[digest]), metadata=md, timeout=10)
    assert (got.status, got.data) == (pb.BLOCK_MISSING, b""), c.name
    assert not c.kv.Lookup(pb.LookupRequest(namespace=ns, keys=[digest]), metadata=md, timeout=10).present[0]
    assert c.buffer is not None
    c.buffer.buf[:BLOCK] = bytes(BLOCK)
    for length in (BLOCK * 2, BLOCK * 2 + 48, 48):  # the block's size, the envelope's, the overhead
        batch = pb.BlockBatch(
            namespace=ns, keys=[digest], region_ids=[c.region], offsets=[0], lengths=[length]
        )
        try:
            handle = c.kv.Load(pb.LoadRequest(blocks=batch), metadata=md, timeout=10)
        except grpc.RpcError as exc:  # longer than the region
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc
            continue
        assert list(_wait(c, handle.task_id).block_status) == [pb.BLOCK_MISSING], c.name
    assert bytes(c.buffer.buf[:BLOCK]) == bytes(BLOCK)
    handle = c.kv.Prefetch(pb.PrefetchRequest(namespace=ns, keys=[digest]), metadata=md, timeout=10)
    assert list(_wait(c, handle.task_id).block_status) == [pb.BLOCK_MISSING]
    if "admin" in c.name:  # an admin sees the block as stored, and nothing of what it holds
        admin_md = c.md("")
        inspected = c.admin.Inspect(
            pb.InspectRequest(namespace=ns, key=digest), metadata=admin_md, timeout=10
        )
        listed = c.admin.ListBlocks(pb.ListBlocksRequest(namespace=ns), metadata=admin_md, timeout=10)
        verified = list(c.admin.Verify(pb.VerifyRequest(namespace=ns, quarantine=False), metadata=admin_md))
        assert inspected.block.size == len(PLAIN_BLOCK) and listed.blocks
        for reply in (inspected, listed, *verified):
            assert PLAIN[:32] not in reply.SerializeToString()


def test_a_namespace_the_ledger_gives_another_tenant_is_refused(tmp_path: Path) -> None:
    """The second line: should a caller's namespace ever resolve to one the tenant ledger records as
    another tenant's (here the ledger is made to say so, as a collision of the keyed mapping would),
    the call is refused rather than served."""
    tokens = tokens_file(tmp_path / "tokens.yaml", [entry for entry in TOKENS.values()])
    d = DaemonProcess(tmp_path / "ucm", args=["--auth-tokens-file", str(tokens)])
    digest = key_digest("ledger", 0)
    with d:
        w = _tokened_world(d)
        try:
            tenantless = w.callers["tenantless"]
            put(tenantless, digest)
            mine = w.stored_ns(digest)
            put(w.callers["alice"], digest)  # alice's namespace is claimed: the ledger exists
        finally:
            _close(w)
    with (d.data_dir / "tenants.json").open("a") as ledger:
        ledger.write(json.dumps({"ns": mine.hex(), "tenant": "alice"}) + "\n")
    with d:
        channel = grpc.insecure_channel(d.target)
        md = [("authorization", f"Bearer {TOKENS['tenantless'][0]}")]
        with pytest.raises(grpc.RpcError) as refused:
            rpc.KVStoreStub(channel).Lookup(pb.LookupRequest(namespace=NS, keys=[digest]), metadata=md)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "belongs to another tenant" in str(refused.value.details())
        md = [("authorization", f"Bearer {TOKENS['alice'][0]}")]  # alice still reads her own
        (got,) = rpc.KVStoreStub(channel).GetBlocks(
            pb.GetBlocksRequest(namespace=NS, keys=[digest]), metadata=md
        )
        assert got.status == pb.BLOCK_OK
        channel.close()
