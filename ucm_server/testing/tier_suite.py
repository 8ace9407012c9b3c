"""The conformance suite every tier passes, shipped in the package so third-party tiers reuse it.

A backend's test file subclasses :class:`TierSuite` and says only how to build the tier::

    class TestPosix(TierSuite):
        async def make_tier(self, path: Path) -> Tier:
            return PosixTier(roots=[path / "blocks"])

Each test runs on a fresh event loop, opens the tier, runs, and closes it. Persistent tiers are also
re-opened on the same storage to check that blocks survive. ``evicts`` tells the suite a tier may drop
blocks on its own (a Cache under pressure), which only the stateful test has to allow for.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

from ucm_server.keys import BlockKey, Digest, Namespace
from ucm_server.store.base import BlockState, IoVec, Tier

NS_A = Namespace(b"A" * 16)
NS_B = Namespace(b"B" * 16)


def key(i: int, ns: Namespace = NS_A) -> BlockKey:
    return BlockKey(ns, Digest(i.to_bytes(4, "little") * 8))


def payload(i: int, size: int) -> bytes:
    return (i.to_bytes(4, "little") + os.urandom(60)) * (size // 64) + b"x" * (size % 64)


def split(data: bytearray | bytes, *cuts: int) -> IoVec:
    """``data`` as an iovec cut at the given offsets (to exercise scatter/gather)."""
    view = memoryview(data)
    bounds = [0, *cuts, len(data)]
    return [view[a:b] for a, b in itertools.pairwise(bounds) if b > a]


class TierSuite:
    block_size: ClassVar[int] = 64 << 10
    evicts: ClassVar[bool] = False

    async def make_tier(self, path: Path) -> Tier:
        raise NotImplementedError("a tier's test class says how to build it")

    def run(self, path: Path, body: Callable[[Tier], Awaitable[None]]) -> None:
        async def main() -> None:
            tier = await self.make_tier(path)
            await tier.open()
            try:
                await body(tier)
            finally:
                await tier.close()

        asyncio.run(main())

    # -- the suite ------------------------------------------------------------------------------------
    def test_round_trip(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            data = payload(1, self.block_size)
            assert (await t.write_from(key(1), [memoryview(data)])).ok
            out = bytearray(len(data))
            r = await t.read_into(key(1), [memoryview(out)])
            assert r.ok, r.reason
            assert bytes(out) == data

        self.run(tmp_path, body)

    def test_scatter_gather(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            data = payload(2, self.block_size)
            assert (await t.write_from(key(2), split(data, 100, 5000))).ok
            out = bytearray(len(data))
            assert (await t.read_into(key(2), split(out, 1, 777, 40000))).ok
            assert bytes(out) == data

        self.run(tmp_path, body)

    def test_missing_is_a_value(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            r = await t.read_into(key(404), [memoryview(bytearray(16))])
            assert r.state is BlockState.MISSING
            assert await t.lookup([key(404)]) == [None]

        self.run(tmp_path, body)

    def test_length_mismatch_fails_without_copy(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            assert (await t.write_from(key(3), [memoryview(payload(3, self.block_size))])).ok
            out = bytearray(self.block_size - 1)
            r = await t.read_into(key(3), [memoryview(out)])
            assert r.state is BlockState.FAILED
            assert "length" in r.reason
            assert out == bytearray(len(out))

        self.run(tmp_path, body)

    def test_lookup_sizes(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            await t.write_from(key(4), [memoryview(payload(4, 1000))])
            await t.write_from(key(5), [memoryview(payload(5, 3000))])
            assert await t.lookup([key(4), key(6), key(5)]) == [1000, None, 3000]

        self.run(tmp_path, body)

    def test_overwrite_last_write_wins(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            old, new = payload(7, 2048), payload(8, 4096)
            await t.write_from(key(7), [memoryview(old)])
            await t.write_from(key(7), [memoryview(new)])
            out = bytearray(len(new))
            assert (await t.read_into(key(7), [memoryview(out)])).ok
            assert bytes(out) == new

        self.run(tmp_path, body)

    def test_namespaces_are_isolated(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            await t.write_from(key(9, NS_A), [memoryview(payload(9, 512))])
            assert await t.lookup([key(9, NS_B)]) == [None]
            listed = [i.key async for i in t.list_blocks(NS_B)]
            assert listed == []

        self.run(tmp_path, body)

    def test_delete(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            await t.write_from(key(10), [memoryview(payload(10, 512))])
            assert await t.delete([key(10), key(11)]) == 1
            assert (await t.read_into(key(10), [memoryview(bytearray(512))])).state is BlockState.MISSING

        self.run(tmp_path, body)

    def test_batches_and_stats(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            datas = [payload(i, 1024) for i in range(50)]
            results = await t.write_many([(key(i), [memoryview(d)]) for i, d in enumerate(datas)])
            assert all(r.ok for r in results)
            outs = [bytearray(1024) for _ in datas]
            results = await t.read_many([(key(i), [memoryview(o)]) for i, o in enumerate(outs)])
            assert all(r.ok for r in results)
            assert [bytes(o) for o in outs] == datas
            s = t.stats()
            assert s.blocks == 50 and s.bytes == 50 * 1024
            assert len([i async for i in t.list_blocks(NS_A)]) == 50

        self.run(tmp_path, body)

    def test_concurrent_writes_of_one_key_leave_one_intact_block(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            versions = [payload(100 + i, self.block_size) for i in range(8)]
            await asyncio.gather(*(t.write_from(key(12), [memoryview(v)]) for v in versions))
            out = bytearray(self.block_size)
            assert (await t.read_into(key(12), [memoryview(out)])).ok
            assert bytes(out) in versions

        self.run(tmp_path, body)

    def test_verify_good_block(self, tmp_path: Path) -> None:
        async def body(t: Tier) -> None:
            await t.write_from(key(13), [memoryview(payload(13, 4096))])
            assert (await t.verify(key(13))).ok
            assert (await t.verify(key(14))).state is BlockState.MISSING

        self.run(tmp_path, body)

    def test_persistent_tiers_survive_reopen(self, tmp_path: Path) -> None:
        data = payload(15, self.block_size)

        async def first(t: Tier) -> None:
            assert (await t.write_from(key(15), [memoryview(data)])).ok

        async def second(t: Tier) -> None:
            out = bytearray(len(data))
            r = await t.read_into(key(15), [memoryview(out)])
            if t.persistent:
                assert r.ok, r.reason
                assert bytes(out) == data
            else:
                assert r.state is BlockState.MISSING

        self.run(tmp_path, first)
        self.run(tmp_path, second)
