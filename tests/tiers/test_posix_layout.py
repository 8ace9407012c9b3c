"""The Posix tier's two-level layout (format version 3) and the files older releases left one level
deeper (versions 1 and 2): old files keep loading, a file is trusted only at the path its version
names, deletes remove both copies, and a release that knows only versions 1-2 skips the new files
instead of quarantining them (issue #13, item 2)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from support.blocks import NS

from ucm_client import UcmClient, key_digest
from ucm_protocol.keys import BlockKey
from ucm_server.store import format as block_format
from ucm_server.store.base import BlockState
from ucm_server.store.format import (
    ALIGNED_HEADER_SIZE,
    FLAT_LAYOUT_VERSION,
    encode_header,
    payload_checksum,
)
from ucm_server.store.posix import QUARANTINE, PosixTier, Profile, block_file_header
from ucm_server.testing.daemon import DaemonProcess

SIZE = 4096


def _key(i: int) -> BlockKey:
    return BlockKey(NS, key_digest("layout", i))


def _payload(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * (SIZE // 32)


def _plant(path: Path, i: int, *, version: int | None = None, header_len: int = 128) -> Path:
    """Write block ``i`` at ``path`` as a release of that format ``version`` did (None: 1 or 2)."""
    data = _payload(i)
    checksum = payload_checksum([memoryview(data)])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(encode_header(_key(i), SIZE, checksum, header_len=header_len, version=version) + data)
    return path


def _legacy(root: Path, i: int, header_len: int = 128) -> Path:
    """Block ``i`` as the previous release wrote it: one directory deeper, version 1 (or 2)."""
    return _plant(PosixTier(roots=[root]).legacy_path_of(_key(i)), i, header_len=header_len)


def _quarantined(root: Path) -> list[str]:
    q = root / QUARANTINE
    return sorted(p.name.split(".blk")[0] for p in q.iterdir()) if q.exists() else []


def test_new_blocks_live_two_levels_deep_with_version_3(tmp_path: Path) -> None:
    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        results = await t.write_many([(_key(i), [memoryview(_payload(i))]) for i in range(8)])
        assert all(r.ok for r in results)
        await t.close()
        h = _key(0).digest.hex()
        path = tmp_path / NS.hex() / h[:2] / f"{h}.blk"
        assert t.path_of(_key(0)) == path and path.is_file()
        assert not t.legacy_path_of(_key(0)).exists()
        assert block_file_header(path).version == FLAT_LAYOUT_VERSION
        # The namespace holds only the 256-way shard directories: no third level was made.
        assert all(p.is_file() for shard in (tmp_path / NS.hex()).iterdir() for p in shard.iterdir())

    asyncio.run(main())


@pytest.mark.parametrize("header_len", [128, ALIGNED_HEADER_SIZE])
def test_files_of_the_previous_layout_keep_loading(tmp_path: Path, header_len: int) -> None:
    """Versions 1 and 2 one level deeper: adopted at start-up, read by batches and one at a time,
    checked (info, verify), and a delete removes them; an overwrite then lands in the new layout."""
    old = [_legacy(tmp_path, i, header_len) for i in range(6)]

    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        await t.indexed()
        assert await t.lookup([_key(i) for i in range(7)]) == [SIZE] * 6 + [None]
        dest = [bytearray(SIZE) for _ in range(6)]
        got = await t.read_many([(_key(i), [memoryview(dest[i])]) for i in range(6)])
        assert all(r.ok for r in got) and [bytes(d) for d in dest] == [_payload(i) for i in range(6)]
        one = bytearray(SIZE)
        assert (await t.read_into(_key(0), [memoryview(one)])).ok and bytes(one) == _payload(0)
        assert (await t.verify(_key(1))).ok
        info = await t.info(_key(2))
        assert info is not None and info.checksum == payload_checksum([memoryview(_payload(2))])
        assert await t.delete([_key(3)]) == 1
        assert not old[3].exists()
        # A rewrite of a block an older release wrote: the new file is read; a delete removes both.
        new = _payload(99)
        assert (await t.write_from(_key(4), [memoryview(new)])).ok
        assert t.path_of(_key(4)).exists() and old[4].exists()
        assert (await t.read_into(_key(4), [memoryview(one)])).ok and bytes(one) == new
        assert await t.delete([_key(4)]) == 1
        assert not t.path_of(_key(4)).exists() and not old[4].exists()
        assert (await t.read_into(_key(4), [memoryview(one)])).state is BlockState.MISSING
        assert t.stats().corrupt == 0
        await t.close()

    asyncio.run(main())
    assert _quarantined(tmp_path) == []


def test_a_corrupt_old_file_is_quarantined_from_where_it_lies(tmp_path: Path) -> None:
    path = _legacy(tmp_path, 0)

    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        await t.indexed()
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
        dest = bytearray(SIZE)
        r = await t.read_into(_key(0), [memoryview(dest)])
        assert not r.ok and "checksum" in r.reason
        assert dest == bytes(SIZE)  # none of the bad bytes stay in the reader's memory
        await t.close()

    asyncio.run(main())
    assert not path.exists()
    assert _quarantined(tmp_path) == [_key(0).digest.hex()]


def test_a_file_is_trusted_only_at_the_path_its_version_names(tmp_path: Path) -> None:
    """A version-1 file in the new layout, or a version-3 one in the old layout, was not written
    there by any release: quarantined at start-up, never served. Their correct twins are."""
    t0 = PosixTier(roots=[tmp_path])
    _plant(t0.path_of(_key(0)), 0)  # version 1 where only version 3 lives
    _plant(t0.legacy_path_of(_key(1)), 1, version=FLAT_LAYOUT_VERSION)  # version 3 one level deeper
    _plant(t0.path_of(_key(2)), 2, version=FLAT_LAYOUT_VERSION)
    _legacy(tmp_path, 3)

    async def main() -> list[int | None]:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        await t.indexed()
        sizes = await t.lookup([_key(i) for i in range(4)])
        await t.close()
        return sizes

    assert asyncio.run(main()) == [None, None, SIZE, SIZE]
    assert _quarantined(tmp_path) == sorted(_key(i).digest.hex() for i in (0, 1))


def test_a_release_reading_only_versions_1_and_2_skips_new_files_and_quarantines_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downgrade: the previous release's start-up scan (old layout, versions 1-2) reads the old
    files, skips the version-3 ones (logged, counted nowhere as corrupt) and leaves them on disk,
    so a re-upgrade serves them again."""

    async def write_new() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        assert all(r.ok for r in await t.write_many([(_key(i), [memoryview(_payload(i))]) for i in range(4)]))
        await t.close()

    asyncio.run(write_new())
    _legacy(tmp_path, 10)
    files_before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.blk"))

    async def downgraded() -> tuple[list[int | None], int]:
        t = PosixTier(roots=[tmp_path], profile=Profile(flat_layout=False, index_snapshots=False))
        await t.open()
        sizes = await t.lookup([_key(i) for i in (0, 1, 2, 3, 10)])
        corrupt = t.stats().corrupt
        await t.close()
        return sizes, corrupt

    with monkeypatch.context() as m:
        m.setattr(block_format, "READABLE_VERSIONS", (1, 2))
        assert asyncio.run(downgraded()) == ([None, None, None, None, SIZE], 0)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.blk")) == files_before
    assert _quarantined(tmp_path) == []

    async def upgraded_again() -> list[int | None]:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        await t.indexed()
        sizes = await t.lookup([_key(i) for i in (0, 1, 2, 3, 10)])
        await t.close()
        return sizes

    assert asyncio.run(upgraded_again()) == [SIZE] * 5


