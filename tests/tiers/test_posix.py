"""The Posix tier passes the conformance suite, and keeps its durability and integrity promises."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.posix_files import stored_blocks

from ucm_protocol.keys import BlockKey
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier
from ucm_server.store.format import FORMAT_VERSION, HEADER_SIZE
from ucm_server.store.posix import QUARANTINE, PosixTier
from ucm_server.testing.tier_suite import TierSuite, key, payload


class TestPosixConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return PosixTier(roots=[path / "a", path / "b"])

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return await stored_file(tier, key)


async def stored_file(tier: Tier, key: BlockKey) -> bytes | None:
    """The back door of a file tier: the block's file, read with plain file I/O."""
    assert isinstance(tier, PosixTier)
    path = tier.path_of(key)
    return await asyncio.to_thread(path.read_bytes) if path.exists() else None


def _open(path: Path, **kw: object) -> PosixTier:
    return PosixTier(roots=[path / "a", path / "b"], **kw)  # type: ignore[arg-type]


def test_blocks_stripe_across_roots(tmp_path: Path) -> None:
    async def main() -> None:
        t = _open(tmp_path)
        await t.open()
        await t.write_many([(key(i), [memoryview(payload(i, 256))]) for i in range(64)])
        await t.close()

    asyncio.run(main())
    a, b = stored_blocks(tmp_path / "a"), stored_blocks(tmp_path / "b")  # block files or pack records
    assert a + b == 64 and a and b


def test_flipped_byte_is_detected_quarantined_and_never_served(tmp_path: Path) -> None:
    data = payload(1, 8192)

    async def write() -> None:
        t = _open(tmp_path)
        await t.open()
        await t.write_from(key(1), [memoryview(data)])
        await t.close()

    asyncio.run(write())
    (path,) = list(tmp_path.rglob("*.blk"))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 100] ^= 0xFF
    path.write_bytes(raw)

    async def read() -> None:
        t = _open(tmp_path)
        await t.open()
        assert await t.lookup([key(1)]) == [8192]  # the header is fine, so it is indexed
        out = bytearray(8192)
        r = await t.read_into(key(1), [memoryview(out)])
        assert r.state is BlockState.FAILED and "checksum" in r.reason
        assert await t.lookup([key(1)]) == [None]
        assert t.stats().corrupt == 1
        await t.close()

    asyncio.run(read())
    assert not path.exists()
    assert list(tmp_path.rglob(f"{QUARANTINE}/*"))


def test_torn_and_temporary_files_are_never_indexed(tmp_path: Path) -> None:
    async def write() -> None:
        t = _open(tmp_path)
        await t.open()
        await t.write_from(key(1), [memoryview(payload(1, 4096))])
        await t.write_from(key(2), [memoryview(payload(2, 4096))])
        await t.close()

    asyncio.run(write())
    p1, p2 = sorted(tmp_path.rglob("*.blk"))
    p1.write_bytes(p1.read_bytes()[:-10])  # torn: shorter than its header promises
    (p2.parent / (p2.name + ".tmp.deadbeef")).write_bytes(b"half a block")
    (p2.parent / "garbage.blk").write_bytes(b"not a block at all")

    async def read() -> None:
        t = _open(tmp_path)
        await t.open()
        sizes = await t.lookup([key(1), key(2)])
        assert sum(s is not None for s in sizes) == 1
        assert t.stats().corrupt == 2
        await t.close()

    asyncio.run(read())
    assert not list(tmp_path.rglob("*.tmp.*"))


def test_capacity_evicts_oldest(tmp_path: Path) -> None:
    async def main() -> None:
        t = _open(tmp_path, capacity=4 * 1024)
        await t.open()
        for i in range(6):
            assert (await t.write_from(key(i), [memoryview(payload(i, 1024))])).ok
        s = t.stats()
        assert s.bytes <= 4 * 1024 and s.evictions == 2
        assert await t.lookup([key(0), key(1), key(5)]) == [None, None, 1024]
        await t.close()

    asyncio.run(main())


def test_corrupt_payload_leaves_no_bytes_in_the_destination(tmp_path: Path) -> None:
    data = payload(1, 8192)

    async def main() -> None:
        t = _open(tmp_path)
        await t.open()
        await t.write_from(key(1), [memoryview(data)])
        (path,) = list(tmp_path.rglob("*.blk"))  # noqa: ASYNC240 - a test corrupting a file on purpose
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 5] ^= 0x10
        path.write_bytes(raw)
        out = bytearray(b"\xff" * 8192)
        r = await t.read_into(key(1), [memoryview(out)])
        assert r.state is BlockState.FAILED
        assert out == bytearray(8192)  # zeroed, not the corrupt payload
        await t.close()

    asyncio.run(main())


def test_blocks_of_another_format_version_are_skipped_not_quarantined(tmp_path: Path) -> None:
    """A newer daemon on a shared mount may have written them: leave them alone."""

    async def write() -> None:
        t = _open(tmp_path)
        await t.open()
        await t.write_from(key(1), [memoryview(payload(1, 4096))])
        await t.close()

    asyncio.run(write())
    (path,) = list(tmp_path.rglob("*.blk"))
    raw = bytearray(path.read_bytes())
    raw[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")  # a format this daemon does not know
    path.write_bytes(raw)

    async def reopen() -> None:
        t = _open(tmp_path)
        await t.open()
        assert await t.lookup([key(1)]) == [None]
        assert t.stats().corrupt == 0
        await t.close()

    asyncio.run(reopen())
    assert path.exists()
