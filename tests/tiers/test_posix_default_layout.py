"""Stores of earlier layouts under the default configuration, which packs blocks up to 64 KiB.

A real Posix-only daemon on its defaults is started over stores as earlier releases left them: one
file per block with the index snapshot of version 1 (the release before packs), and packs with the
version-2 snapshot (the release that added them, packs off by default). Every block loads byte-exact
from the snapshot, what is written afterwards goes into packs, a rewritten or deleted old block
leaves no file behind, and restarts (clean, ``kill -9``) keep it so. The other direction, a
downgrade, is what a release without packs sees: its scan (kept as the DS3FS start-up path) finds
the block files, skips the packs without quarantining anything, and the packed blocks serve again
once the newer release is back. The index built from a snapshot stays within 256 B a block.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

from support.blocks import NS
from support.posix_files import find_block, stored_blocks, write_older_snapshot
from support.posix_store import (
    SIZE,
    alive,
    blocks_root,
    check_all,
    index_done,
    index_keys,
    payload,
    plant,
    posix_daemon,
    previous_release_sizes,
)

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient
from ucm_protocol.keys import BlockKey
from ucm_server.store.posix import PosixTier, index_snapshot, packs

NO_PACKS = ("--posix-pack-max-block-bytes", "0")


def dump(c: UcmClient, first: int, n: int) -> None:
    """Blocks ``first`` .. ``first + n - 1`` of :mod:`support.posix_store` as ONE Dump from shared
    memory (a Dump's small blocks are what the daemon packs), acknowledged durable."""
    with SharedBuffer(n * SIZE) as buf:
        region = c.register(buf)
        for j in range(n):
            buf.buf[j * SIZE : (j + 1) * SIZE] = payload(first + j)
        blocks = [BlockIO(k, (Segment(region, j * SIZE, SIZE),)) for j, k in enumerate(index_keys(n, first))]
        result = c.wait(c.dump(NS, blocks, wait_durable=True), 60)
        c.unregister(region)
    assert result.ok, result.reasons


def pack_files(root: Path) -> list[Path]:
    return sorted((root / packs.PACK_DIR).rglob(f"*{packs.PACK_SUFFIX}"))


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.blk") if ".quarantine" not in p.parts)


def snapshot_version(root: Path) -> int:
    return int.from_bytes((root / index_snapshot.SNAPSHOT_NAME).read_bytes()[8:12], "little")


def test_a_store_of_block_files_and_a_version_1_snapshot_upgrades_to_packs(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path)  # the defaults: packs for blocks up to 64 KiB
    root = blocks_root(d)
    plant(d, 0, 200)  # one file per block, as every release before packs wrote them
    keys = [bytes(NS) + k for k in index_keys(200)]
    write_older_snapshot(root, keys, [SIZE] * 200, [1.7e9 + i for i in range(200)])
    assert snapshot_version(root) == 1
    with d.start(), UcmClient(d.target) as c:
        check_all(c, range(200))
        assert "200 blocks indexed from snapshots" in d.log()
        index_done(c)
        assert len(block_files(root)) == 200 and not pack_files(root)  # reading changes nothing on disk
        dump(c, 200, 100)  # new blocks: packed
        dump(c, 0, 20)  # 20 old blocks written again: packed, their files removed
        assert c.delete(NS, index_keys(20, 20)) == 20  # 20 old blocks deleted: their files removed
        assert len(block_files(root)) == 160 and pack_files(root)
        assert all(find_block(root, NS, k).packed for k in index_keys(20) + index_keys(100, 200))
        check_all(c, [*range(20), *range(40, 300)], absent=range(20, 40))  # type: ignore[arg-type]
        d.kill()  # no clean snapshot: the periodic one or the files' headers
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, [*range(20), *range(40, 300)], absent=range(20, 40))  # type: ignore[arg-type]
        d.stop()
    assert snapshot_version(root) == index_snapshot.XXH_VERSION
    with d.start(), UcmClient(d.target) as c:
        assert "280 blocks indexed from snapshots" in d.log()
        check_all(c, [*range(20), *range(40, 300)], absent=range(20, 40))  # type: ignore[arg-type]
        assert stored_blocks(root) == 280
        alive(d, c)
        d.stop()


def test_packs_and_a_version_2_snapshot_load_from_the_snapshot(tmp_path: Path) -> None:
    """The release that added packs wrote version-2 snapshots beside the same pack files: such a
    snapshot (every block's pack and offset as it recorded them) is loaded, not re-read from headers."""
    d = posix_daemon(tmp_path)
    root = blocks_root(d)
    plant(d, 100, 20)
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        dump(c, 0, 100)
        d.stop()
    epoch = (root / index_snapshot.MARKER_NAME).read_bytes()
    blocks = index_snapshot.read_snapshot(root, epoch, 1 << 20)
    assert blocks.packs is not None and blocks.offsets is not None
    assert (blocks.packs != 0).sum() == 100
    write_older_snapshot(
        root,
        list(blocks.keys),
        [int(s) for s in blocks.sizes],
        [float(t) for t in blocks.times],
        list(zip(blocks.packs.tolist(), blocks.offsets.tolist(), strict=True)),  # type: ignore[union-attr]
    )
    assert snapshot_version(root) == 2
    with d.start(), UcmClient(d.target) as c:
        check_all(c, range(120))
        assert "120 blocks indexed from snapshots" in d.log()
        posix = index_done(c)
        assert posix["pack_files"] == len(pack_files(root)) >= 2
        assert c.delete(NS, index_keys(100)) == 100  # every packed block: the packs go with them
        assert not pack_files(root)
        check_all(c, range(100, 120), absent=range(100))
        d.stop()


