"""``ObservedTier``: KV events for any tier without a watchable index (third-party tiers included).

The wrapper passes the conformance suite around a real Posix tier with a ledger attached, and a
daemon whose lower tier is an out-of-tree tier named by module path (the latency wrapper: a tier the
daemon knows nothing about) publishes it, matching ``ucm-admin ls --json --all``. Mooncake and S3
are covered in ``tests/test_kv_events_shared_tiers.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm_client import UcmClient, key_digest
from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_server.kv_events.ledger import Ledger
from ucm_server.store.assembly import observation
from ucm_server.store.base import Tier
from ucm_server.store.cache import CacheTier
from ucm_server.store.observed import ObservedTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier
from ucm_server.store.watch import Watchable
from ucm_server.testing.daemon import DaemonProcess
from ucm_server.testing.faults import LatencyInjectingTier
from ucm_server.testing.tier_suite import TierSuite

SLOW_TIER = "ucm_server.testing.faults:LatencyInjectingTier"


class TestObservedPosixConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        tier = ObservedTier(PosixTier("Observed", roots=[path / "blocks"]))
        tier.watch_index(Ledger().watch(tier))
        return tier

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The wrapped Posix tier's file, through the wrapper's delegated ``path_of``."""
        path: Path = getattr(tier, "path_of")(key)  # noqa: B009 - the inner tier's, by delegation
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None


def test_wrapped_tier_reports_what_its_calls_find(tmp_path: Path) -> None:
    """Writes and finds announce, deletes and misses remove; failures and unknown keys change nothing."""

    async def scenario() -> None:
        posix = PosixTier("Posix", roots=[tmp_path / "blocks"])
        plain = LatencyInjectingTier(posix)  # a tier without a watchable index, like a plugin's
        assert isinstance(posix, Watchable) and not isinstance(plain, Watchable)
        pipeline = Pipeline([CacheTier("Cache", capacity=1 << 20), observation(plain)])
        tier = pipeline.tiers[1]
        assert isinstance(tier, ObservedTier) and tier.inner is plain and tier.kind == "LatencyInjecting"
        assert pipeline.tier("Posix") is tier and isinstance(pipeline.top, CacheTier)
        ledger = Ledger()
        tier.watch_index(ledger.watch(tier))
        await tier.open()
        try:
            ns = Namespace(os.urandom(16))
            a, b, c = (BlockKey(ns, Digest(os.urandom(32))) for _ in range(3))
            assert all(r.ok for r in await tier.write_many([(a, [memoryview(b"x" * 64)])]))
            assert ledger.held() == {"STORAGE": {a.digest}}
            assert (await tier.write_from(b, [memoryview(b"y" * 64)])).ok
            await posix.delete([b])  # behind the wrapper's back: unknown until a call finds out
            await posix.write_from(c, [memoryview(b"z" * 64)])
            assert ledger.held() == {"STORAGE": {a.digest, b.digest}}
            assert await tier.lookup([b, c]) == [None, 64]
            assert ledger.held() == {"STORAGE": {a.digest, c.digest}}
            await posix.delete([c])
            assert not (await tier.read_many([(c, [memoryview(bytearray(64))])]))[0].ok
            assert ledger.held() == {"STORAGE": {a.digest}}
            assert await tier.delete([a, b]) == 1  # fewer than asked: one lookup says which stayed
            assert ledger.held() == {}
        finally:
            await tier.close()

    asyncio.run(scenario())


def test_a_third_party_tier_publishes_in_a_daemon(tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_events")  # the subscriber's classes are vLLM's
    import zmq
    from support.blocks import NS
    from support.kv_events import MEDIUM, NodeSubscriber, listed, vllm_hash

    cfg: dict[str, Any] = {
        "store_pipeline": f"Cache|{SLOW_TIER}",
        "tier_settings": {SLOW_TIER: {"root": str(tmp_path / "slow"), "read_delay_s": 0.001}},
        "write_mode": "write-through",
        "kv_events_endpoint": f"ipc://{tmp_path}/ev.pub",
        "kv_events_replay_endpoint": f"ipc://{tmp_path}/ev.rep",
    }
    (tmp_path / "ucm.yaml").write_text(yaml.safe_dump(cfg))
    ctx: zmq.Context[Any] = zmq.Context()
    MEDIUM[SLOW_TIER] = "STORAGE"  # persistent and not shared: the wrapped Posix tier's medium
    try:
        with (
            DaemonProcess(tmp_path / "ucm", args=["--config", str(tmp_path / "ucm.yaml")]) as d,
            UcmClient(d.target) as client,
        ):
            sub = NodeSubscriber(ctx, f"ipc://{tmp_path}/ev.pub", f"ipc://{tmp_path}/ev.rep")
            try:
                sub.sync()
                keys = [key_digest("third-party", i) for i in range(5)]
                assert client.put_blocks(NS, [(k, os.urandom(4096)) for k in keys]).ok
                assert client.delete(NS, keys[:2]) == 2
                want = listed(d)
                assert {m for m, _ in want} == {"CPU", "STORAGE"} and len(want) == 6
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and sub.state.pairs() != want:
                    sub.poll(100)
                assert sub.state.pairs() == want
                # the lower tier's medium is STORAGE and holds what was not deleted (before the wrapper
                # existed, this tier published nothing: the STORAGE set was empty)
                assert sub.state.media.get("STORAGE") == {vllm_hash(k) for k in keys[2:]}
            finally:
                sub.close()
    finally:
        del MEDIUM[SLOW_TIER]
        ctx.term()
