"""KV events from a real daemon, read by a real subscriber written for vLLM's events.

The subscriber is ``examples/kv_events_indexer.py`` (vLLM's own ``KVEventBatch`` classes over a
ZeroMQ SUB socket, gaps repaired through the replay socket). After each kind of change (stores,
LRU eviction, ``ucm-admin evict`` and ``delete``, the Delete RPC, a quarantined corrupt block, a
restart) its index must equal what ``ucm-admin ls --json`` lists, projected to (medium, digest);
quota eviction and a shared tier's entries found or found gone by another node's daemon too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from support.blocks import NS, blocks_in
from support.kv_events import NodeSubscriber, listed, node, poll_until, record_removals, settle, vllm_hash
from test_admin import admin, json_of

from ucm_client import SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.kv_events.wire import Cleared, Removed, Stored, encode_batch, external_hashes
from ucm_server.testing.daemon import DaemonProcess

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # the subscriber's classes are vLLM's
msgspec = pytest.importorskip("msgspec")

BLOCK = 4096
NS2 = namespace_id(model="pytest-kv-events-rank1", dtype="uint8")


def test_wire_is_byte_identical_to_vllms_encoder() -> None:
    """What the daemon writes is what vLLM's msgspec encoder writes for the same batch."""
    ours = encode_batch(
        12.5,
        [Stored([b"a" * 32, b"b" * 32], "STORAGE"), Removed([b"c" * 32], "CPU"), Cleared()],
    )
    theirs = msgspec.msgpack.encode(
        kv_events.KVEventBatch(
            ts=12.5,
            events=[
                kv_events.BlockStored(
                    block_hashes=[b"a" * 32, b"b" * 32],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium="STORAGE",
                    lora_name=None,
                ),
                kv_events.BlockRemoved(block_hashes=[b"c" * 32], medium="CPU"),
                kv_events.AllBlocksCleared(),
            ],
        )
    )
    assert ours == theirs
    decoded = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(ours)
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decoded.events[1].medium == "CPU" and decoded.events[0].block_hashes[1] == b"b" * 32
    # int64 (the default) is what vLLM's own events carry for the same 32-byte hash
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    digest = bytes(range(32))
    assert external_hashes([digest], "int64") == [maybe_convert_block_hash(BlockHash(digest))]
    assert external_hashes([digest], "bytes") == [digest]
    # negative control: a different medium is a different payload
    removed = [b"c" * 32]
    assert encode_batch(12.5, [Removed(removed, "STORAGE")]) != encode_batch(12.5, [Removed(removed, "CPU")])


def events_args(pub: str, replay: str, *more: str) -> list[str]:
    """A daemon with a 16-block Cache publishing on ``pub`` with replay on ``replay``."""
    return [
        "--cache-capacity", f"{16 * BLOCK}", "--cache-page-size", f"{BLOCK}",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, *more,
    ]  # fmt: skip


@pytest.fixture
def events_daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, str, str]]:
    pub, replay = f"ipc://{tmp_path}/ev.pub", f"ipc://{tmp_path}/ev.replay"
    with DaemonProcess(tmp_path / "ucm", args=events_args(pub, replay, "--kv-events-node", "node-a")) as d:
        yield d, pub, replay


