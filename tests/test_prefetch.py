"""Prefetch through a real daemon: blocks only on Posix are promoted into the Cache, a load that
arrives while the promotion runs waits for it instead of reading the disk a second time, and a
corrupt copy is never promoted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.admin_cli import admin
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name

from ucm_client import BlockState, SharedBuffer, UcmClient, key_digest
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

SIZE = 256 << 10
N = 16


def _stored(d: DaemonProcess, c: UcmClient, buf: SharedBuffer) -> list[Any]:
    """N blocks on Posix only (dumped durably, then evicted from the Cache)."""
    buf.buf[: N * SIZE] = os.urandom(N * SIZE)
    blocks = blocks_in(c.register(buf), N, SIZE)
    assert c.wait(c.dump(NS, blocks, wait_durable=True), 30).ok
    assert admin(d, "evict", "--tier", "Cache", "--all", "--yes").returncode == 0
    assert tiers_by_name(c)["Cache"].blocks == 0
    return blocks


def test_prefetch_promotes_and_a_concurrent_load_reads_memory(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "ucm") as d,
        UcmClient(d.target) as c,
        SharedBuffer(N * SIZE) as src,
        SharedBuffer(N * SIZE) as dst,
    ):
        _stored(d, c, src)
        posix_reads = tiers_by_name(c)["Posix"].read_bytes
        task = c.prefetch(NS, [key_digest("block", i) for i in range(N)] + [key_digest("nope")])
        load = c.load(NS, blocks_in(c.register(dst), N, SIZE))  # right behind it, as vLLM's worker
        assert c.wait(load, 30).ok
        result = c.wait(task, 30)
        assert result.states == [BlockState.OK] * N + [BlockState.MISSING]
        assert bytes(dst.buf) == bytes(src.buf)
        tiers = tiers_by_name(c)
        assert tiers["Cache"].blocks == N
        # every block left the disk once: the load waited for the promotion (or found it done)
        assert tiers["Posix"].read_bytes - posix_reads <= N * SIZE + N * 4096


def test_without_prefetch_the_cache_stays_empty_and_corrupt_blocks_are_not_promoted(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm") as d, UcmClient(d.target) as c, SharedBuffer(N * SIZE) as src:
        blocks = _stored(d, c, src)
        assert tiers_by_name(c)["Cache"].blocks == 0  # negative control: nothing promotes by itself
        victim = blocks[3].key.hex()
        path = d.data_dir / "blocks" / NS.hex() / victim[:2] / f"{victim}.blk"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
        result = c.wait(c.prefetch(NS, [b.key for b in blocks]), 30)
        assert result.states[3] is BlockState.FAILED and "checksum" in result.reasons[3]
        assert result.states[:3] + result.states[4:] == [BlockState.OK] * (N - 1)
        listing = admin(d, "--json", "inspect", f"{NS.hex()}/{victim}")
        assert "Cache" not in listing.stdout
        assert tiers_by_name(c)["Cache"].blocks == N - 1
