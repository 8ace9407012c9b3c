"""Who reads which KV events, tried the way an attacker would, against real daemons.

A tenant's block hashes reach only subscribers allowed to see them: with CURVE each subscriber key
sees its own tenant's namespaces (or all, for the operator's router), whatever topic it asks for and
whatever it asks the replay socket; an unauthenticated TCP endpoint carries no tenant's namespaces;
binding every interface without CURVE is refused. The replay and subscription sockets drop a 256 MiB
message without the daemon holding it, and a flood of malformed requests writes a bounded number of
log lines. The subscribers are ``examples/kv_events_indexer.py`` (vLLM's own event classes).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq
from support.blocks import NS
from support.kv_events import NodeSubscriber, poll_until, vllm_hash
from support.services import free_port
from support.tokens import tokens_file

from ucm_client import UcmClient, key_digest
from ucm_server.kv_events.keygen import write_key_pair
from ucm_server.testing.daemon import DaemonProcess

pytest.importorskip("vllm.distributed.kv_events")  # the subscribers' classes are vLLM's
from kv_events_indexer import CurveKeys  # examples/ is put on the path by support.kv_events

BLOCK = 4096
TOPIC = "kv@node-a@ucm"


def held(keys: list[bytes]) -> set[tuple[str, Any]]:
    """What a stream says about blocks put through the Cache into Posix: both media."""
    return {(m, vllm_hash(k)) for k in keys for m in ("CPU", "STORAGE")}


def start_daemon(tmp_path: Path, cfg: dict[str, Any], label: str = "ucm") -> DaemonProcess:
    path = tmp_path / f"{label}.yaml"
    path.write_text(yaml.safe_dump({"kv_events_node": "node-a", "write_mode": "write-through", **cfg}))
    return DaemonProcess(tmp_path / label, args=["--config", str(path)])


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    return tokens_file(
        tmp_path / "tokens.yaml",
        [("tok-alice", "alice", {}), ("tok-bob", "bob", {}), ("tok-ops", "", {"admin": True})],
    )


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_each_curve_subscriber_sees_only_its_own_tenants_blocks(
    tmp_path: Path, tenants: Path, ctx: zmq.Context[Any]
) -> None:
    server_public = write_key_pair(str(tmp_path / "server.key"))
    pairs = {name: zmq.curve_keypair() for name in ("alice", "bob", "router", "stranger")}
    subscribers = [
        {"public_key": pairs["alice"][0].decode(), "tenant": "alice"},
        {"public_key": pairs["bob"][0].decode(), "tenant": "bob"},
        {"public_key": pairs["router"][0].decode(), "all": True},
    ]
    (tmp_path / "subscribers.yaml").write_text(yaml.safe_dump({"subscribers": subscribers}))
    pub, rep = f"tcp://*:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = {
        "auth_tokens_file": str(tenants),
        "kv_events_endpoint": pub,  # every interface: allowed, CURVE authenticates every peer
        "kv_events_replay_endpoint": rep,
        "kv_events_curve_secret_key_file": str(tmp_path / "server.key"),
        "kv_events_subscribers_file": str(tmp_path / "subscribers.yaml"),
        "kv_events_heartbeat_s": 0.3,
    }
    connect = pub.replace("*", "127.0.0.1")

    def subscriber(name: str, topic: bytes = b"") -> NodeSubscriber:
        public, secret = pairs[name]
        return NodeSubscriber(ctx, connect, rep, CurveKeys(server_public, public, secret), topic)

    mine = {t: [key_digest(t, i) for i in range(3)] for t in ("alice", "bob")}
    both = key_digest("both")  # the same key in each tenant's own namespace
    with start_daemon(tmp_path, cfg) as d:
        alice, bob, router = subscriber("alice"), subscriber("bob"), subscriber("router")
        # bob asks for alice's topic: the daemon subscribes him to his own (which his SUB filters out)
        snoop = subscriber("bob", f"{TOPIC}/tenant/alice/".encode())
        stranger = subscriber("stranger")
        plain = NodeSubscriber(ctx, connect, rep)  # no CURVE at all
        subs = (alice, bob, router, snoop, stranger, plain)
        try:
            for s in (alice, bob, router):
                s.sync()
            for tenant, keys in mine.items():
                with UcmClient(d.target, token=f"tok-{tenant}") as client:
                    assert client.put_blocks(NS, [(k, os.urandom(BLOCK)) for k in [*keys, both]]).ok
            poll_until(alice, lambda: alice.state.pairs() == held([*mine["alice"], both]))
            poll_until(bob, lambda: bob.state.pairs() == held([*mine["bob"], both]))
            everything = held([*mine["alice"], *mine["bob"], both])
            poll_until(router, lambda: router.state.pairs() == everything)  # the negative control

            # alice deletes the shared key: gone from her stream, still held in bob's
            with UcmClient(d.target, token="tok-alice") as client:
                assert client.delete(NS, [both]) == 1
            poll_until(alice, lambda: alice.state.pairs() == held(mine["alice"]))
            time.sleep(1.0)  # three heartbeats: every connection has had time to receive something
            for s in subs:
                s.poll(100)
            assert bob.state.pairs() == held([*mine["bob"], both])
            assert router.state.pairs() == everything  # still held by bob's namespace
            for outsider in (snoop, stranger, plain):
                assert outsider.state.pairs() == set() and outsider.state.seq == -1, "a stream leaked"
            # the replay socket answers from the requester's own audience, or not at all
            fresh = subscriber("bob")
            subs += (fresh,)
            fresh.sync()
            assert fresh.state.pairs() == held([*mine["bob"], both])
            for outsider in (stranger, plain):
                with pytest.raises(TimeoutError):
                    outsider.sync(timeout_s=1.5)
        finally:
            for s in subs:
                s.close()


def test_unauthenticated_tcp_carries_no_tenants_namespaces(
    tmp_path: Path, tenants: Path, ctx: zmq.Context[Any]
) -> None:
    pub, rep = free_port(), free_port()
    cfg = {
        "auth_tokens_file": str(tenants),
        "kv_events_endpoint": f"tcp://*:{pub}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{rep}",
        "kv_events_allow_open_tcp": True,
        "kv_events_heartbeat_s": 0.3,
    }
    with start_daemon(tmp_path, cfg) as d:
        sub = NodeSubscriber(ctx, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
        try:
            sub.sync()
            alices = [key_digest("alice", i) for i in range(3)]
            nobodys = [key_digest("nobody", i) for i in range(3)]
            with UcmClient(d.target, token="tok-alice") as client:
                assert client.put_blocks(NS, [(k, os.urandom(BLOCK)) for k in alices]).ok
            with UcmClient(d.target, token="tok-ops") as client:  # a token without a tenant
                assert client.put_blocks(NS, [(k, os.urandom(BLOCK)) for k in nobodys]).ok
            poll_until(sub, lambda: sub.state.pairs() == held(nobodys))
            time.sleep(0.7)
            sub.poll(100)
            assert sub.state.pairs() == held(nobodys)  # alice's blocks never came
            sub.sync()  # nor does a snapshot hold them
            assert sub.state.pairs() == held(nobodys)
        finally:
            sub.close()
        assert "audience no-tenant" in d.log()


def test_binding_every_interface_without_authentication_is_refused(tmp_path: Path) -> None:
    for setting in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        cfg = {"kv_events_endpoint": "local", setting: f"tcp://0.0.0.0:{free_port()}"}
        if setting == "kv_events_endpoint":
            cfg[setting] = f"tcp://*:{free_port()}"
        d = start_daemon(tmp_path, cfg, label=setting)
        with pytest.raises(RuntimeError, match=f"{setting}: .* kv_events_allow_open_tcp"):
            d.start(timeout_s=20)
    # a subscribers file naming a tenant the daemon does not have, or one anybody may edit
    write_key_pair(str(tmp_path / "server.key"))
    key = zmq.curve_keypair()[0].decode()
    subscribers = tmp_path / "subscribers.yaml"
    subscribers.write_text(yaml.safe_dump({"subscribers": [{"public_key": key, "tenant": "nobody"}]}))
    cfg = {
        "kv_events_endpoint": "local",
        "kv_events_curve_secret_key_file": str(tmp_path / "server.key"),
        "kv_events_subscribers_file": str(subscribers),
    }
    with pytest.raises(RuntimeError, match=r"subscribers\[0\]\.tenant: 'nobody' is not a tenant"):
        start_daemon(tmp_path, cfg, label="unknown").start(timeout_s=20)
    subscribers.write_text(yaml.safe_dump({"subscribers": [{"public_key": key, "all": True}]}))
    subscribers.chmod(0o666)
    with pytest.raises(RuntimeError, match="writable by others"):
        start_daemon(tmp_path, cfg, label="writable").start(timeout_s=20)
    subscribers.chmod(0o644)
    (tmp_path / "server.key").chmod(0o644)
    with pytest.raises(RuntimeError, match=r"kv_events_curve_secret_key_file .*readable by others"):
        start_daemon(tmp_path, cfg, label="readable").start(timeout_s=20)


def peak_rss_mib(d: DaemonProcess) -> float:
    assert d.proc is not None
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def send_raw_frame(path: Path, socket_type: bytes, size: int) -> int:
    """Speak ZMTP 3.0 by hand on the ipc socket ``path`` as a ``socket_type`` peer, announce one
    frame of ``size`` bytes and stream it; the bytes the daemon took before it hung up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    sock.sendall(b"\x04" + bytes([len(ready)]) + ready + b"\x02" + struct.pack(">Q", size))
    chunk, sent = bytes(1 << 20), 0
    try:
        while sent < size:
            sent += sock.send(chunk[: size - sent])
    except OSError:
        pass  # the daemon hung up: what this test wants
    finally:
        sock.close()
    return sent