def test_index_follows_every_change_and_a_restart(
    events_daemon: tuple[DaemonProcess, str, str], shm: SharedBuffer
) -> None:
    d, pub, replay = events_daemon
    ctx: zmq.Context[Any] = zmq.Context()
    sub = NodeSubscriber(ctx, pub, replay)
    removals = record_removals(sub)
    try:
        sub.sync()  # a late joiner: snapshot of an empty index
        with UcmClient(d.target, client_name="pytest-events") as client:
            region = client.register(shm)
            shm.buf[: 40 * BLOCK] = os.urandom(40 * BLOCK)
            first = blocks_in(region, 12, BLOCK)
            assert client.wait(client.dump(NS, first, wait_durable=True), 30).ok
            # the same digests under a second namespace (another TP rank): one hash, two holders
            assert client.wait(client.dump(NS2, first[:4], wait_durable=True), 30).ok
            want = settle(sub, d)
            assert ("CPU", vllm_hash(first[0].key)) in want and ("STORAGE", vllm_hash(first[0].key)) in want

            # LRU eviction: 20 more blocks through a 16-block Cache
            more = blocks_in(region, 20, BLOCK, first=100, offset=12 * BLOCK)
            assert client.wait(client.dump(NS, more, wait_durable=True), 30).ok
            want = settle(sub, d)
            assert ("CPU", vllm_hash(first[0].key)) not in want
            assert ("STORAGE", vllm_hash(first[0].key)) in want
            assert any(e.medium == "CPU" for e in removals), "LRU evictions published no BlockRemoved"

            # one rank's copy deleted: the hash stays held (the other namespace has it)
            assert client.delete(NS2, [first[0].key]) == 1
            assert ("STORAGE", vllm_hash(first[0].key)) in settle(sub, d)
            # Delete RPC of the last holder, then ucm-admin delete and evict
            assert client.delete(NS, [first[0].key]) == 1
            assert ("STORAGE", vllm_hash(first[0].key)) not in settle(sub, d)
            assert admin(d, "delete", f"{NS.hex()}/{first[5].key.hex()}").returncode == 0
            assert admin(d, "evict", "--tier", "Cache", f"{NS.hex()}/{more[-1].key.hex()}").returncode == 0
            want = settle(sub, d)
            assert ("STORAGE", vllm_hash(first[5].key)) not in want and (
                "CPU",
                vllm_hash(more[-1].key),
            ) not in want

        # quarantine: a corrupt file found by verify is removed from the index and from the stream
        victim = first[6].key
        path = d.data_dir / "blocks" / NS.hex() / victim.hex()[:2] / f"{victim.hex()}.blk"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
        report = admin(d, "--json", "verify", "--tier", "Posix")
        assert report.returncode == 1 and json_of(report)["corrupt"] == 1, report.stdout
        assert ("STORAGE", vllm_hash(victim)) not in settle(sub, d)

        # negative control: an index that ignored removals would not match
        assert len(removals) >= 4

        # restart: the Cache is gone, the Posix index is re-adopted and announced
        before = sub.state.seq
        d.stop()
        d.start()
        want = settle(sub, d, timeout_s=20)
        assert want and all(medium == "STORAGE" for medium, _ in want)
        assert sub.state.seq > before
    finally:
        sub.close()
        ctx.term()


def test_late_joiner_gets_a_snapshot_and_bad_endpoint_is_named(
    events_daemon: tuple[DaemonProcess, str, str], shm: SharedBuffer, tmp_path: Path
) -> None:
    d, pub, replay = events_daemon
    with UcmClient(d.target, client_name="pytest-events") as client:
        region = client.register(shm)
        assert client.wait(client.dump(NS, blocks_in(region, 5, BLOCK), wait_durable=True), 30).ok
    ctx: zmq.Context[Any] = zmq.Context()
    late = NodeSubscriber(ctx, pub, replay)
    no_replay = NodeSubscriber(ctx, pub, None)
    try:
        late.sync()  # everything so far, without having seen a single streamed batch
        assert late.state.pairs() == listed(d) and len(late.state.pairs()) == 10
        no_replay.poll(300)
        assert no_replay.state.pairs() != listed(d)  # negative control: the stream alone missed it
    finally:
        late.close()
        no_replay.close()
        ctx.term()
    bad = DaemonProcess(tmp_path / "bad", args=["--kv-events-endpoint", "http://nope"])
    with pytest.raises(RuntimeError, match="kv_events_endpoint"):
        bad.start(timeout_s=20)
    assert key_digest("x")  # the helper module is the one the daemon's keys come from


