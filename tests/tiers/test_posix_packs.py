"""Pack files in the Posix tier (issue #13, item 2; :mod:`ucm_server.store.posix.packs`).

With ``posix_pack_max_block_bytes`` set, the small blocks of a dump batch share one ``.pack`` file.
Against a real Posix-only daemon: byte-exact round trips of packed blocks of several sizes beside
block files; deletes that stay deleted across restarts (scan and snapshot); a corrupt block in a
pack never served while its neighbours are; truncated and forged packs adopting only their valid
records; old ``.blk`` files beside packs; a clean restart restoring packed blocks from the (version
2) index snapshot, a stale one not trusted; durable packed batches group-committed. (``kill -9``
mid packed dump: the ``packs`` case of ``test_posix_group_commit``.) Each test has its negative
control (packs off, or the untouched neighbours).
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import pytest
from support.blocks import NS
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
)

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest
from ucm_protocol.keys import BlockKey
from ucm_server.store.format import HEADER_SIZE, decode_header, encode_header, payload_checksum
from ucm_server.store.posix import SUFFIX, TMP_MARK, PosixTier, group_commit, index_snapshot, packs
from ucm_server.testing.daemon import DaemonProcess

PACKS = ("--posix-pack-max-block-bytes", "65536")


def dump(c: UcmClient, items: list[tuple[bytes, bytes]]) -> None:
    """Dump ``(digest, data)`` pairs as ONE batch from shared memory (acknowledged durable): the
    daemon writes a Dump's blocks together, so the small ones share a pack (PutBlocks writes one
    block per call: never packed)."""
    with SharedBuffer(sum(len(v) for _, v in items)) as buf:
        region = c.register(buf)
        blocks, at = [], 0
        for k, v in items:
            buf.buf[at : at + len(v)] = v
            blocks.append(BlockIO(k, (Segment(region, at, len(v)),)))
            at += len(v)
        result = c.wait(c.dump(NS, blocks, wait_durable=True), 60)
        c.unregister(region)
    assert result.ok, result.reasons


def put_packed(c: UcmClient, first: int, n: int) -> None:
    """Blocks ``first`` .. ``first + n - 1`` of :mod:`support.posix_store`, dumped as one batch."""
    dump(c, [(k, payload(first + j)) for j, k in enumerate(index_keys(n, first))])


def pack_files(d: DaemonProcess) -> list[Path]:
    return sorted((blocks_root(d) / packs.PACK_DIR).rglob(f"*{packs.PACK_SUFFIX}"))


def block_files(d: DaemonProcess) -> list[Path]:
    return sorted(p for p in blocks_root(d).rglob(f"*{SUFFIX}") if ".quarantine" not in p.parts)


def records(path: Path) -> dict[bytes, tuple[int, int]]:
    """Digest -> (record offset, payload length) of every live record of a pack file."""
    raw = path.read_bytes()
    _, _, entries = packs.decode_head(raw, len(raw))
    out = {}
    for offset, length in entries:
        head = raw[offset : offset + HEADER_SIZE]
        if head != bytes(HEADER_SIZE):
            out[decode_header(head).key.digest] = (offset, length)
    return out


def test_packed_blocks_of_several_sizes_round_trip_beside_block_files(tmp_path: Path) -> None:
    sizes = [1, 100, 4096, 4097, 65536, 65537, 300_000]  # the last two: above the limit, own files
    items = [(key_digest("mix", i), os.urandom(n)) for i, n in enumerate(sizes)]
    d = posix_daemon(tmp_path, *PACKS)
    with d.start(), UcmClient(d.target) as c:
        dump(c, items)
        assert c.get_blocks(NS, [k for k, _ in items]) == [v for _, v in items]
        assert all(c.lookup(NS, [k for k, _ in items]).present)
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert tier.extra["packed_writes"] == 5 and tier.extra["pack_files"] == 1
        (pack,) = pack_files(d)
        assert set(records(pack)) == {k for k, _ in items[:5]}
        assert len(block_files(d)) == 2
        d.kill()  # no snapshot: the next start reads the pack's headers
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        assert c.get_blocks(NS, [k for k, _ in items]) == [v for _, v in items]
        alive(d, c)
        d.stop()
    # Negative control: packs off (the default) writes one file per block, as always.
    off = posix_daemon(tmp_path, name="off")
    with off.start(), UcmClient(off.target) as c:
        dump(c, items)
        assert c.get_blocks(NS, [k for k, _ in items]) == [v for _, v in items]
        assert not pack_files(off) and len(block_files(off)) == len(items)
        off.stop()


def test_deleted_packed_blocks_stay_gone_and_an_emptied_pack_is_removed(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, *PACKS)
    with d.start(), UcmClient(d.target) as c:
        put_packed(c, 0, 40)  # one batch: one pack of 40 blocks
        (pack,) = pack_files(d)
        assert c.delete(NS, index_keys(10)) == 10
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert tier.extra["pack_dead_bytes"] == 10 * SIZE and tier.bytes == 40 * SIZE  # held until unlinked
        assert len(records(pack)) == 30  # their headers zeroed on disk
        d.kill()  # restart by rescan: the deleted ones do not come back
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, range(10, 40), absent=range(10))
        d.stop()  # clean: from the snapshot
    with d.start(), UcmClient(d.target) as c:
        check_all(c, range(10, 40), absent=range(10))
        assert c.delete(NS, index_keys(30, 10)) == 30
        assert not pack_files(d)  # its last live block went: the file went
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert tier.bytes == 0 and tier.extra["pack_dead_bytes"] == 0
        alive(d, c)
        d.stop()


def test_a_corrupt_block_in_a_pack_is_never_served_and_its_neighbours_are(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, *PACKS)
    with d.start(), UcmClient(d.target) as c:
        put_packed(c, 0, 8)
        d.stop()
    (pack,) = pack_files(d)
    bad = index_keys(1, 3)[0]
    offset, _ = records(pack)[bad]
    raw = bytearray(pack.read_bytes())
    raw[offset + HEADER_SIZE + 100] ^= 0xFF  # one payload byte of block 3
    pack.write_bytes(bytes(raw))
    with d.start(), UcmClient(d.target) as c:
        got = c.get_blocks(NS, index_keys(8))
        assert got[3] is None
        assert [g for i, g in enumerate(got) if i != 3] == [payload(i) for i in range(8) if i != 3]
        assert c.lookup(NS, [bad]).present == [False]  # dropped from the index
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert tier.corrupt == 1
        d.kill()
    with d.start(), UcmClient(d.target) as c:  # rescan: the bad record is a tombstone now
        index_done(c)
        check_all(c, [i for i in range(8) if i != 3], absent=range(3, 4))  # type: ignore[arg-type]
        d.stop()


def _forge(path: Path, blocks: list[tuple[bytes, bytes]], edit: object = None) -> None:
    """Write a pack of ``blocks`` (digest, data) at ``path``; ``edit(entries)`` may change the table
    (its CRC recomputed: a forgery, not a torn write)."""
    pack_id = int(path.name.removesuffix(packs.PACK_SUFFIX), 16)
    segments, _ = packs.pack_parts(pack_id, [(BlockKey(NS, k), [memoryview(v)]) for k, v in blocks])
    raw = bytearray(b"".join(bytes(s) for s in segments))
    if edit is not None:
        _, created, entries = packs.decode_head(bytes(raw), len(raw))
        edit(entries)  # type: ignore[operator]
        head = packs.encode_head(pack_id, created, entries)
        raw[: len(head)] = head
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(raw))


def test_truncated_and_forged_packs_adopt_only_their_valid_records(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, *PACKS)
    root = blocks_root(d)

    def place(pack_id: int) -> Path:
        parts, name = packs.pack_place(pack_id)
        return root.joinpath(*parts, name)

    def blocks(first: int) -> list[tuple[bytes, bytes]]:
        return [(k, payload(first + j)) for j, k in enumerate(index_keys(4, first))]

    record = HEADER_SIZE + SIZE
    truncated = place(0x1111)  # blocks 0-3, cut inside block 2's record
    _forge(truncated, blocks(0))
    with truncated.open("r+b") as f:
        f.truncate(packs.head_len(4) + 2 * record + 50)

    def out_of_bounds(entries: list[tuple[int, int]]) -> None:
        entries[1] = (entries[1][0] + 10 * record, entries[1][1])  # block 5 points past the end

    _forge(place(0x2222), blocks(4), out_of_bounds)

    def overlapping(entries: list[tuple[int, int]]) -> None:
        entries[3] = (entries[2][0] + 8, entries[3][1])  # block 11 inside block 10's record

    _forge(place(0x3333), blocks(8), overlapping)
    twice = blocks(12)
    twice[3] = twice[0]  # block 12 twice: neither copy trusted; 13 and 14 are
    _forge(place(0x4444), twice)
    # A record smuggled inside another block's payload (a valid header and checksum of its own),
    # named by the table: the records overlap, so it is refused; the carrier is a real block.
    hidden = os.urandom(SIZE - HEADER_SIZE)
    smuggled = key_digest("smuggled", 0)
    inner = (
        encode_header(BlockKey(NS, smuggled), len(hidden), payload_checksum([memoryview(hidden)])) + hidden
    )
    carrier = [(index_keys(1, 24)[0], inner), (index_keys(1, 25)[0], payload(25)), (key_digest("x", 0), b"x")]

    def smuggle(entries: list[tuple[int, int]]) -> None:
        entries[2] = (entries[0][0] + HEADER_SIZE, len(hidden))

    _forge(place(0x8888), carrier, smuggle)
    bad_head = place(0x5555)  # a damaged pack header: the pack is quarantined whole
    _forge(bad_head, blocks(16))
    raw = bytearray(bad_head.read_bytes())
    raw[20] ^= 1
    bad_head.write_bytes(bytes(raw))
    misplaced = place(0x6666)  # a whole pack under another pack's name: not adopted
    _forge(misplaced, blocks(20))
    misplaced.rename(place(0x7777))
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, [0, 1, 4, 6, 7, 8, 9, 10, 13, 14], absent=range(0))  # type: ignore[arg-type]
        gone = [2, 3, 5, 11, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23]
        keys = [index_keys(1, i)[0] for i in gone]
        assert not any(c.lookup(NS, keys).present)
        assert c.get_blocks(NS, keys) == [None] * len(keys)
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert (
            tier.extra["pack_refused"] == 2 + 1 + 1 + 2 + 1
        )  # truncated, out of bounds, overlap, twice, smuggled
        assert tier.corrupt == 2  # the damaged pack header and the misplaced pack, quarantined
        assert len(list((root / ".quarantine").iterdir())) == 2
        assert c.get_blocks(NS, index_keys(2, 24)) == [inner, payload(25)]
        assert c.lookup(NS, [smuggled]).present == [False]
        alive(d, c)
        d.stop()


def test_old_block_files_beside_packs_load_and_a_rewrite_moves_a_block_into_a_pack(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, *PACKS)
    plant(d, 0, 20)  # block files as a release without packs wrote them
    with d.start(), UcmClient(d.target) as c:
        put_packed(c, 20, 20)  # packed
        check_all(c, range(40))
        put_packed(c, 0, 5)  # rewritten: now in a pack, their old files removed
        assert len(block_files(d)) == 15
        d.kill()
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, range(40))
        d.stop()


def test_a_clean_restart_restores_packed_blocks_from_the_snapshot_and_a_stale_one_is_not_trusted(
    tmp_path: Path,
) -> None:
    d = posix_daemon(tmp_path, *PACKS)
    root = blocks_root(d)
    plant(d, 100, 10)  # block files in the same snapshot
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        put_packed(c, 0, 100)
        d.stop()
    snap = (root / index_snapshot.SNAPSHOT_NAME).read_bytes()
    assert struct.unpack_from("<I", snap, 8)[0] == index_snapshot.PACKED_VERSION
    saved = {n: (root / n).read_bytes() for n in (index_snapshot.SNAPSHOT_NAME, index_snapshot.MARKER_NAME)}
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        assert "110 blocks indexed from snapshots" in d.log()
        check_all(c, range(110))
        assert c.delete(NS, index_keys(20)) == 20
        d.stop()
    # The older snapshot put back with its own marker: it lists the 20 deleted blocks in their
    # pack; none of them is served, and the sweep drops them from the index.
    for name, data in saved.items():
        (root / name).write_bytes(data)
    with d.start(), UcmClient(d.target) as c:
        assert c.get_blocks(NS, index_keys(20)) == [None] * 20
        index_done(c)
        check_all(c, range(20, 110), absent=range(20))
        d.stop()
    # A snapshot whose checksum fails (edited) is never trusted: the headers are read instead.
    snap = bytearray((root / index_snapshot.SNAPSHOT_NAME).read_bytes())
    snap[-40] ^= 1
    (root / index_snapshot.SNAPSHOT_NAME).write_bytes(bytes(snap))
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        assert "checksum mismatch (torn or edited)" in d.log()
        check_all(c, range(20, 110), absent=range(20))
        d.stop()


def test_an_older_snapshot_version_still_loads(tmp_path: Path) -> None:
    """A version-1 snapshot (no pack columns, as the previous release wrote) is read as before."""
    blocks = index_snapshot.Columns([bytes(NS) + b"k" * 32], [4096], [1.0])
    index_snapshot.write_snapshot(tmp_path, blocks, durable=False)
    epoch = (tmp_path / index_snapshot.MARKER_NAME).read_bytes()
    assert struct.unpack_from("<I", (tmp_path / index_snapshot.SNAPSHOT_NAME).read_bytes(), 8)[0] == 1
    got = index_snapshot.read_snapshot(tmp_path, epoch, 1 << 20)
    assert list(got.sizes) == [4096] and got.packs is None
    # and a version-2 one carries the pack columns through
    packed = index_snapshot.Columns([bytes(NS) + b"k" * 32], [4096], [1.0], [7], [116])
    index_snapshot.write_snapshot(tmp_path, packed, durable=False)
    epoch = (tmp_path / index_snapshot.MARKER_NAME).read_bytes()
    got = index_snapshot.read_snapshot(tmp_path, epoch, 1 << 20)
    assert list(got.packs or []) == [7] and list(got.offsets or []) == [116]


def test_a_symlinked_pack_directory_is_never_followed(tmp_path: Path) -> None:
    """``<root>/pack`` replaced by a symlink: the packed dump fails per block naming it, nothing is
    written outside the data directory; with packs off the same dump stores block files (control)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    d = posix_daemon(tmp_path, *PACKS)
    items = [(k, payload(j)) for j, k in enumerate(index_keys(8))]
    with d.start(), UcmClient(d.target) as c, SharedBuffer(8 * SIZE) as buf:
        (blocks_root(d) / packs.PACK_DIR).symlink_to(outside, target_is_directory=True)
        region = c.register(buf)
        for j, (_, v) in enumerate(items):
            buf.buf[j * SIZE : (j + 1) * SIZE] = v
        blocks = [BlockIO(k, (Segment(region, j * SIZE, SIZE),)) for j, (k, _) in enumerate(items)]
        r = c.wait(c.dump(NS, blocks, wait_durable=True), 30)
        assert r.states == [BlockState.FAILED] * 8, r.states
        assert all("symlink" in reason for reason in r.reasons.values()), r.reasons
        assert not any(c.lookup(NS, index_keys(8)).present)
        assert list(outside.rglob("*")) == []
        d.stop()
    d.extra_args = [a for a in d.extra_args if a not in PACKS]  # packs off: block files, as before
    with d.start(), UcmClient(d.target) as c:
        dump(c, items)
        check_all(c, range(8))
        d.stop()
    assert list(outside.rglob("*")) == []


