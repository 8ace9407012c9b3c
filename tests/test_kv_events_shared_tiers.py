"""KV events of the tiers with no index of their own (Mooncake, S3), from real daemons on real servers.

Two daemons share one Mooncake cluster (a real ``mooncake_master`` on loopback) or one S3 bucket (a
real Ceph RGW). Node B publishes; node A writes and deletes like another node. B's stream, read by
``examples/kv_events_indexer.py`` on vLLM's own event classes, must say what B's daemon learns:
its own writes and deletes at once, A's blocks once a lookup finds them, A's deletes (an expiry, to
B) once a lookup or a load finds them gone, and then equal ``ucm-admin ls --json --all``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from support.blocks import NS
from support.kv_events import NodeSubscriber, listed, node, poll_until, record_removals, settle, vllm_hash
from support.services import ceph_rgw, mooncake_master  # noqa: F401 - fixtures

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_server.testing.daemon import DaemonProcess

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # the subscriber's classes are vLLM's
pytestmark = pytest.mark.services

BLOCK = 4096
TTL_S = 5.0


@pytest.fixture(params=["Mooncake", "S3"])
def shared_tier(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The tier's name and the settings both daemons use (one prefix per test: a clean namespace)."""
    prefix = f"ev-{uuid.uuid4().hex[:8]}"
    if request.param == "Mooncake":
        master = request.getfixturevalue("mooncake_master")
        return "Mooncake", {
            "master_address": master.address,
            "master_http": master.http,
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
            "staging_bytes": 1 << 20,
            "timeout_s": 2.0,
            "key_prefix": prefix,
            "force_delete": True,  # a block B just looked up may be deleted by A at once
        }
    rgw = request.getfixturevalue("ceph_rgw")
    return "S3", {
        "endpoint_url": rgw.endpoint,
        "bucket": "ucm-events",
        "access_key": rgw.access_key,
        "secret_key": rgw.secret_key,
        "prefix": prefix,
        "timeout_s": 5.0,
    }


@pytest.fixture
def nodes(
    tmp_path: Path, shared_tier: tuple[str, dict[str, Any]]
) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    name, settings = shared_tier

    cfg: dict[str, Any] = {
        "store_pipeline": f"Cache|{name}",
        "tier_settings": {name: settings},
        "write_mode": "write-through",  # a Put is in the shared tier when it returns
        "shared_lookup_ttl_s": TTL_S,  # how long a lookup answer is reused (a load may then miss)
        "cache_capacity": 64 * BLOCK,
        "cache_page_size": BLOCK,
    }
    with node(tmp_path, "a", cfg, False) as a, node(tmp_path, "b", cfg, True) as b:
        yield a, b


def test_shared_tier_without_index_publishes_what_the_daemon_learns(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path, shm: SharedBuffer
) -> None:
    a, b = nodes
    ctx: zmq.Context[Any] = zmq.Context()
    sub = NodeSubscriber(ctx, f"ipc://{tmp_path}/b.pub", f"ipc://{tmp_path}/b.rep")
    removed = record_removals(sub)

    def shared() -> set[int]:
        return set(sub.state.media.get("SHARED", set()))

    def hashes(keys: list[bytes]) -> set[int]:
        return {vllm_hash(k) for k in keys}

    tag = uuid.uuid4().hex
    mine = [key_digest(tag, "b", i) for i in range(4)]
    theirs = [key_digest(tag, "a", i) for i in range(4)]
    try:
        with UcmClient(a.target) as ca, UcmClient(b.target) as cb:
            sub.sync()
            assert not sub.state.pairs()

            # B's own writes: SHARED at once (and CPU: B's Cache holds them too)
            assert cb.put_blocks(NS, [(k, os.urandom(BLOCK)) for k in mine]).ok
            poll_until(sub, lambda: shared() == hashes(mine))
            assert sub.state.media.get("CPU") == hashes(mine)

            # another node's blocks: unknown to B's stream until B's lookup finds them
            assert ca.put_blocks(NS, [(k, os.urandom(BLOCK)) for k in theirs]).ok
            sub.poll(300)
            assert shared() == hashes(mine)  # negative control: nothing announced before B learns
            assert cb.lookup(NS, theirs).present == [True] * 4
            asked = time.monotonic()
            poll_until(sub, lambda: shared() == hashes(mine + theirs))
            assert sub.state.media.get("CPU") == hashes(mine)  # B holds them only in the shared tier
            settle(sub, b)

            # B deletes one of its own: removed from both media at once
            assert cb.delete(NS, mine[:1]) == 1
            poll_until(sub, lambda: shared() == hashes(mine[1:] + theirs))
            assert vllm_hash(mine[0]) not in sub.state.media.get("CPU", set())

            # A deletes two of its blocks: for B an expiry, published once B learns it. B's pipeline
            # reuses a lookup answer for TTL_S: theirs[1] was just found present (the answer B's load
            # trusts, so the load itself finds it gone), theirs[0] long ago (B's lookup asks again).
            time.sleep(max(0.0, asked + TTL_S + 0.2 - time.monotonic()))
            assert cb.lookup(NS, theirs[1:2]).present == [True]
            assert ca.delete(NS, theirs[:2]) == 2
            region = cb.register(shm)
            load = cb.wait(cb.load(NS, [BlockIO(theirs[1], (Segment(region, 0, BLOCK),))]), 30)
            assert load.states == [BlockState.MISSING]
            poll_until(sub, lambda: vllm_hash(theirs[1]) not in shared())
            sub.poll(300)
            assert vllm_hash(theirs[0]) in shared()  # not learnt yet: the stream invents nothing
            assert sub.state.pairs() != listed(b)  # negative control: the comparison can fail
            assert cb.lookup(NS, theirs[:1]).present == [False]
            poll_until(sub, lambda: shared() == hashes(mine[1:] + theirs[2:]))
            want = settle(sub, b)
            assert {h for m, h in want if m == "SHARED"} == hashes(mine[1:] + theirs[2:])

        gone = {h for e in removed if e.medium == "SHARED" for h in e.block_hashes}
        assert gone == hashes(mine[:1] + theirs[:2])  # each removal came as a BlockRemoved SHARED
    finally:
        sub.close()
        ctx.term()
