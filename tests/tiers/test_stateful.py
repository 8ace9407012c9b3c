"""Stateful property tests: random write/read/delete/evict/reopen sequences against real tiers,
checked against an in-memory model after every step (zarr's testing/stateful.py habit)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier
from ucm_server.store.cache import CacheTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier

KEYS = [BlockKey(Namespace(bytes([n]) * 16), Digest(bytes([i]) * 32)) for n in range(2) for i in range(6)]
key_st = st.sampled_from(KEYS)
data_st = st.binary(min_size=1, max_size=3 * 4096)


class _TierMachine(RuleBasedStateMachine):
    """Subclasses build ``self.store``; ``may_forget`` says whether blocks can vanish on their own."""

    may_forget = False

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="ucm-stateful-"))
        self.model: dict[BlockKey, bytes] = {}
        self.store = self.loop.run_until_complete(self.build())

    async def build(self) -> Tier | Pipeline:
        raise NotImplementedError

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    @rule(key=key_st, data=data_st)
    def write(self, key: BlockKey, data: bytes) -> None:
        (r,) = self.run(self.store.write_many([(key, [memoryview(data)])]))
        assert r.ok, r.reason
        self.model[key] = data

    @rule(key=key_st)
    def read(self, key: BlockKey) -> None:
        expected = self.model.get(key)
        size = len(expected) if expected is not None else 16
        out = bytearray(size)
        (r,) = self.run(self.store.read_many([(key, [memoryview(out)])]))
        if expected is None:
            assert r.state is BlockState.MISSING
        elif r.ok:
            assert bytes(out) == expected
        else:
            assert self.may_forget and r.state is BlockState.MISSING, r

    @rule(key=key_st)
    def delete(self, key: BlockKey) -> None:
        self.run(self.store.delete([key]))
        self.model.pop(key, None)

    @invariant()
    def lookup_agrees(self) -> None:
        sizes = self.run(self.store.lookup(KEYS))
        for key, size in zip(KEYS, sizes, strict=True):
            if key in self.model:
                assert size == len(self.model[key]) or (self.may_forget and size is None)
            else:
                assert size is None

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class CacheMachine(_TierMachine):
    may_forget = True  # 6 pages of cache for up to 12 blocks of up to 3 pages: LRU eviction happens

    async def build(self) -> Tier:
        t = CacheTier(capacity=6 * 4096, page_size=4096)
        await t.open()
        return t


class PosixMachine(_TierMachine):
    async def build(self) -> Tier:
        t = PosixTier(roots=[self.dir / "a", self.dir / "b"], durable=False)
        await t.open()
        return t

    @rule()
    def reopen(self) -> None:
        """A restart: a new tier instance rebuilds its index from disk and must agree with the model."""
        self.run(self.store.close())
        self.store = self.run(self.build())


class PipelineMachine(_TierMachine):
    """Cache|Posix write-back with a tiny cache: everything written stays readable through Posix."""

    async def build(self) -> Pipeline:
        p = Pipeline(
            [CacheTier(capacity=4 * 4096, page_size=4096), PosixTier(roots=[self.dir / "p"], durable=False)],
            write_back=True,
        )
        await p.open()
        return p

    @rule()
    def drain_and_evict_cache(self) -> None:
        self.run(self.store.drain())
        self.run(self.store.tiers[0].evict(1 << 30))


TestCache = CacheMachine.TestCase
TestPosix = PosixMachine.TestCase
TestPipeline = PipelineMachine.TestCase
_SETTINGS = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestCache.settings = TestPosix.settings = TestPipeline.settings = _SETTINGS
TestPosix.pytestmark = [pytest.mark.slow]  # 40 examples of 25 steps on disk: seconds


def test_delete_while_write_back_is_pending_does_not_resurrect(tmp_path: Path) -> None:
    async def main() -> None:
        p = Pipeline(
            [CacheTier(capacity=1 << 20, page_size=4096), PosixTier(roots=[tmp_path])], write_back=True
        )
        await p.open()
        for round_ in range(20):
            key = KEYS[round_ % len(KEYS)]
            await p.write_many([(key, [memoryview(b"v%d" % round_ * 1000)])])
            await p.delete([key])
            await p.drain()
            assert await p.lookup([key]) == [None], f"round {round_}: deleted block came back"
        # Overwrite while the first version's write-back is queued: the newer bytes win below.
        await p.write_many([(KEYS[0], [memoryview(b"old" * 1000)])])
        await p.write_many([(KEYS[0], [memoryview(b"new" * 1000)])])
        await p.drain()
        await p.tiers[0].delete([KEYS[0]])
        out = bytearray(3000)
        (r,) = await p.read_many([(KEYS[0], [memoryview(out)])])
        assert r.ok and bytes(out) == b"new" * 1000
        await p.close()

    asyncio.run(main())
