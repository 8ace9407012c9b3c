"""Posix batches of small blocks (issue #13, item 2): written and read in groups, committed as a group.

A durable batch is written to temporary files, made durable with one ``syncfs`` per root, renamed,
and synced once more before any block is acknowledged: the number of syncs is bounded per batch
(asserted through the tier's ``group_syncs`` counter), a block visible after a crash is complete,
and every block acknowledged durable survives ``kill -9`` of a real daemon mid-batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockState, SharedBuffer, UcmClient
from ucm_client.errors import UcmError
from ucm_server.keys import Namespace
from ucm_server.store import posix
from ucm_server.store.base import BlockState as TierState
from ucm_server.store.posix import TMP_MARK, PosixTier, group_commit
from ucm_server.testing.daemon import DaemonProcess
from ucm_server.testing.tier_suite import key, payload

needs_syncfs = pytest.mark.skipif(
    group_commit.SYNCFS is None, reason="group commit needs syncfs (Linux >= 5.8)"
)


@needs_syncfs
def test_a_durable_batch_costs_two_syncs_per_root_not_per_block(tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    datas = [payload(i, 4096) for i in range(300)]

    async def main() -> tuple[dict[str, float], list[bytes]]:
        t = PosixTier(roots=roots)
        await t.open()
        results = await t.write_many([(key(i), [memoryview(d)]) for i, d in enumerate(datas)])
        assert all(r.ok for r in results), results
        extra = dict(t.stats().extra)
        outs = [bytearray(4096) for _ in datas]
        got = await t.read_many([(key(i), [memoryview(o)]) for i, o in enumerate(outs)])
        assert all(r.ok for r in got), got
        return extra, [bytes(o) for o in outs]

    extra, outs = asyncio.run(main())
    assert extra["group_syncs"] == 4  # 2 roots x (data, then names): not 600 fsyncs
    assert outs == datas
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]


def test_non_durable_batches_never_sync(tmp_path: Path) -> None:
    async def main() -> dict[str, float]:
        t = PosixTier(roots=[tmp_path], durable=False)
        await t.open()
        results = await t.write_many([(key(i), [memoryview(payload(i, 4096))]) for i in range(100)])
        assert all(r.ok for r in results)
        return dict(t.stats().extra)

    assert "group_syncs" not in asyncio.run(main())


def test_a_batch_with_a_blocked_directory_fails_only_those_blocks(tmp_path: Path) -> None:
    """A symlink planted where one block's namespace directory would be fails that namespace's
    blocks (nothing written outside the root), the rest of the batch is stored."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    other = key(1, Namespace(b"\x07" * 16))
    (root / other.namespace.hex()).symlink_to(outside)

    async def main() -> list[TierState]:
        t = PosixTier(roots=[root])
        await t.open()
        items = [(key(i), [memoryview(payload(i, 4096))]) for i in range(2, 40)]
        results = await t.write_many([(other, [memoryview(payload(1, 4096))]), *items])
        return [r.state for r in results]

    states = asyncio.run(main())
    assert states[0] is TierState.FAILED
    assert all(s is TierState.OK for s in states[1:])
    assert not list(outside.iterdir())


@pytest.mark.parametrize("packs", [False, True], ids=["block_files", "packs"])
def test_kill_9_during_group_committed_batches_loses_nothing_acknowledged(
    tmp_path: Path, packs: bool
) -> None:
    """Durable 4 KiB batches of 256 (one group commit each) into a Posix-only daemon, ``kill -9`` at
    a random moment: after a restart every acknowledged block is found and byte-exact, whatever
    else Lookup reports loads intact, and no temporary file is left behind. ``packs``: the batches
    are written as pack files (``posix_pack_max_block_bytes``), committed the same way."""
    n, size, batch = 2048, 4096, 256
    packing = ["--posix-pack-max-block-bytes", "65536"] if packs else []
    d = DaemonProcess(tmp_path / "ucm", args=["--store-pipeline", "Posix", *packing])
    digests: list[bytes] = []
    with SharedBuffer(n * size) as src:
        for i in range(n):
            chunk = os.urandom(size)
            src.buf[i * size : (i + 1) * size] = chunk
            digests.append(hashlib.sha256(chunk).digest())
        d.start()
        acked: set[int] = set()

        def dump() -> None:
            with UcmClient(d.target, rpc_timeout_s=5) as c:
                region = c.register(src)
                try:
                    for i in range(0, n, batch):
                        blocks = blocks_in(region, batch, size, first=i, offset=i * size)
                        r = c.wait(c.dump(NS, blocks, wait_durable=True), 30)
                        acked.update(i + j for j, s in enumerate(r.states) if s is BlockState.OK)
                except UcmError:
                    return  # killed under us: expected

        t = threading.Thread(target=dump)
        t.start()
        deadline = time.monotonic() + 30
        while not acked and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(random.uniform(0.0, 0.3))  # somewhere inside a later batch
        d.kill()
        t.join(30)
        assert acked, "no batch completed before the kill"
        written = [p.suffix for p in (d.data_dir / "blocks").rglob("*") if p.suffix in (".blk", ".pack")]
        assert written and set(written) == {".pack" if packs else ".blk"}

    with d.start(), UcmClient(d.target) as c, SharedBuffer(n * size) as dst:
        blocks = blocks_in(c.register(dst), n, size)
        _indexed(c)  # a restart after kill -9 re-reads headers in the background
        present = c.lookup(NS, [b.key for b in blocks]).present
        found = {i for i, p in enumerate(present) if p}
        assert acked <= found, f"{len(acked - found)} acknowledged blocks lost"
        result = c.wait(c.load(NS, [blocks[i] for i in sorted(found)]), 60)
        assert result.ok, result.reasons
        for i in found:
            assert hashlib.sha256(bytes(dst.buf[i * size : (i + 1) * size])).digest() == digests[i]
        assert not [p for p in (d.data_dir / "blocks").rglob("*") if TMP_MARK in p.name]
        assert d.healthy()
        d.stop()


