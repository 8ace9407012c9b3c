"""The conformance suite every tier passes, shipped in the package so third-party tiers reuse it.

A backend's test file subclasses :class:`TierSuite` and says only how to build the tier::

    class TestPosix(TierSuite):
        async def make_tier(self, path: Path) -> Tier:
            return PosixTier(roots=[path / "blocks"])

Each test runs on a fresh event loop, opens the tier, runs, and closes it. Persistent tiers are also
re-opened on the same storage to check that blocks survive. ``evicts`` tells the suite a tier may drop
blocks on its own (a Cache under pressure), which only the stateful test has to allow for.

Reading back through the tier cannot catch a symmetric bug (bytes mangled on write and unmangled on
read, a checksum of the wrong bytes checked by the same wrong code). A test class that also says how
to read what the tier *stored* behind its back (:meth:`TierSuite.stored_block`: the file, the object,
the arena pages) gets :meth:`TierSuite.test_stored_bytes_are_the_payload`, which decodes that object
with its own parser of the documented layout (``ucm_server.store.format``'s docstring), not with the
tier's code; a class without the hook has that test skipped, saying why.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

import pytest
import xxhash

from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier
from ucm_server.store.copying import IoVec

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


_STORED_FIELDS = struct.Struct("<4sHHI16s32sQQQI")
"""The documented header fields, written out here on purpose (not taken from ``store.format``):
magic, version, flags, header_len, namespace, key, payload_len, checksum, created_ns, header_crc."""


def decode_stored(raw: bytes, expect: BlockKey) -> bytes:
    """The payload of a stored block object, after checking every documented header field.

    An independent reading of the on-media layout (see ``ucm_server.store.format``): a tier whose
    encoder and decoder share a bug still fails here.
    """
    assert len(raw) >= _STORED_FIELDS.size, f"stored object is {len(raw)} bytes, shorter than a header"
    magic, version, _flags, header_len, ns, digest, payload_len, checksum, created_ns, crc = (
        _STORED_FIELDS.unpack_from(raw)
    )
    assert magic == b"UCMB", f"magic {magic!r}"
    # 128-byte headers are written as version 1 (so the previous release reads them), 4 KiB ones as 2;
    # version 3 (either header) is a Posix file in the two-level directory layout.
    allowed = ((1, 128), (2, 4096), (3, 128), (3, 4096))
    assert (version, header_len) in allowed, f"version {version} with header_len {header_len}"
    assert crc == zlib.crc32(raw[: _STORED_FIELDS.size - 4]), "header CRC does not cover the header fields"
    assert raw[_STORED_FIELDS.size : header_len] == bytes(header_len - _STORED_FIELDS.size), (
        "padding not zero"
    )
    assert (ns, digest) == (expect.namespace, expect.digest), "header names another block"
    assert 0 < created_ns <= time.time_ns(), f"created_ns {created_ns}"
    assert len(raw) == header_len + payload_len, (
        f"object {len(raw)} bytes, header says {header_len}+{payload_len}"
    )
    stored = raw[header_len:]
    assert checksum == xxhash.xxh3_64_intdigest(stored), "checksum is not xxh3-64 of the stored payload"
    return stored


class TierSuite:
    block_size: ClassVar[int] = 64 << 10
    evicts: ClassVar[bool] = False
    stored_overhead: ClassVar[int] = 0
    """Bytes the tier's stats count per block beyond its payload (an encryption envelope)."""

    async def make_tier(self, path: Path) -> Tier:
        raise NotImplementedError("a tier's test class says how to build it")

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The back door: what ``tier`` holds for ``key``, read without the tier's own read path.

        A persistent tier returns the whole stored object (header and payload, the documented
        on-media format); a non-persistent one the payload bytes it holds. None: nothing is stored.
        Not overridden (this default): ``test_stored_bytes_are_the_payload`` is skipped.
        """
        return None

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

    def test_eviction_honours_pins_and_priorities(self, tmp_path: Path) -> None:
        """A tier that says it holds pins (``pin_gap == ""``) evicts low priority first, then least
        recently used, then high priority, and never a pinned block; any other tier says why not."""
        from ucm_server.retention import Change, RetentionTable

        async def body(t: Tier) -> None:
            if t.pin_gap:
                assert len(t.pin_gap) > 10, "a tier that cannot hold pins says why"
                return
            rules = RetentionTable(None)
            t.use_rules(rules)
            for i in range(6):  # least recently used first: 0, 1, ... 5
                assert (await t.write_from(key(i), [memoryview(payload(i, 4096))])).ok
            await rules.change([key(1)], Change(pin=True), time.time())
            await rules.change([key(5)], Change(priority=-1), time.time())
            await rules.change([key(0)], Change(priority=1), time.time())
            await t.evict(2 * 4096)
            present = [size is not None for size in await t.lookup([key(i) for i in range(6)])]
            assert present == [True, True, False, True, True, False], "low priority, then LRU"
            await t.evict(100 * 4096)
            present = [size is not None for size in await t.lookup([key(i) for i in range(6)])]
            assert present == [False, True, False, False, False, False], "pinned blocks stay"
            await rules.change([key(1)], Change(pin=False), time.time())
            await t.evict(4096)
            assert await t.lookup([key(1)]) == [None], "unpinned, it goes like any other"

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
            assert s.blocks == 50 and s.bytes == 50 * (1024 + self.stored_overhead)
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

    def test_stored_bytes_are_the_payload(self, tmp_path: Path) -> None:
        if type(self).stored_block is TierSuite.stored_block:
            pytest.skip("no back door: override TierSuite.stored_block to read what the tier stored")

        async def check(t: Tier, k: BlockKey, data: memoryview) -> None:
            assert (await t.write_from(k, [data])).ok
            raw = await self.stored_block(t, k)
            assert raw is not None, f"the back door finds nothing stored for {k.hex()}"
            stored = decode_stored(raw, k) if t.persistent else raw
            assert stored == data, "the stored payload is not the bytes written"

        async def body(t: Tier) -> None:
            await check(t, key(16), memoryview(payload(16, self.block_size + 100)))
            # Page aligned: a writer using O_DIRECT takes its 4 KiB-header path where the filesystem allows.
            with mmap.mmap(-1, self.block_size) as aligned, memoryview(aligned) as view:
                view[:] = payload(17, self.block_size)
                await check(t, key(17), view)

        self.run(tmp_path, body)
