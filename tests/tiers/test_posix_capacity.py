"""``posix_capacity`` is a bound: what the Posix tier holds never exceeds it, however many writers
make room at once (a real daemon; write-back groups of one dump, and several clients dumping).

Each writer reserves room before it writes and gives the reservation back as its blocks enter the
index, so one writer's eviction is never counted as room by another. The tier's held bytes (its
stats ``bytes``) are sampled from another client all through the dumps, and the block files left on
disk are counted after them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name
from support.posix_files import stored_blocks

from ucm_client import SharedBuffer, UcmClient
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

SIZE = 64 << 10
CAPACITY_BLOCKS = 40
CAPACITY = CAPACITY_BLOCKS * SIZE


class HeldBytes:
    """Samples the Posix tier's held bytes from its own client until stopped; the peak seen.

    Sampling has started when the ``with`` block is entered (connecting a client can take longer
    than a small dump on a loaded machine), and one last sample is taken after it is stopped."""

    def __init__(self, d: DaemonProcess) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._sampling = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(d,))

    def _run(self, d: DaemonProcess) -> None:
        with UcmClient(d.target) as c:
            while True:
                stopping = self._stop.is_set()
                self.samples.append(tiers_by_name(c)["Posix"].bytes)
                self._sampling.set()
                if stopping:
                    return

    def __enter__(self) -> HeldBytes:
        self._thread.start()
        assert self._sampling.wait(30), "the sampling client did not connect"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


def _block_files(d: DaemonProcess) -> int:
    """Blocks on disk: block files and live records of pack files."""
    return stored_blocks(d.data_dir / "blocks")


def test_a_durable_dump_into_a_full_tier_leaves_it_within_capacity(tmp_path: Path) -> None:
    """One 20-block durable dump into a full 40-block tier: write-back writes it down in groups
    that make room concurrently. Before reservations the tier was left holding 52 blocks."""
    args = ["--posix-capacity", str(CAPACITY)]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(60 * SIZE) as src,
        SharedBuffer(20 * SIZE) as dst,
    ):
        src.buf[:] = os.urandom(60 * SIZE)
        region = c.register(src)
        for first in (0, 20):
            blocks = blocks_in(region, 20, SIZE, first=first, offset=first * SIZE)
            assert c.wait(c.dump(NS, blocks, wait_durable=True), 60).ok
        assert tiers_by_name(c)["Posix"].blocks == CAPACITY_BLOCKS
        with HeldBytes(d) as held:
            newest = blocks_in(region, 20, SIZE, first=40, offset=40 * SIZE)
            assert c.wait(c.dump(NS, newest, wait_durable=True), 60).ok
        assert len(held.samples) > 1 and max(held.samples) <= CAPACITY, max(held.samples) // SIZE
        posix = tiers_by_name(c)["Posix"]
        assert posix.blocks == CAPACITY_BLOCKS and posix.bytes == CAPACITY
        assert posix.evictions == 20
        assert _block_files(d) == CAPACITY_BLOCKS
        assert c.wait(c.load(NS, blocks_in(c.register(dst), 20, SIZE, first=40)), 30).ok
        assert bytes(dst.buf) == bytes(src.buf[40 * SIZE :])


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix"])
def test_concurrent_dumps_never_take_the_tier_over_its_capacity(tmp_path: Path, pipeline: str) -> None:
    """Four clients each dump 20-block batches at once, five rounds (100 blocks each, 400 in all,
    ten times the capacity): the tier's held bytes never exceed the capacity while they run, nor
    do its block files after a restart."""
    writers, rounds, batch = 4, 5, 20
    args = ["--store-pipeline", pipeline, "--posix-capacity", str(CAPACITY)]
    errors: list[str] = []

    def dump(d: DaemonProcess, w: int) -> None:
        with UcmClient(d.target) as c, SharedBuffer(batch * SIZE) as buf:
            region = c.register(buf)
            for r in range(rounds):
                first = (w * rounds + r) * batch
                buf.buf[:] = bytes([first % 251]) * (batch * SIZE)
                blocks = blocks_in(region, batch, SIZE, first=first)
                result = c.wait(c.dump(NS, blocks, wait_durable=True), 60)
                if not result.ok:
                    errors.append(f"writer {w} round {r}: {result}")

    with DaemonProcess(tmp_path / "ucm", args=args) as d, HeldBytes(d) as held:
        threads = [threading.Thread(target=dump, args=(d, w)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(held.samples) > 10
    assert max(held.samples) <= CAPACITY, f"held {max(held.samples) // SIZE} blocks of {CAPACITY_BLOCKS}"
    with d.start(), UcmClient(d.target) as c:
        posix = tiers_by_name(c)["Posix"]
        assert posix.bytes <= CAPACITY and posix.blocks <= CAPACITY_BLOCKS
        assert _block_files(d) <= CAPACITY_BLOCKS