def test_a_stale_snapshot_is_settled_by_where_the_blocks_are_now(tmp_path: Path) -> None:
    """A snapshot older than the blocks' last writes (put back with its marker, as a crash leaves
    the last periodic one): blocks it places in a pack were written again since as files of their
    own, or into another pack, and the old records are gone; blocks it places in files now live in
    a pack. The sweep after the start finds each where it is now, and the index follows: every
    block loads, none is forgotten (before, such a block read as missing once its old place was
    gone, and stayed missing until the next start)."""
    d = posix_daemon(tmp_path, "--posix-snapshot-interval-s", "0")
    root = blocks_root(d)
    plant(d, 40, 10)  # blocks 40..49 in files of their own
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        dump(c, 0, 40)  # blocks 0..39 in one pack
        d.stop()
    saved = {n: (root / n).read_bytes() for n in (index_snapshot.SNAPSHOT_NAME, index_snapshot.MARKER_NAME)}
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        for i in range(10):  # one block a call: a file of its own, its pack record zeroed
            assert c.put_blocks(NS, [(index_keys(1, i)[0], payload(i))]).ok
        dump(c, 10, 10)  # blocks 10..19 into a new pack
        dump(c, 40, 10)  # blocks 40..49 from their files into a pack, the files removed
        d.stop()
    assert all(not find_block(root, NS, k).packed for k in index_keys(10))
    assert all(find_block(root, NS, k).packed for k in index_keys(10, 40))
    for name, data in saved.items():
        (root / name).write_bytes(data)
    with d.start(), UcmClient(d.target) as c:
        posix = index_done(c)
        assert "50 blocks indexed from snapshots" in d.log()
        assert "30 blocks found where a snapshot did not place them" in d.log()
        check_all(c, range(50))
        assert posix["blocks"] == 50
        d.stop()


def test_a_downgrade_sees_the_block_files_and_leaves_the_packs_for_a_re_upgrade(tmp_path: Path) -> None:
    """What a release without packs sees (its start-up scan: only ``.blk`` files): the blocks in
    files, not the packed ones, and nothing quarantined, skipped or removed; the newer release then
    serves every block again, from the same files."""
    d = posix_daemon(tmp_path)
    root = blocks_root(d)
    plant(d, 0, 30)
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        dump(c, 30, 50)
        d.stop()
    on_disk = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    seen = previous_release_sizes(root, 80)
    assert seen == [SIZE] * 30 + [None] * 50
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) == on_disk
    assert not (root / ".quarantine").exists()
    with d.start(), UcmClient(d.target) as c:
        check_all(c, range(80))
        d.stop()


def test_with_packs_off_new_blocks_are_files_and_packed_ones_still_load(tmp_path: Path) -> None:
    """``posix_pack_max_block_bytes: 0`` (before a downgrade, say) writes one file per block from
    then on, and the blocks already packed keep loading."""
    d = posix_daemon(tmp_path)
    root = blocks_root(d)
    with d.start(), UcmClient(d.target) as c:
        dump(c, 0, 40)
        d.stop()
    packed = pack_files(root)
    assert packed and not block_files(root)
    d.extra_args = [*d.extra_args, *NO_PACKS]
    with d.start(), UcmClient(d.target) as c:
        dump(c, 40, 40)
        assert len(block_files(root)) == 40 and pack_files(root) == packed
        check_all(c, range(80))
        d.stop()


def test_an_index_loaded_from_a_snapshot_holds_a_block_in_under_256_bytes() -> None:
    """100,000 blocks, half in packs of 64, through the snapshot load a start runs (read, check,
    build, install), measured with tracemalloc: keys, stamps, packs and the ordered map together."""
    n = 100_000
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = PosixTier(roots=[root])
        pack: packs.Pack | None = None
        for i in range(n):
            key = BlockKey(NS, os.urandom(32))
            if i % 2:
                writer._index.add(key, SIZE * (1 + i % 4), 1_700_000_000 + i / 1000)
                continue
            if i % 128 == 0:
                pack = writer._packs.register(packs.Pack(packs.new_pack_id(), root))
            assert pack is not None
            pack.add(key, packs.head_len(64) + (i % 128) * 4224)
            writer._index.put(key, pack.stamp(SIZE, 1_700_000_000 + i / 1000))
        writer.recovery.write_snapshots(*writer._index.columns())
        epoch = (root / index_snapshot.MARKER_NAME).read_bytes()
        del writer, pack
        reader = PosixTier(roots=[root])
        tracemalloc.start()
        try:
            loaded, total, _, found = reader.recovery.load_snapshots([epoch])
            reader._index.install(loaded, total)
            reader.recovery._register_loaded(found, [], True)
            del loaded, found
            used = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert used / n <= 256, used / n
    assert len(reader._index) == n and len(reader._packs.packs) == -(-n // 128)
    key = next(iter(reader._index.items()))[0]
    assert sys.getsizeof(key) < 100 and reader._index.get(key) is not None