def test_quota_eviction_is_published(tmp_path: Path) -> None:
    """A tenant over its 1 MiB quota loses its oldest blocks; the stream says so, in every medium."""
    from support.tokens import tokens_file

    tokens = tokens_file(tmp_path / "tokens.yaml", [("tok-alice", "alice", {"quota": "1MiB"})])
    pub, replay = f"ipc://{tmp_path}/ev.pub", f"ipc://{tmp_path}/ev.replay"
    args = [
        "--auth-tokens-file",
        str(tokens),
        "--kv-events-endpoint",
        pub,
        "--kv-events-replay-endpoint",
        replay,
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target, token="tok-alice") as alice:
        sub = NodeSubscriber(ctx, pub, replay)
        try:
            keys = [key_digest("quota", i) for i in range(48)]  # 3 MiB through a 1 MiB quota
            for first in range(0, 48, 8):
                assert alice.put_blocks(NS, [(k, os.urandom(64 << 10)) for k in keys[first : first + 8]]).ok
            present = alice.lookup(NS, keys).present
            assert sum(present) == 16  # negative control: most blocks really were evicted
            held = {vllm_hash(k) for k, p in zip(keys, present, strict=True) if p}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                sub.poll(100)
                seen = {h for hashes in sub.state.media.values() for h in hashes}
                if seen == held:
                    break
            assert {h for hashes in sub.state.media.values() for h in hashes} == held
            assert sub.state.media.get("CPU", set()) <= held and sub.state.media.get("STORAGE", set()) <= held
        finally:
            sub.close()
            ctx.term()


def test_shared_tier_entries_appear_and_expire_as_the_daemon_learns(tmp_path: Path) -> None:
    """Two daemons share a DS3FS tree (its POSIX path on a local directory). Node B publishes SHARED
    for blocks node A wrote once a lookup finds them, and removes them once a lookup finds them gone
    (A deleted them): what B's daemon learns, B's stream says."""
    mount = tmp_path / "3fs"
    mount.mkdir()

    settings = {"mount": str(mount), "usrbio": "off", "positive_ttl_s": 0.2, "negative_ttl_s": 0.2}
    cfg: dict[str, Any] = {"store_pipeline": "Cache|DS3FS", "tier_settings": {"DS3FS": settings}}
    cfg["shared_lookup_ttl_s"] = 0  # every lookup asks the tier (no answer cache in the pipeline)

    ctx: zmq.Context[Any] = zmq.Context()
    a, b = node(tmp_path, "a", cfg, False), node(tmp_path, "b", cfg, True)
    with a, b, UcmClient(a.target) as ca, UcmClient(b.target) as cb:
        sub = NodeSubscriber(ctx, f"ipc://{tmp_path}/b.pub", f"ipc://{tmp_path}/b.rep")
        try:
            sub.sync()
            keys = [key_digest("shared", i) for i in range(4)]
            assert ca.put_blocks(NS, [(k, os.urandom(4096)) for k in keys]).ok
            deadline = time.monotonic() + 10  # until A's write-back reaches the shared tree
            while cb.lookup(NS, keys).hit_prefix < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert cb.lookup(NS, keys).hit_prefix == 4
            expected = {vllm_hash(k) for k in keys}
            poll_until(sub, lambda: sub.state.media.get("SHARED", set()) == expected)
            assert not sub.state.media.get("CPU")  # negative control: B holds them only in the shared tier
            assert ca.delete(NS, keys[:2]) == 2
            time.sleep(0.5)  # past B's positive_ttl_s: its next lookup checks the tree again
            assert cb.lookup(NS, keys).present == [False, False, True, True]
            poll_until(
                sub,
                lambda: sub.state.media.get("SHARED", set()) == expected - {vllm_hash(k) for k in keys[:2]},
            )
        finally:
            sub.close()
            ctx.term()


def test_media_are_vllms_names_and_the_persistent_one_is_configurable(tmp_path: Path) -> None:
    from ucm_server.kv_events.ledger import MediumNames, medium_of
    from ucm_server.store.cache import CacheTier
    from ucm_server.store.posix import PosixTier

    posix, cache = PosixTier("Posix", roots=[tmp_path / "blocks"]), CacheTier("Cache", capacity=1 << 20)
    assert (medium_of(cache), medium_of(posix)) == (kv_events.MEDIUM_CPU, kv_events.MEDIUM_STORAGE)
    assert medium_of(posix, MediumNames(persistent="DISK")) == "DISK"  # a router of earlier releases


def block_file(d: DaemonProcess, key: bytes) -> Path:
    return d.data_dir / "blocks" / NS.hex() / key.hex()[:2] / f"{key.hex()}.blk"