@pytest.mark.skipif(group_commit.SYNCFS is None, reason="group commit needs syncfs (Linux >= 5.8)")
def test_a_durable_packed_batch_costs_two_syncs_per_root(tmp_path: Path) -> None:
    """300 blocks of 4 KiB, durable, into two roots: a few pack files, committed as a group (two
    ``syncfs`` per root for the whole batch, not a sync per pack or per block)."""
    roots = [tmp_path / "a", tmp_path / "b"]
    datas = [os.urandom(SIZE) for _ in range(300)]
    keys = [BlockKey(NS, k) for k in index_keys(300)]

    async def main() -> tuple[dict[str, float], list[bytes]]:
        t = PosixTier(roots=roots, pack_max_block_bytes=65536)
        await t.open()
        results = await t.write_many([(k, [memoryview(v)]) for k, v in zip(keys, datas, strict=True)])
        assert all(r.ok for r in results), results
        extra = dict(t.stats().extra)
        outs = [bytearray(SIZE) for _ in datas]
        got = await t.read_many([(k, [memoryview(o)]) for k, o in zip(keys, outs, strict=True)])
        assert all(r.ok for r in got), got
        await t.close()
        return extra, [bytes(o) for o in outs]

    extra, outs = asyncio.run(main())
    assert extra["group_syncs"] == 4 and extra["packed_writes"] == 300
    assert 2 <= extra["pack_files"] <= 12  # jobs of up to 64 blocks, one pack per root in each
    assert outs == datas
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]
    assert not list(tmp_path.rglob(f"*{SUFFIX}"))


