"""Cache|Posix through a real daemon: eviction, serving evicted blocks from disk, promotion, modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name

from ucm_client import SharedBuffer, UcmClient
from ucm_server.store.format import ALIGNED_HEADER_SIZE
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`


@pytest.mark.parametrize("mode", ["write-back", "write-through"])
def test_evicted_blocks_are_served_from_posix(tmp_path: Path, mode: str) -> None:
    n, size = 48, 256 << 10  # 12 MiB through a 4 MiB cache
    args = ["--cache-capacity", "4MiB", "--write-mode", mode]
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target) as c:
        with SharedBuffer(n * size) as src, SharedBuffer(n * size) as dst:
            src.buf[:] = os.urandom(n * size)
            region = c.register(src)
            for first in range(0, n, 8):  # 2 MiB per dump: each fits the cache, all of them do not
                blocks = blocks_in(region, 8, size, first=first, offset=first * size)
                assert c.wait(c.dump(NS, blocks, wait_durable=True), 60).ok
            tiers = tiers_by_name(c)
            cache, posix = tiers["Cache"], tiers["Posix"]
            assert cache.evictions > 0 and cache.bytes <= 4 << 20  # type: ignore[attr-defined]
            assert posix.blocks == n  # type: ignore[attr-defined]
            assert c.wait(c.load(NS, blocks_in(c.register(dst), n, size)), 60).ok
            assert bytes(dst.buf) == bytes(src.buf)
            assert tiers_by_name(c)["Posix"].hits > 0  # type: ignore[attr-defined]


def test_read_from_posix_is_promoted_into_cache(tmp_path: Path) -> None:
    size = 64 << 10
    d = DaemonProcess(tmp_path / "ucm")
    with d, UcmClient(d.target) as c, SharedBuffer(4 * size) as buf:
        buf.buf[:] = os.urandom(4 * size)
        assert c.wait(c.dump(NS, blocks_in(c.register(buf), 4, size), wait_durable=True), 10).ok
    with d.start(), UcmClient(d.target) as c, SharedBuffer(4 * size) as buf:  # Cache empty, Posix not
        blocks = blocks_in(c.register(buf), 4, size)
        assert tiers_by_name(c)["Cache"].blocks == 0  # type: ignore[attr-defined]
        assert c.wait(c.load(NS, blocks), 10).ok
        assert tiers_by_name(c)["Cache"].blocks == 4  # type: ignore[attr-defined]
        hits_before = tiers_by_name(c)["Posix"].hits  # type: ignore[attr-defined]
        assert c.wait(c.load(NS, blocks), 10).ok
        assert tiers_by_name(c)["Posix"].hits == hits_before  # type: ignore[attr-defined]


def test_posix_only_pipeline(tmp_path: Path) -> None:
    size = 64 << 10
    args = ["--store-pipeline", "Posix"]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(2 * size) as buf,
    ):
        region = c.register(buf)
        buf.buf[:size] = os.urandom(size)
        assert c.wait(c.dump(NS, blocks_in(region, 1, size)), 10).ok
        assert c.wait(c.load(NS, blocks_in(region, 1, size, offset=size)), 10).ok
        assert bytes(buf.buf[:size]) == bytes(buf.buf[size:])
        assert [t.name for t in c.stats().tiers] == ["Posix"]


def test_corrupted_block_file_is_reported_never_loaded(tmp_path: Path) -> None:
    size = 256 << 10  # from posix direct_min_bytes up, aligned blocks go out with O_DIRECT
    d = DaemonProcess(tmp_path / "ucm")
    with d, UcmClient(d.target) as c, SharedBuffer(size) as buf:
        buf.buf[:] = os.urandom(size)
        assert c.wait(c.dump(NS, blocks_in(c.register(buf), 1, size), wait_durable=True), 10).ok
    (path,) = list((d.data_dir / "blocks").rglob("*.blk"))
    raw = bytearray(path.read_bytes())
    assert len(raw) == ALIGNED_HEADER_SIZE + size  # an aligned shm block is written with O_DIRECT
    raw[-500] ^= 0x01  # a payload byte: the header stays valid, so only the read finds it
    path.write_bytes(raw)
    with d.start(), UcmClient(d.target) as c, SharedBuffer(size) as out:
        result = c.wait(c.load(NS, blocks_in(c.register(out), 1, size)), 10)
        assert not result.ok
        assert "checksum" in result.reasons[0]
        assert tiers_by_name(c)["Posix"].corrupt == 1  # type: ignore[attr-defined]
        assert c.lookup(NS, [blocks_in(0, 1, size)[0].key]).present == [False]
        d.stop()