def test_a_subscriber_that_stays_connected_converges_after_a_crash(tmp_path: Path, shm: SharedBuffer) -> None:
    """kill -9, a Posix block removed while the daemon is down, a restart, then no traffic at all: the
    subscriber that stayed connected matches ``ucm-admin ls`` within the heartbeat interval and a
    reconnect. Without heartbeats (the negative control) it keeps the dead Cache's blocks."""
    pub, replay = f"ipc://{tmp_path}/ev.pub", f"ipc://{tmp_path}/ev.replay"
    d = DaemonProcess(tmp_path / "ucm", args=events_args(pub, replay, "--kv-events-heartbeat-s", "0"))
    ctx: zmq.Context[Any] = zmq.Context()
    sub = NodeSubscriber(ctx, pub, replay)
    try:
        with d:
            sub.sync()
            with UcmClient(d.target, client_name="pytest-events") as client:
                region = client.register(shm)
                shm.buf[: 8 * BLOCK] = os.urandom(8 * BLOCK)
                blocks = blocks_in(region, 8, BLOCK)
                assert client.wait(client.dump(NS, blocks, wait_durable=True), 30).ok
            assert {m for m, _ in settle(sub, d)} == {"CPU", "STORAGE"}

            def crash_and_restart(heartbeat_s: str, victim: bytes) -> float:
                d.kill()
                block_file(d, victim).unlink()  # gone while the daemon is down
                d.extra_args[-1] = heartbeat_s
                d.start()
                return time.monotonic()

            crash_and_restart("0", blocks[0].key)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                sub.poll(100)
            truth = listed(d)
            assert ("CPU", vllm_hash(blocks[1].key)) in sub.state.pairs() and truth != sub.state.pairs()

            restarted = crash_and_restart("0.5", blocks[1].key)
            truth = listed(d)
            assert truth and all(m == "STORAGE" for m, _ in truth) and len(truth) == 6
            while sub.state.pairs() != truth and time.monotonic() < restarted + 5:
                sub.poll(100)
            took = time.monotonic() - restarted
            assert sub.state.pairs() == truth, f"not converged {took:.1f}s after the restart"
    finally:
        sub.close()
        ctx.term()


def test_a_second_daemon_cannot_take_over_the_event_endpoints(
    events_daemon: tuple[DaemonProcess, str, str], tmp_path: Path
) -> None:
    d, pub, replay = events_daemon
    with UcmClient(d.target) as client:
        assert client.put_blocks(NS, [(key_digest("first", i), os.urandom(BLOCK)) for i in range(3)]).ok
    second = DaemonProcess(
        tmp_path / "second", args=["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
    )
    with pytest.raises(RuntimeError, match=r"kv_events_endpoint: .*another ucm-server publishes there"):
        second.start(timeout_s=20)
    ctx: zmq.Context[Any] = zmq.Context()
    late = NodeSubscriber(ctx, pub, replay)
    try:
        late.sync()  # the first daemon still serves both sockets
        assert late.state.pairs() == listed(d) and len(late.state.pairs()) == 6
        # a live socket of another program (no lock to find) is refused too, and a file is never replaced
        foreign = ctx.socket(zmq.PUB)
        foreign.bind(f"ipc://{tmp_path}/foreign.pub")
        (tmp_path / "file.pub").write_text("not a socket")
        for name, why in (
            ("foreign.pub", "another process is listening there"),
            ("file.pub", "is not a socket"),
        ):
            other = DaemonProcess(
                tmp_path / f"by-{name}", args=["--kv-events-endpoint", f"ipc://{tmp_path}/{name}"]
            )
            with pytest.raises(RuntimeError, match=why):
                other.start(timeout_s=20)
        foreign.close(0)
        assert (tmp_path / "file.pub").read_text() == "not a socket"
    finally:
        late.close()
        ctx.term()


def test_nothing_is_bound_before_the_socket_directory_check(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # not the daemon's alone: start-up must stop before binding anything
    d = DaemonProcess(
        tmp_path / "ucm",
        socket=shared / "ucm.sock",
        args=[
            "--kv-events-endpoint",
            f"ipc://{tmp_path}/ev.pub",
            "--kv-events-replay-endpoint",
            f"ipc://{tmp_path}/ev.rep",
        ],
    )
    with pytest.raises(RuntimeError, match=r"socket directory .* mode 0755"):
        d.start(timeout_s=20)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ev.")]