def test_a_daemon_serves_an_older_releases_files_and_writes_the_new_layout(tmp_path: Path) -> None:
    """Against a real daemon: blocks an older release left are found and load byte-exact (batched
    loads included, kill -9 and restart included); what it dumps goes to the two-level layout."""
    d = DaemonProcess(tmp_path / "ucm", args=["--store-pipeline", "Posix"])
    root = d.data_dir / "blocks"
    for i in range(64):
        _legacy(root, i, 128 if i % 2 else ALIGNED_HEADER_SIZE)
    digests = [_key(i).digest for i in range(64)]
    with d, UcmClient(d.target) as c:
        assert all(c.lookup(NS, digests).present)
        assert c.get_blocks(NS, digests) == [_payload(i) for i in range(64)]
        assert c.put_blocks(NS, [(_key(i).digest, _payload(i)) for i in range(64, 96)]).ok
        d.kill()
    tier = PosixTier(roots=[root])
    for i in range(64, 96):
        assert block_file_header(tier.path_of(_key(i))).version == FLAT_LAYOUT_VERSION
    with d.start(), UcmClient(d.target) as c:
        every = [_key(i).digest for i in range(96)]
        assert c.get_blocks(NS, every) == [_payload(i) for i in range(96)]
        assert c.get_blocks(NS, [key_digest("layout", 1000)]) == [None]  # a negative control
    assert _quarantined(root) == []


def test_the_header_decoder_still_refuses_each_kind_of_damage() -> None:
    """The faster decode (one unpack, CRC over a view, key object reused, padding against a zero
    constant) refuses what the slower one did; the good header is the negative control."""
    k = _key(0)
    good = bytearray(encode_header(k, SIZE, 7, version=FLAT_LAYOUT_VERSION))
    header = block_format.decode_header(memoryview(good), expect=k)
    assert (header.key, header.payload_len, header.checksum, header.version) == (k, SIZE, 7, 3)
    assert header.key is k  # the expected key object, not a copy
    with pytest.raises(block_format.CorruptBlock, match="expected"):
        block_format.decode_header(memoryview(good), expect=_key(1))
    for at, match in ((100, "padding is not zero"), (30, "header checksum mismatch"), (0, "bad magic")):
        bad = bytearray(good)
        bad[at] ^= 0x01
        with pytest.raises(block_format.CorruptBlock, match=match):
            block_format.decode_header(bytes(bad), expect=k)
    wide = bytearray(encode_header(k, SIZE, 7, header_len=ALIGNED_HEADER_SIZE, version=3))
    assert block_format.decode_header(memoryview(wide)).header_len == ALIGNED_HEADER_SIZE
    wide[4000] = 1
    with pytest.raises(block_format.CorruptBlock, match="padding is not zero"):
        block_format.decode_header(memoryview(wide))
    data = [memoryview(_payload(0))]
    split = [memoryview(_payload(0))[:100], memoryview(_payload(0))[100:]]
    assert payload_checksum(data) == payload_checksum(split)  # one-segment fast path, same value
