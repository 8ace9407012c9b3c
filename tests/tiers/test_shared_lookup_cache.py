"""The pipeline's short-lived cache of shared-tier lookup answers: fast repeats, bounded staleness,
and our own writes and deletes are never hidden by it. Two pipelines on one DS3FS directory stand
for two nodes (their own DS3FS caches are turned off so only the pipeline's is measured)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ucm_protocol.states import BlockState
from ucm_server.store.cache import CacheTier
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.testing.tier_suite import NS_A, key, payload


def _node(mount: Path, ttl: float) -> Pipeline:
    shared = DS3FSTier.from_settings("DS3FS", {"mount": str(mount), "negative_ttl_s": 0, "positive_ttl_s": 0})
    return Pipeline([CacheTier(capacity=1 << 20, page_size=4096), shared], shared_lookup_ttl_s=ttl)


def test_answers_are_reused_for_the_ttl_then_asked_again(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = _node(tmp_path, 0.5), _node(tmp_path, 0.5)
        await a.open()
        await b.open()
        assert (await a.write_many([(key(1), [memoryview(payload(1, 4096))])], durable=True))[0].ok
        digest = key(1).digest
        assert await b.lookup_digests(NS_A, [digest]) == [4096]  # B's cache misses; the shared tier answers
        await a.delete([key(1)])
        assert await b.lookup_digests(NS_A, [digest]) == [4096]  # still the cached answer, within the TTL
        out = bytearray(4096)
        (r,) = await b.read_many([(key(1), [memoryview(out)])])
        assert r.state is BlockState.MISSING  # a stale "present" never serves bytes
        await asyncio.sleep(0.6)
        assert await b.lookup_digests(NS_A, [digest]) == [None]  # after the TTL: asked again
        # B's own write is visible at once, whatever B cached before.
        assert (await b.write_many([(key(1), [memoryview(payload(2, 4096))])], durable=True))[0].ok
        await b.tiers[0].delete([key(1)])  # only the shared tier holds it now
        assert await b.lookup_digests(NS_A, [digest]) == [4096]
        await a.close()
        await b.close()

    asyncio.run(main())


def test_ttl_zero_asks_every_time(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = _node(tmp_path, 0.0), _node(tmp_path, 0.0)
        await a.open()
        await b.open()
        await a.write_many([(key(1), [memoryview(payload(1, 4096))])], durable=True)
        assert await b.lookup_digests(NS_A, [key(1).digest]) == [4096]
        await a.delete([key(1)])
        assert await b.lookup_digests(NS_A, [key(1).digest]) == [None]
        await a.close()
        await b.close()

    asyncio.run(main())
