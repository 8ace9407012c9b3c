"""Tenants are isolated and accounted exactly.

Against real daemons with a tokens file, as a tenant trying to get more than its share would: two
tenants whose names share their first 64 bytes try to read and delete each other's blocks; a tenant
with a 1 MiB quota pushes 5 MiB through ``PutBlocks`` (the streaming path that used to skip quotas)
and a block bigger than its quota; 2,000 Lookups of new namespaces must leave the tenant ledger file
untouched; and a ledger file that is empty, cut, garbage, of the wrong shape or not a file at all
stops start-up with exit code 2 and a message naming the file, never a traceback (a line torn by a
crash in the middle of an append is the one damage recovered from, with a warning).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.errors import ResourceExhausted
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

PREFIX = "acme-inference-platform/" + "p" * 40  # exactly 64 bytes
assert len(PREFIX.encode()) == 64
ALICE, BOB = PREFIX + "/alice", PREFIX + "/bob"
TOKENS = {ALICE: "tok-long-alice", BOB: "tok-long-bob", PREFIX: "tok-prefix", "": "tok-ops-admin"}
KIB64 = 64 << 10


def _tokens_file(path: Path, quota: str | int = 0) -> Path:
    def extra(tenant: str) -> dict[str, object]:
        return {"admin": True} if not tenant else {"quota": quota} if tenant == ALICE else {}

    return tokens_file(path, [(token, tenant, extra(tenant)) for tenant, token in TOKENS.items()])


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[DaemonProcess]:
    tokens = _tokens_file(tmp_path / "tokens.yaml", quota="1MiB")
    with DaemonProcess(tmp_path / "ucm", args=["--auth-tokens-file", str(tokens)]) as d:
        yield d


def _client(d: DaemonProcess, tenant: str) -> UcmClient:
    return UcmClient(d.target, token=TOKENS[tenant])


def _stored_namespaces(d: DaemonProcess) -> set[bytes]:
    """Every namespace that holds a block, as the admin sees it."""
    with grpc.insecure_channel(d.target) as channel:
        reply = rpc.AdminStub(channel).ListBlocks(
            pb.ListBlocksRequest(page_size=10000),
            metadata=(("authorization", f"Bearer {TOKENS['']}"),),
            timeout=30,
        )
    return {bytes(b.namespace) for b in reply.blocks}


def _alive(d: DaemonProcess) -> None:
    """The daemon still serves: healthy, and a tenant's put/get round trip returns its bytes."""
    assert d.healthy()
    data = os.urandom(4096)
    with _client(d, BOB) as bob:
        assert bob.put_blocks(NS, [(key_digest("alive", 0), data)]).ok
        assert bob.get_blocks(NS, [key_digest("alive", 0)]) == [data]


@pytest.mark.slow
def test_tenants_sharing_a_64_byte_prefix_cannot_see_or_delete_each_others_blocks(
    tenants: DaemonProcess,
) -> None:
    keys = [key_digest("shared-prefix", i) for i in range(4)]
    data = [os.urandom(4096) for _ in keys]
    with _client(tenants, ALICE) as alice, _client(tenants, BOB) as bob, _client(tenants, PREFIX) as pre:
        assert alice.put_blocks(NS, list(zip(keys, data, strict=True))).ok
        for other in (bob, pre):  # same namespace and keys, names equal in their first 64 bytes
            assert other.lookup(NS, keys).hit_prefix == 0
            assert other.get_blocks(NS, keys) == [None] * 4
            assert other.delete(NS, keys) == 0
        assert alice.get_blocks(NS, keys) == data
        # Bob writes under the same keys: alice still reads her own bytes.
        assert bob.put_blocks(NS, [(k, b"b" * 4096) for k in keys]).ok
        assert alice.get_blocks(NS, keys) == data
        assert bob.get_blocks(NS, keys) == [b"b" * 4096] * 4
        assert pre.put_blocks(NS, [(keys[0], b"p" * 4096)]).ok
    # A name of at most 64 bytes keeps the namespace it had (keyed blake2b of the name): no migration.
    before = hashlib.blake2b(NS, digest_size=16, key=PREFIX.encode()).digest()
    stored = _stored_namespaces(tenants)
    assert before in stored
    assert len(stored) == 3  # alice, bob and the prefix tenant: three distinct namespaces
    _alive(tenants)


@pytest.mark.slow
def test_put_blocks_counts_against_the_quota(tenants: DaemonProcess) -> None:
    keys = [key_digest("put-quota", i) for i in range(80)]  # 5 MiB against a 1 MiB quota
    with _client(tenants, ALICE) as alice, _client(tenants, BOB) as bob:
        bob_keys = [key_digest("bob", i) for i in range(8)]
        assert bob.put_blocks(NS, [(k, b"B" * KIB64) for k in bob_keys]).ok
        for first in range(0, 80, 8):
            batch = [(k, os.urandom(KIB64)) for k in keys[first : first + 8]]
            assert alice.put_blocks(NS, batch).ok
        present = alice.lookup(NS, keys).present
        assert sum(present) == 16, "the tenant keeps more than its 1 MiB quota"
        assert present[-16:] == [True] * 16  # the newest are kept, the oldest went
        assert bob.lookup(NS, bob_keys).hit_prefix == 8  # another tenant loses nothing
        # PutBlocks and Dump share one account: the next put evicts the oldest block again.
        assert alice.put_blocks(NS, [(key_digest("put-quota", 999), os.urandom(KIB64))]).ok
        assert sum(alice.lookup(NS, keys).present) == 15
        # One block larger than the whole quota can never fit: refused, nothing stored or evicted.
        with pytest.raises(ResourceExhausted, match="larger than the quota"):
            alice.put_blocks(NS, [(key_digest("too-big", 0), os.urandom(2 << 20))])
        assert alice.lookup(NS, [key_digest("too-big", 0)]).hit_prefix == 0
        assert sum(alice.lookup(NS, keys).present) == 15
        with SharedBuffer(2 << 20) as buf:  # the same through Dump (shared memory)
            with pytest.raises(ResourceExhausted, match="larger than the quota"):
                alice.dump(NS, blocks_in(alice.register(buf), 1, 2 << 20, first=5000))
        assert sum(alice.lookup(NS, keys).present) == 15
    assert len(_stored_namespaces(tenants)) == 2  # alice's and bob's, nothing else was touched
    _alive(tenants)


