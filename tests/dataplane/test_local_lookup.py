"""Lookup answered from the daemon's shared table, against a real daemon: the same answers as the RPC.

Through concurrent eviction, daemon restarts (clean and ``kill -9``), TTL expiry, tenants, pipelines
the table does not fully cover, and clients that cannot or may not use it (TCP, ``UCM_DATAPLANE=off``,
a daemon with ``dataplane: false``): a local answer is never one the RPC would not give.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.dataplane import needs_native
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

pytestmark = needs_native


def _both(client: UcmClient, rpc: UcmClient, keys: list[bytes], ns: bytes = NS) -> tuple[object, object]:
    before = client._plane.lookups_local
    local = client.lookup(ns, keys)
    assert client._plane.lookups_local == before + 1, "the table did not answer"
    return local, rpc.lookup(ns, keys)


def test_local_answers_equal_the_rpc_and_count_in_the_daemon_stats(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "d", args=["--cache-capacity", "64MiB"]) as d,
        UcmClient(d.target) as c,
        UcmClient(d.target, dataplane=False) as rpc,
        SharedBuffer(8 << 20) as buf,
    ):
        region = c.register(buf)
        stored = blocks_in(region, 300, 4096)
        assert c.wait(c.dump(NS, stored), 30).ok
        rng = random.Random(3)
        keys = [b.key for b in stored] + [key_digest("never", i) for i in range(300)]
        for _ in range(20):
            sample = rng.sample(keys, rng.randrange(0, 600))
            local, remote = _both(c, rpc, sample)
            assert local == remote
        local, remote = _both(c, rpc, [b.key for b in stored[:50]])  # a full hit
        assert local == remote and local.hit_prefix == 50  # type: ignore[attr-defined]
        empty_ns = namespace_id(model="nothing stored here")
        local, remote = _both(c, rpc, keys[:10], ns=empty_ns)
        assert local == remote and not any(local.present)  # type: ignore[attr-defined]
        stats = rpc.stats()
        assert stats.lookups >= 22 + 22  # the local ones count, as the RPC's do
        assert stats.lookup_keys >= 50 + 10 and stats.lookup_hits >= 50


def test_malformed_lookups_are_refused_as_the_rpc_refuses_them(client: UcmClient) -> None:
    from ucm_client.errors import InvalidArgument

    client.lookup(NS, [key_digest(1)])  # the channel is open
    assert client._plane.active
    with pytest.raises(InvalidArgument, match=r"keys\[1\] must be 32 bytes"):
        client.lookup(NS, [key_digest(1), b"short"])
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes"):
        client.lookup(b"ns", [key_digest(1)])


def test_lookups_stay_right_under_concurrent_eviction(tmp_path: Path) -> None:
    """A Cache-only daemon too small for what is dumped: blocks come and go while lookups run.
    Never-stored keys are never present; once the dumps stop, local answers equal the RPC's."""
    args = ["--store-pipeline", "Cache", "--cache-capacity", "4MiB", "--cache-page-size", "4KiB"]
    with (
        DaemonProcess(tmp_path / "d", args=args) as d,
        UcmClient(d.target) as c,
        UcmClient(d.target, dataplane=False) as rpc,
        SharedBuffer(16 << 20) as buf,
    ):
        region = c.register(buf)
        blocks = blocks_in(region, 4096, 4096)
        never = [key_digest("never", i) for i in range(256)]
        stop = threading.Event()
        errors: list[BaseException] = []

        def dumps() -> None:
            try:
                rng = random.Random(1)
                while not stop.is_set():
                    start = rng.randrange(0, 4096 - 256)
                    c.wait(c.dump(NS, blocks[start : start + 256]), 30)
            except BaseException as exc:  # reported below
                errors.append(exc)

        writer = threading.Thread(target=dumps)
        writer.start()
        try:
            deadline = time.monotonic() + 4
            seen_hits = 0
            while time.monotonic() < deadline:
                keys = [b.key for b in blocks[::8]] + never
                answer = c.lookup(NS, keys)
                assert not any(answer.present[-len(never) :])
                seen_hits += sum(answer.present)
        finally:
            stop.set()
            writer.join(60)
        assert not errors, errors
        assert seen_hits > 0
        keys = [b.key for b in blocks]
        time.sleep(0.1)
        local, remote = _both(c, rpc, keys)
        assert local == remote
        assert 0 < sum(local.present) < len(keys)  # type: ignore[attr-defined]  # evicted and kept, both


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_after_a_restart_the_old_table_is_never_read(tmp_path: Path, how: str) -> None:
    """The daemon goes away with blocks in its table; a new one starts at the same socket with an
    empty store. The client's next lookup says absent (from the new daemon's table), not present from
    the old daemon's memory, which it still had mapped."""
    sock = tmp_path / "s" / "ucm.sock"
    first = DaemonProcess(tmp_path / "a", socket=sock, args=["--store-pipeline", "Cache"])
    second = DaemonProcess(tmp_path / "b", socket=sock, args=["--store-pipeline", "Cache"])
    with SharedBuffer(1 << 20) as buf:
        first.start()
        c = UcmClient(first.target).connect()
        try:
            region = c.register(buf)
            blocks = blocks_in(region, 8, 4096)
            assert c.wait(c.dump(NS, blocks), 10).ok
            assert c.lookup(NS, [b.key for b in blocks]).hit_prefix == 8
            old_channel = c._plane._channel
            assert old_channel is not None
            if how == "kill":
                first.kill()
            else:
                first.stop()
            second.start()
            answers = [c.lookup(NS, [b.key for b in blocks]).hit_prefix for _ in range(3)]
            assert answers == [0, 0, 0]
            assert c._plane._channel is not old_channel
            assert c.wait(c.dump(NS, blocks[:2]), 10).ok  # the new session's ring works
            assert c.lookup(NS, [b.key for b in blocks]).hit_prefix == 2
        finally:
            c.close()
            second.stop()
            first.stop()


