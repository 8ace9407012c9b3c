"""Posix ``O_DIRECT`` writes: used exactly when they can be, readable beside buffered files, checked alike.

Aligned sources are anonymous mappings (page aligned, like the Cache arena and shared-memory
regions); everything else must fall back to a buffered write with the 128-byte header.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm_protocol.states import BlockState
from ucm_server.store.format import (
    ALIGNED_HEADER_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    CorruptBlock,
    decode_header,
    encode_header,
    payload_checksum,
)
from ucm_server.store.posix import QUARANTINE, PosixTier, block_file_header
from ucm_server.testing.tier_suite import key, payload

SIZE = 256 << 10  # the smallest block written O_DIRECT by default (direct_min_bytes)


@pytest.fixture
def aligned() -> Iterator[memoryview]:
    """A page-aligned writable buffer holding a recognisable payload."""
    page = mmap.mmap(-1, SIZE)
    view = memoryview(page)
    view[:] = payload(7, SIZE)
    yield view
    view.release()
    page.close()


def _write(root: Path, items: list[tuple[int, memoryview]], **kw: Any) -> None:
    async def main() -> None:
        t = PosixTier(roots=[root], **kw)
        await t.open()
        results = await t.write_many([(key(i), [src]) for i, src in items])
        assert all(r.state is BlockState.OK for r in results), results
        await t.close()

    asyncio.run(main())


def _read(root: Path, i: int, size: int = SIZE) -> tuple[BlockState, str, bytes]:
    async def main() -> tuple[BlockState, str, bytes]:
        t = PosixTier(roots=[root])
        await t.open()
        out = bytearray(size)
        r = await t.read_into(key(i), [memoryview(out)])
        await t.close()
        return r.state, r.reason, bytes(out)

    return asyncio.run(main())


def _file(root: Path, i: int) -> Path:
    return PosixTier(roots=[root]).path_of(key(i))


def test_aligned_block_is_written_direct_with_a_4k_header(tmp_path: Path, aligned: memoryview) -> None:
    _write(tmp_path, [(1, aligned)])
    path = _file(tmp_path, 1)
    assert block_file_header(path).header_len == ALIGNED_HEADER_SIZE
    assert path.stat().st_size == ALIGNED_HEADER_SIZE + SIZE
    assert _read(tmp_path, 1) == (BlockState.OK, "", bytes(aligned))


def test_unaligned_or_odd_sized_or_read_only_sources_are_written_buffered(
    tmp_path: Path, aligned: memoryview
) -> None:
    odd_address = aligned[512 : 512 + 8192]  # 4 KiB multiple, but not on a 4 KiB boundary
    odd_length = aligned[: SIZE - 100]
    read_only = memoryview(bytes(aligned))
    _write(tmp_path, [(1, odd_address), (2, odd_length), (3, read_only)])
    for i, src in [(1, odd_address), (2, odd_length), (3, read_only)]:
        assert block_file_header(_file(tmp_path, i)).header_len == HEADER_SIZE
        assert _read(tmp_path, i, src.nbytes)[2] == bytes(src)


def test_direct_io_off_writes_buffered(tmp_path: Path, aligned: memoryview) -> None:
    _write(tmp_path, [(1, aligned)], direct_io=False)
    assert block_file_header(_file(tmp_path, 1)).header_len == HEADER_SIZE
    assert _read(tmp_path, 1)[2] == bytes(aligned)


def test_both_kinds_are_indexed_at_open_and_served(tmp_path: Path, aligned: memoryview) -> None:
    _write(tmp_path, [(1, aligned)])
    _write(tmp_path, [(2, aligned)], direct_io=False)

    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        assert await t.lookup([key(1), key(2)]) == [SIZE, SIZE]
        info = await t.info(key(1))
        assert info is not None and info.checksum is not None
        await t.close()

    asyncio.run(main())
    assert _read(tmp_path, 1)[0] is BlockState.OK and _read(tmp_path, 2)[0] is BlockState.OK


@pytest.mark.parametrize("where", ["payload", "padding"])
def test_a_flipped_byte_of_a_direct_file_is_never_served(
    tmp_path: Path, aligned: memoryview, where: str
) -> None:
    _write(tmp_path, [(1, aligned)])
    path = _file(tmp_path, 1)
    raw = bytearray(path.read_bytes())
    raw[ALIGNED_HEADER_SIZE + 100 if where == "payload" else 1000] ^= 0x20
    path.write_bytes(raw)

    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        if where == "padding":  # the header is checked at open: quarantined before anyone asks
            assert await t.lookup([key(1)]) == [None]
        else:
            out = bytearray(SIZE)
            r = await t.read_into(key(1), [memoryview(out)])
            assert r.state is BlockState.FAILED and "checksum" in r.reason
            assert out == bytes(SIZE)
        assert t.stats().corrupt == 1
        await t.close()

    asyncio.run(main())
    assert not path.exists() and len(list((tmp_path / QUARANTINE).iterdir())) == 1


def test_filesystem_refusing_o_direct_falls_back_to_buffered__fault_injected(
    tmp_path: Path, aligned: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Test double: this kernel's ext4 and tmpfs both accept ``O_DIRECT``, so the refusal is injected."""
    real_open = os.open
    refused: list[str] = []

    def open_refusing_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument (injected)", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_refusing_direct)
    _write(tmp_path, [(1, aligned), (2, aligned)])
    monkeypatch.undo()
    assert len(refused) == 1  # the root is remembered: the second block does not try again
    for i in (1, 2):
        assert block_file_header(_file(tmp_path, i)).header_len == HEADER_SIZE
        assert _read(tmp_path, i)[2] == bytes(aligned)
    assert not [p for p in tmp_path.rglob("*") if ".tmp." in p.name]