@pytest.mark.slow
def test_lookups_of_new_namespaces_never_write_the_ledger(tenants: DaemonProcess) -> None:
    ledger = tenants.data_dir / "tenants.json"
    with _client(tenants, ALICE) as alice:
        assert alice.put_blocks(NS, [(key_digest("l", 0), b"x" * 4096)]).ok  # one claimed namespace
        before = ledger.stat()
        keys = [key_digest("l", 0)]
        for i in range(2000):
            assert alice.lookup(namespace_id(model="probe", i=i), keys).hit_prefix == 0
        after = ledger.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    assert len(ledger.read_text().splitlines()) == 2  # the start-up snapshot and one claim
    _alive(tenants)


@pytest.mark.slow
def test_quota_accounting_survives_a_restart_and_a_torn_ledger_append(tmp_path: Path) -> None:
    tokens = _tokens_file(tmp_path / "tokens.yaml", quota="1MiB")
    d = DaemonProcess(tmp_path / "ucm", args=["--auth-tokens-file", str(tokens)])
    keys = [key_digest("restart", i) for i in range(17)]
    with d, _client(d, ALICE) as alice:
        assert alice.put_blocks(NS, [(k, os.urandom(KIB64)) for k in keys[:16]]).ok  # exactly 1 MiB
    ledger = d.data_dir / "tenants.json"
    with ledger.open("ab") as f:
        f.write(b'{"ns": "00ff')  # an append cut by a crash
    with d, _client(d, ALICE) as alice:
        assert "skipping a torn last line" in d.log()
        assert alice.lookup(NS, keys[:16]).hit_prefix == 16
        assert alice.put_blocks(NS, [(keys[16], os.urandom(KIB64))]).ok
        present = alice.lookup(NS, keys).present
        # The pre-restart blocks still count: one of them made room (which one follows the tiers'
        # stored_at, and write-back writes a batch's files in parallel).
        assert sum(present) == 16 and present[16]
        _alive(d)
    assert ledger.read_bytes().endswith(b"\n") and b"00ff" not in ledger.read_bytes()  # compacted


@pytest.mark.slow
def test_a_ledger_in_the_0_1_format_is_read(tmp_path: Path) -> None:
    tokens = _tokens_file(tmp_path / "tokens.yaml", quota="1MiB")
    d = DaemonProcess(tmp_path / "ucm", args=["--auth-tokens-file", str(tokens)])
    keys = [key_digest("old", i) for i in range(17)]
    with d, _client(d, ALICE) as alice:
        assert alice.put_blocks(NS, [(k, os.urandom(KIB64)) for k in keys[:16]]).ok
    ledger = d.data_dir / "tenants.json"
    owned: dict[str, str] = {}
    for line in ledger.read_text().splitlines():  # snapshot + claims, rewritten the way 0.1 did it:
        doc = json.loads(line)  # one document, no newline
        owned.update(doc.get("namespaces", {doc.get("ns"): doc.get("tenant")}))
    assert list(owned.values()) == [ALICE]
    ledger.write_text(json.dumps({"namespaces": owned}))
    with d, _client(d, ALICE) as alice:
        assert alice.put_blocks(NS, [(keys[16], os.urandom(KIB64))]).ok
        present = alice.lookup(NS, keys).present
        assert sum(present) == 16 and present[16]  # the 0.1 ledger's namespace still counts


NS_HEX = "00" * 16
DAMAGE: dict[str, Callable[[Path], None]] = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_text(json.dumps({"namespaces": {NS_HEX: "alice", "11" * 16: "b"}})[:30]),
    "garbage": lambda p: p.write_bytes(os.urandom(64) + b"\n"),
    "a list": lambda p: p.write_text("[1, 2, 3]\n"),
    "namespaces not a map": lambda p: p.write_text('{"namespaces": ["x"]}\n'),
    "namespace not hex": lambda p: p.write_text('{"namespaces": {"zz": "alice"}}\n'),
    "tenant not a string": lambda p: p.write_text(json.dumps({"namespaces": {NS_HEX: 5}}) + "\n"),
    "bad line in the middle": lambda p: p.write_text(
        json.dumps({"namespaces": {}}) + "\nnot json\n" + json.dumps({"ns": NS_HEX, "tenant": "a"}) + "\n"
    ),
    "a directory": lambda p: p.mkdir(),
    "a fifo": os.mkfifo,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.slow
def test_a_damaged_ledger_stops_start_up_with_a_clear_error(tmp_path: Path, damage: str) -> None:
    tokens = _tokens_file(tmp_path / "tokens.yaml")
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    ledger = data_dir / "tenants.json"
    DAMAGE[damage](ledger)
    cmd = [sys.executable, "-m", "ucm_server", "--socket", str(tmp_path / "s" / "ucm.sock")]
    cmd += ["--data-dir", str(data_dir), "--metrics-address", "off", "--auth-tokens-file", str(tokens)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"tenant ledger {ledger}" in proc.stderr
    assert "move it aside" in proc.stderr  # and says what to do
    assert "Traceback" not in proc.stderr