def _indexed(c: UcmClient, timeout_s: float = 60.0) -> None:
    """Wait until the Posix tier's background indexing has ended (its progress keys gone)."""
    deadline = time.monotonic() + timeout_s
    while "index_adopting" in next(t for t in c.stats().tiers if t.kind == "Posix").extra:
        assert time.monotonic() < deadline, "indexing did not end"
        time.sleep(0.05)


@pytest.mark.parametrize("checked", [False, True], ids=["read_many", "read_checked_many"])
def test_a_batch_read_serves_good_blocks_and_never_bad_bytes(tmp_path: Path, checked: bool) -> None:
    """In one batched read: a flipped payload byte, a flipped header byte, a cut file, a symlink
    and a FIFO where block files should be each fail (corrupt ones quarantined) with their
    destination zeroed; the good blocks beside them load byte-exact."""
    size, n = 4096, 12
    datas = [payload(i, size) for i in range(n)]
    secret = tmp_path / "secret"
    secret.write_bytes(datas[0])

    async def write() -> PosixTier:
        t = PosixTier(roots=[tmp_path / "root"], durable=False)
        await t.open()
        assert all(r.ok for r in await t.write_many([(key(i), [memoryview(d)]) for i, d in enumerate(datas)]))
        return t

    t = asyncio.run(write())
    paths = [t.path_of(key(i)) for i in range(n)]
    raw = bytearray(paths[1].read_bytes())
    raw[-100] ^= 1
    paths[1].write_bytes(raw)
    raw = bytearray(paths[2].read_bytes())
    raw[40] ^= 1
    paths[2].write_bytes(raw)
    paths[3].write_bytes(paths[3].read_bytes()[:-1])
    paths[4].unlink()
    paths[4].symlink_to(secret)
    paths[5].unlink()
    os.mkfifo(paths[5])

    async def read() -> tuple[list[TierState | None], list[bytes]]:
        t2 = PosixTier(roots=[tmp_path / "root"], durable=False)
        for i in range(n):  # the index as it was before the files were spoiled (open would scan)
            t2._remember(key(i), posix.Entry(size=size, stored_at=0.0))
        outs = [bytearray(b"\xee" * size) for _ in range(n)]
        items = [(key(i), [memoryview(o)]) for i, o in enumerate(outs)]
        got = await (t2.read_checked_many(items) if checked else t2.read_many(items))
        return [None if r is None else r.state for r in got], [bytes(o) for o in outs]

    states, outs = asyncio.run(read())
    for i in range(1, 6):
        if checked and i == 1:
            assert states[i] is None  # bytes did not match: the caller re-reads it through staging
        else:
            assert states[i] is TierState.FAILED, (i, states[i])
        if not (checked and i == 1):
            assert outs[i] in (b"\0" * size, b"\xee" * size), i  # zeroed or never written
    for i in (0, *range(6, n)):
        assert states[i] is TierState.OK
        assert outs[i] == datas[i]
    quarantined = list((tmp_path / "root" / ".quarantine").iterdir())
    assert len(quarantined) == (2 if checked else 3)


def test_without_syncfs_a_durable_batch_fsyncs_per_file_and_still_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback for kernels whose syncfs hides errors (< 5.8), forced here by hiding syncfs:
    each file fsynced before its rename, each directory once per job; no group sync counted."""
    monkeypatch.setattr(group_commit, "SYNCFS", None)
    datas = [payload(i, 4096) for i in range(70)]

    async def main() -> tuple[dict[str, float], list[bytes]]:
        t = PosixTier(roots=[tmp_path])
        await t.open()
        assert all(r.ok for r in await t.write_many([(key(i), [memoryview(d)]) for i, d in enumerate(datas)]))
        outs = [bytearray(4096) for _ in datas]
        assert all(r.ok for r in await t.read_many([(key(i), [memoryview(o)]) for i, o in enumerate(outs)]))
        return dict(t.stats().extra), [bytes(o) for o in outs]

    extra, outs = asyncio.run(main())
    assert "group_syncs" not in extra
    assert outs == datas
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]
