"""``TracedTier``: the conformance suite around a real tier, inside a recorded span and outside any.

Tracing wraps every tier of a tracing daemon, the Cache included (whose leasing the pipeline then
uses through the wrapper); the wrapper must change nothing a tier does, whether it records spans
(inside a sampled request) or passes calls straight through (background work, tracing unsampled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import Tier
from ucm_server.store.cache import CacheTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier
from ucm_server.store.traced import TracedTier
from ucm_server.testing.tier_suite import TierSuite, key, payload
from ucm_server.tracing.daemon import DaemonTracing

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
TRACER = PROVIDER.get_tracer("test")


class TestTracedPosixUntraced(TierSuite):
    """Outside any span: every call goes straight to the Posix tier."""

    async def make_tier(self, path: Path) -> Tier:
        return TracedTier(PosixTier("Posix", roots=[path / "blocks"]), TRACER)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        path: Path = getattr(tier, "path_of")(key)  # noqa: B009 - the inner tier's, by delegation
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None


class TestTracedPosixRecorded(TestTracedPosixUntraced):
    """Inside a recorded span: every call makes its own span and still behaves the same."""

    def run(self, path: Path, body: Callable[[Tier], Awaitable[None]]) -> None:
        async def recorded(tier: Tier) -> None:
            with TRACER.start_as_current_span("suite"):
                await body(tier)

        EXPORTER.clear()
        super().run(path, recorded)
        assert any(s.name.startswith("ucm.tier.") for s in EXPORTER.get_finished_spans())


def test_pipeline_reads_through_the_traced_cache_and_its_leasing(tmp_path: Path) -> None:
    """Promotion from Posix into the traced Cache (its reservations through the wrapper), then a
    read served by the Cache: the spans name which tier served each read."""

    async def scenario() -> None:
        tracing = DaemonTracing(PROVIDER)
        pipeline = Pipeline(
            [
                tracing.wrap_tier(CacheTier("Cache", capacity=4 << 20)),
                tracing.wrap_tier(PosixTier("Posix", roots=[tmp_path / "b"])),
            ]
        )
        assert pipeline.leasing is pipeline.tiers[0] and isinstance(pipeline.tiers[1], TracedTier)
        await pipeline.open()
        try:
            data = payload(1, 64 << 10)
            assert (await pipeline.tiers[1].write_many([(key(1), [memoryview(data)])]))[0].ok  # only on disk
            for _ in range(2):
                out = bytearray(len(data))
                EXPORTER.clear()
                with TRACER.start_as_current_span("load"):
                    (r,) = await pipeline.read_many([(key(1), [memoryview(out)])])
                assert r.ok and out == data
                reads = [s for s in EXPORTER.get_finished_spans() if s.name == "ucm.tier.read"]
                by_tier = {s.attributes["ucm.tier"]: s.attributes["ucm.hits"] for s in reads}
                served.append(by_tier)
        finally:
            await pipeline.close()

    served: list[dict[str, object]] = []
    asyncio.run(scenario())
    assert served[0] == {"Cache": 0, "Posix": 1}, "first from disk (promoted into the Cache)"
    assert served[1] == {"Cache": 1}, "then from memory"