def test_eviction_empties_whole_packs_and_frees_their_files(tmp_path: Path) -> None:
    """A capacity of 20 blocks and three packed batches of 10: the oldest batch is evicted, its pack
    file goes with its last block, and what stays loads byte-exact; dead bytes count until then."""
    keys = [BlockKey(NS, k) for k in index_keys(30)]
    datas = [payload(i) for i in range(30)]

    async def main() -> None:
        t = PosixTier(roots=[tmp_path], durable=False, capacity=20 * SIZE, pack_max_block_bytes=SIZE)
        await t.open()
        for first in (0, 10, 20):
            batch = [(keys[i], [memoryview(datas[i])]) for i in range(first, first + 10)]
            assert all(r.ok for r in await t.write_many(batch))
        stats = t.stats()
        assert stats.blocks == 20 and stats.evictions == 10 and stats.extra["pack_files"] == 2
        assert stats.bytes <= 20 * SIZE and stats.extra["pack_dead_bytes"] == 0
        assert len(await asyncio.to_thread(lambda: list(tmp_path.rglob(f"*{packs.PACK_SUFFIX}")))) == 2
        assert await t.lookup(keys[:10]) == [None] * 10
        outs = [bytearray(SIZE) for _ in range(20)]
        got = await t.read_many([(keys[10 + j], [memoryview(o)]) for j, o in enumerate(outs)])
        assert all(r.ok for r in got) and [bytes(o) for o in outs] == datas[10:]
        await t.delete(keys[10:15])  # half a pack: its bytes still count, as dead ones
        stats = t.stats()
        assert stats.extra["pack_dead_bytes"] == 5 * SIZE and stats.bytes == 15 * SIZE + 5 * SIZE
        await t.close()

    asyncio.run(main())