def test_an_expired_block_is_not_answered_present(client: UcmClient, shm: SharedBuffer) -> None:
    region = client.register(shm)
    blocks = blocks_in(region, 4, 4096)
    assert client.wait(client.dump(NS, blocks), 10).ok
    keys = [b.key for b in blocks]
    assert client.lookup(NS, keys).hit_prefix == 4
    client.set_retention(NS, keys[:1], ttl_s=0.3)
    time.sleep(0.4)
    assert client.lookup(NS, keys).present == [False, True, True, True]


def test_tenants_see_only_their_own_namespaces(tmp_path: Path) -> None:
    """Two tenants store the same namespace and keys. Each client's table (the memory it maps) holds
    its own tenant's blocks only: tenant B's digests are nowhere in tenant A's table, even as bytes."""
    tokens = tokens_file(tmp_path / "tokens.yaml", [("tok-a", "team-a", {}), ("tok-b", "team-b", {})])
    args = ["--auth-tokens-file", str(tokens), "--store-pipeline", "Cache"]
    with (
        DaemonProcess(tmp_path / "d", args=args) as d,
        UcmClient(d.target, token="tok-a") as a,
        UcmClient(d.target, token="tok-b") as b,
        SharedBuffer(1 << 20) as buf_a,
        SharedBuffer(1 << 20) as buf_b,
    ):
        ra, rb = a.register(buf_a), b.register(buf_b)
        only_b = [x for x in blocks_in(rb, 16, 4096, first=100)]
        shared_names = blocks_in(ra, 8, 4096)
        assert a.wait(a.dump(NS, shared_names), 10).ok
        assert b.wait(b.dump(NS, only_b), 10).ok
        keys_b = [x.key for x in only_b]
        deadline = time.monotonic() + 5
        while a._plane.lookups_local == 0 and time.monotonic() < deadline:  # tracked after a first ask
            assert a.lookup(NS, keys_b).hit_prefix == 0
            time.sleep(0.05)
        assert a._plane.lookups_local > 0
        assert a.lookup(NS, keys_b).hit_prefix == 0
        assert a.lookup(NS, [x.key for x in shared_names]).hit_prefix == 8
        table = a._plane._channel.table.map  # type: ignore[union-attr]
        memory = bytes(table)
        assert not any(k in memory for k in keys_b)
        assert all(x.key in memory for x in shared_names)
        while b._plane.lookups_local == 0 and time.monotonic() < deadline:
            b.lookup(NS, keys_b)
            time.sleep(0.05)
        assert b.lookup(NS, keys_b).hit_prefix == 16
        assert b.lookup(NS, [x.key for x in shared_names]).hit_prefix == 0


def test_a_pipeline_the_table_does_not_cover_asks_the_rpc_for_misses(tmp_path: Path) -> None:
    """Compressed Posix blocks sit behind a wrapper whose index the table cannot watch: a full hit in
    the Cache is answered locally, anything else by the RPC (which asks every tier)."""
    args = ["--store-pipeline", "Cache|Posix", "--codec-tiers", "Posix", "--cache-capacity", "64MiB"]
    with (
        DaemonProcess(tmp_path / "d", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(1 << 20) as buf,
    ):
        region = c.register(buf)
        blocks = blocks_in(region, 8, 4096)
        assert c.wait(c.dump(NS, blocks, wait_durable=True), 10).ok
        keys = [b.key for b in blocks]
        before = c._plane.lookups_local
        assert c.lookup(NS, keys).hit_prefix == 8
        assert c._plane.lookups_local == before + 1
        answer = c.lookup(NS, [*keys, key_digest("missing")])
        assert answer.hit_prefix == 8 and answer.present[-1] is False
        assert c._plane.lookups_local == before + 1  # that one was the RPC's


def test_clients_that_may_not_use_the_table_use_the_rpc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DaemonProcess(tmp_path / "d", args=["--no-dataplane"]) as d, UcmClient(d.target) as c:
        assert c.lookup(NS, [key_digest(1)]).hit_prefix == 0
        assert not c._plane.active and not (d.socket.parent / "ucm.sock.dp").exists()
    with DaemonProcess(tmp_path / "e") as d:
        monkeypatch.setenv("UCM_DATAPLANE", "off")
        with UcmClient(d.target) as c:
            assert c.lookup(NS, [key_digest(1)]).hit_prefix == 0
            assert not c._plane.active
        monkeypatch.delenv("UCM_DATAPLANE")
        with UcmClient(d.target) as c:
            c.lookup(NS, [key_digest(1)])
            assert c._plane.active
    assert os.environ.get("UCM_DATAPLANE") is None