def test_huge_and_malformed_messages_cost_bounded_memory_and_log_lines(
    tmp_path: Path, ctx: zmq.Context[Any]
) -> None:
    cfg = {
        "kv_events_endpoint": "local",
        "kv_events_replay_endpoint": "local",
        "cache_capacity": "64MiB",
        "cache_prefault": False,  # the daemon's own memory stays flat: only the attack could grow it
    }
    with start_daemon(tmp_path, cfg) as d:
        pub, rep = (d.socket.parent / f"kv-events.{n}" for n in ("pub", "replay"))
        assert pub.stat().st_mode & 0o777 == 0o600 and rep.stat().st_mode & 0o777 == 0o600
        before = peak_rss_mib(d)
        # one 256 MiB message through ZeroMQ, as a careless client sends it ...
        attacker = ctx.socket(zmq.DEALER)
        attacker.connect(f"ipc://{rep}")
        attacker.send_multipart([b"", bytes(256 << 20)])
        # ... and announced by hand to both sockets (a subscription is a message too)
        assert send_raw_frame(rep, b"DEALER", 256 << 20) < 16 << 20
        assert send_raw_frame(pub, b"XSUB", 256 << 20) < 16 << 20
        time.sleep(2)
        grown = peak_rss_mib(d) - before
        assert grown < 32, f"the daemon's peak memory grew by {grown:.0f} MiB for 256 MiB messages"

        flood = ctx.socket(zmq.DEALER)
        flood.connect(f"ipc://{rep}")
        for i in range(20_000):  # wrong frame counts and sizes, as fast as they go
            flood.send_multipart([b"", b"x" * (i % 8)] if i % 2 else [b"a", b"b", b"c"])
        sub = NodeSubscriber(ctx, f"ipc://{pub}", f"ipc://{rep}")
        try:
            sub.sync(timeout_s=60)  # served after the flood: the daemon still answers
            lines = [line for line in d.log().splitlines() if "malformed replay request" in line]
            assert 1 <= len(lines) <= 6, f"{len(lines)} log lines for 20,000 malformed requests"
        finally:
            sub.close()
        assert d.healthy()