def test_stats_count_direct_and_buffered_writes(tmp_path: Path, aligned: memoryview) -> None:
    async def main() -> dict[str, float]:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        await t.write_many([(key(1), [aligned]), (key(2), [aligned[: SIZE - 100]])])
        extra = dict(t.stats().extra)
        await t.close()
        return extra

    extra = asyncio.run(main())
    assert {k: extra[k] for k in ("direct_writes", "buffered_writes")} == {
        "direct_writes": 1.0,
        "buffered_writes": 1.0,
    }


def test_small_aligned_blocks_are_written_buffered_below_direct_min_bytes(
    tmp_path: Path, aligned: memoryview
) -> None:
    """A synchronous device write per 64 KiB block costs more than the copy O_DIRECT saves."""
    _write(tmp_path, [(1, aligned[: 64 << 10]), (2, aligned[: 64 << 10])], pack_max_block_bytes=0)  # files
    for i in (1, 2):
        assert block_file_header(_file(tmp_path, i)).header_len == HEADER_SIZE
        assert _read(tmp_path, i, 64 << 10)[2] == bytes(aligned[: 64 << 10])
    _write(tmp_path, [(3, aligned[: 64 << 10])], direct_min_bytes=4096)
    assert block_file_header(_file(tmp_path, 3)).header_len == ALIGNED_HEADER_SIZE


def test_format_versions_posix_files_are_3_object_headers_stay_1_and_2(
    tmp_path: Path, aligned: memoryview
) -> None:
    """Posix files (direct or buffered) live in the two-level layout and say so with version 3, which
    an older release skips; a header encoded without a version is 1 (128 bytes) or 2 (4 KiB), as
    the object tiers write it, so an older release reads those."""
    _write(tmp_path, [(1, aligned), (2, aligned[: SIZE - 100])])
    direct, buffered = _file(tmp_path, 1).read_bytes(), _file(tmp_path, 2).read_bytes()
    assert int.from_bytes(direct[4:6], "little") == FORMAT_VERSION == 3
    assert int.from_bytes(direct[8:12], "little") == ALIGNED_HEADER_SIZE
    assert int.from_bytes(buffered[4:6], "little") == 3
    checksum = payload_checksum([aligned])
    assert encode_header(key(3), SIZE, checksum)[4:6] == (1).to_bytes(2, "little")
    aligned_header = encode_header(key(3), SIZE, checksum, header_len=ALIGNED_HEADER_SIZE)
    assert aligned_header[4:6] == (2).to_bytes(2, "little")
    with pytest.raises(ValueError, match="cannot have a 4096-byte header"):
        encode_header(key(3), SIZE, checksum, header_len=ALIGNED_HEADER_SIZE, version=1)
    forged = bytearray(encode_header(key(3), SIZE, checksum, header_len=ALIGNED_HEADER_SIZE))
    forged[4:6] = (1).to_bytes(2, "little")  # a version-1 header cannot have a 4 KiB header
    forged[84:88] = zlib.crc32(bytes(forged[:84])).to_bytes(4, "little")  # a valid CRC over the fields
    with pytest.raises(CorruptBlock, match="not valid in format version 1"):
        decode_header(bytes(forged))


def test_a_direct_file_cut_inside_its_header_is_quarantined(tmp_path: Path, aligned: memoryview) -> None:
    _write(tmp_path, [(1, aligned)])
    path = _file(tmp_path, 1)
    path.write_bytes(path.read_bytes()[:2000])  # valid fields, part of the padding, nothing more

    async def main() -> None:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        assert await t.lookup([key(1)]) == [None]
        assert t.stats().corrupt == 1
        await t.close()

    asyncio.run(main())
    assert not path.exists()
