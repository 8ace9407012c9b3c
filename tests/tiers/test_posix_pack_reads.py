"""Reading packed blocks: every shape of load the batched pack reader meets, checked byte for byte.

The Posix tier reads a job of packed blocks pack by pack with the compiled helper
(:func:`ucm_server.store.posix.packs.read_records`), or where it cannot, in Python, checking all
their headers at once (:class:`ucm_server.store.posix.packs.RecordReads`,
:func:`ucm_server.store.format.check_headers`). The load tests run with each reader, and the two are
compared on every kind of damage. In process, on real files: whole packs in and out of order,
scattered subsets (runs with gaps, gaps too long to read across), a key asked for twice,
destinations of several segments, and the failures beside good neighbours: a flipped payload byte,
a header naming another block, a tombstone, a pack removed under the tier, a pack that ends early,
a descriptor that cannot be read. Each failure is confined to its block (or its run, for the last
two), which is never served; the others load byte-exact.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
from support.blocks import NS

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import MISSING, IoVec
from ucm_server.store.format import HEADER_SIZE, check_headers, encode_header, fast_checksum
from ucm_server.store.posix import PosixTier, files, packs
from ucm_server.store.posix.packs import Outcome, PackedStamp

SIZE = 4096
COMPILED_MISSING = "the compiled helper is not built, or was built without XXH3: no compiled reader"


@pytest.fixture(params=["compiled", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with the compiled record reader and once with the Python one."""
    if request.param == "compiled" and packs._READ_RECORDS is None:
        pytest.skip(COMPILED_MISSING)
    if request.param == "python":
        monkeypatch.setattr(packs, "_READ_RECORDS", None)
    return str(request.param)


def _keys(n: int, tag: bytes = b"") -> list[BlockKey]:
    return sorted(BlockKey(NS, zlib.crc32(tag + b"%d" % i).to_bytes(4, "little") * 8) for i in range(n))


def _data(n: int, size: int = SIZE) -> list[bytes]:
    rng = np.random.default_rng(n + size)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


async def _stored(root: Path, keys: list[BlockKey], datas: list[bytes]) -> PosixTier:
    """A tier over ``root`` holding ``keys`` in packs of 64 (dumped in batches of 256)."""
    tier = PosixTier(roots=[root], durable=False, pack_max_block_bytes=65536)
    await tier.open()
    for start in range(0, len(keys), 256):
        batch = [
            (k, [memoryview(v)])
            for k, v in zip(keys[start : start + 256], datas[start : start + 256], strict=True)
        ]
        assert all(r.ok for r in await tier.write_many(batch))
    assert all(isinstance(tier._index.get(k), PackedStamp) for k in keys)
    return tier


def _dests(n: int, size: int = SIZE, segments: int = 1) -> tuple[list[bytearray], list[IoVec]]:
    """``n`` destination buffers filled with 0xEE (a byte that shows where nothing was written),
    each as ``segments`` views."""
    outs = [bytearray(b"\xee" * size) for _ in range(n)]
    cut = size // segments
    views: list[IoVec] = [
        [memoryview(o)[j * cut : (j + 1) * cut if j < segments - 1 else size] for j in range(segments)]
        for o in outs
    ]
    return outs, views


def _pack_of(tier: PosixTier, key: BlockKey) -> Path:
    stamp = tier._index.get(key)
    assert isinstance(stamp, PackedStamp)
    parts, name = stamp.pack.place
    return stamp.pack.root.joinpath(*parts, name)


@pytest.mark.usefixtures("reader")
@pytest.mark.parametrize("segments", [1, 3])
def test_loads_in_any_order_and_any_subset_are_byte_exact(tmp_path: Path, segments: int) -> None:
    keys, datas = _keys(512), _data(512)
    rng = random.Random(7)
    picks = [
        list(range(512)),  # whole packs, in file order
        rng.sample(range(512), 512),  # whole packs, shuffled
        list(range(0, 512, 3)),  # every third record: runs with small gaps
        list(range(0, 512, 70)),  # one record a pack or less: a run each
        [5, 5, 9, 5, 300, 9],  # a key asked for more than once
    ]

    async def main() -> None:
        tier = await _stored(tmp_path, keys, datas)
        for pick in picks:
            for checked in (False, True):
                outs, views = _dests(len(pick), segments=segments)
                items = [(keys[i], views[n]) for n, i in enumerate(pick)]
                got = await (tier.read_checked_many(items) if checked else tier.read_many(items))
                assert all(r is not None and r.ok for r in got), got
                assert [bytes(o) for o in outs] == [datas[i] for i in pick]
        await tier.close()

    asyncio.run(main())


@pytest.mark.usefixtures("reader")
def test_records_too_far_apart_are_read_in_runs_of_their_own(tmp_path: Path) -> None:
    """Blocks of 200 KiB: two records of one pack with three between them are more than
    ``GAP_MAX`` apart, so the reader ends its run and starts another."""
    size = 200 << 10
    keys, datas = _keys(8, b"far"), _data(8, size)
    assert 3 * (size + HEADER_SIZE) > packs.GAP_MAX

    async def main() -> None:
        tier = PosixTier(roots=[tmp_path], durable=False, pack_max_block_bytes=size)
        await tier.open()
        assert all(
            r.ok
            for r in await tier.write_many([(k, [memoryview(v)]) for k, v in zip(keys, datas, strict=True)])
        )
        assert len({_pack_of(tier, k) for k in keys}) == 1
        pick = [0, 4, 1, 7]
        outs, views = _dests(len(pick), size)
        got = await tier.read_many([(keys[i], views[n]) for n, i in enumerate(pick)])
        assert all(r.ok for r in got) and [bytes(o) for o in outs] == [datas[i] for i in pick]
        await tier.close()

    asyncio.run(main())


@pytest.mark.usefixtures("reader")
def test_a_bad_record_fails_alone_and_is_never_served(tmp_path: Path) -> None:
    """In one pack read side by side: block 3's payload flipped, block 5's header swapped for one
    naming block 6, block 7 tombstoned (deleted on disk, still in this index). Each fails (zeroed
    destination, never the stored bytes); the other 60 of the pack load byte-exact."""
    keys, datas = _keys(64, b"bad"), _data(64, SIZE)

    async def main() -> None:
        tier = await _stored(tmp_path, keys, datas)
        path = _pack_of(tier, keys[0])
        assert {_pack_of(tier, k) for k in keys} == {path}
        stamp = tier._index.get(keys[0])
        assert isinstance(stamp, PackedStamp)
        offsets = dict(zip(stamp.pack.keys, stamp.pack.offsets, strict=True))
        raw = bytearray(path.read_bytes())
        raw[offsets[keys[3]] + HEADER_SIZE + 17] ^= 0x01
        raw[offsets[keys[5]] : offsets[keys[5]] + HEADER_SIZE] = raw[
            offsets[keys[6]] : offsets[keys[6]] + HEADER_SIZE
        ]
        raw[offsets[keys[7]] : offsets[keys[7]] + HEADER_SIZE] = bytes(HEADER_SIZE)
        path.write_bytes(bytes(raw))

        outs, views = _dests(64)
        got = await tier.read_many(list(zip(keys, views, strict=True)))
        bad = {3, 5, 7}
        assert [n for n, r in enumerate(got) if not r.ok] == sorted(bad)
        assert got[7] == MISSING and "corrupt" in got[3].reason and "corrupt" in got[5].reason
        for n, out in enumerate(outs):
            assert bytes(out) == (bytes(SIZE) if n in bad else datas[n])
        assert await tier.lookup([keys[n] for n in sorted(bad)]) == [None] * 3  # dropped from the index
        assert await tier.lookup(keys[:3]) == [SIZE] * 3
        await tier.close()

    asyncio.run(main())


@pytest.mark.usefixtures("reader")
def test_a_checked_read_reports_a_payload_mismatch_for_a_second_read(tmp_path: Path) -> None:
    """Straight into client memory (``read_checked_many``): a payload that does not match is
    reported as None (the caller reads it again through daemon memory, which then fails it)."""
    keys, datas = _keys(64, b"chk"), _data(64)

    async def main() -> None:
        tier = await _stored(tmp_path, keys, datas)
        path = _pack_of(tier, keys[10])
        stamp = tier._index.get(keys[10])
        assert isinstance(stamp, PackedStamp)
        offset = dict(zip(stamp.pack.keys, stamp.pack.offsets, strict=True))[keys[10]]
        raw = bytearray(path.read_bytes())
        raw[offset + HEADER_SIZE] ^= 0x80
        path.write_bytes(bytes(raw))
        outs, views = _dests(64)
        got = await tier.read_checked_many(list(zip(keys, views, strict=True)))
        assert got[10] is None and all(r is not None and r.ok for n, r in enumerate(got) if n != 10)
        assert [bytes(o) for n, o in enumerate(outs) if n != 10] == [
            d for n, d in enumerate(datas) if n != 10
        ]
        again = await tier.read_many([(keys[10], _dests(1)[1][0])])
        assert not again[0].ok and "corrupt" in again[0].reason
        await tier.close()

    asyncio.run(main())


@pytest.mark.usefixtures("reader")
def test_a_pack_removed_under_the_tier_reads_as_missing_and_others_still_load(tmp_path: Path) -> None:
    keys, datas = _keys(256, b"gone"), _data(256)

    async def main() -> None:
        tier = await _stored(tmp_path, keys, datas)
        gone = _pack_of(tier, keys[0])
        lost = [n for n, k in enumerate(keys) if _pack_of(tier, k) == gone]
        assert 0 < len(lost) < 256
        gone.unlink()
        outs, views = _dests(256)
        got = await tier.read_many(list(zip(keys, views, strict=True)))
        assert [n for n, r in enumerate(got) if r == MISSING] == lost
        assert all(got[n].ok and bytes(outs[n]) == datas[n] for n in range(256) if n not in lost)
        await tier.close()

    asyncio.run(main())


def test_check_headers_agrees_with_the_one_header_check() -> None:
    """The array check of many headers says what :func:`fast_checksum` says of each, for valid
    headers and for every single-field damage: any byte changed, another key, another length."""
    rng = random.Random(3)
    keys = [BlockKey(NS, os.urandom(32)) for _ in range(40)]
    lengths = [rng.randrange(1, 1 << 20) for _ in keys]
    heads = bytearray(
        b"".join(encode_header(k, n, rng.getrandbits(64)) for k, n in zip(keys, lengths, strict=True))
    )
    for n in range(1, 40, 3):  # damage every third header in one byte
        heads[n * HEADER_SIZE + rng.randrange(HEADER_SIZE)] ^= 1 << rng.randrange(8)
    want_keys = list(keys)
    want_keys[2] = keys[4]  # asked under another key
    want_lengths = list(lengths)
    want_lengths[5] += 1  # asked with another length
    views = [memoryview(heads)[n * HEADER_SIZE : (n + 1) * HEADER_SIZE] for n in range(40)]
    valid, checksums = check_headers(heads, views, b"".join(want_keys), want_lengths, 1 << 20)
    for n in range(40):
        one = fast_checksum(bytearray(views[n]), want_keys[n], want_lengths[n], 1 << 20)
        assert valid[n] == (one is not None), n
        if one is not None:
            assert checksums[n] == one
    assert valid.count(True) == 40 - len(range(1, 40, 3)) - 2
    assert check_headers(heads[:HEADER_SIZE], views[:1], bytes(keys[0]), [lengths[0]], lengths[0] - 1)[0] == [
        False
    ]


def _describe(outcome: Outcome) -> object:
    return outcome if isinstance(outcome, bool) else (type(outcome).__name__, str(outcome))


def _read_job(tier: PosixTier, keys: list[BlockKey], checked: bool) -> tuple[list[object], list[bytes]]:
    """One executor job of ``keys`` (their outcomes, in order, and what landed in each destination)
    read straight through :func:`files.read_pack_job`, which changes nothing in the tier."""
    outs, views = _dests(len(keys))
    entries = [tier._index.get(k) for k in keys]
    assert all(isinstance(e, PackedStamp) for e in entries)
    job = packs.read_jobs(
        [(k, v, e) for k, v, e in zip(keys, views, entries, strict=True) if isinstance(e, PackedStamp)],
        1 << 20,
    )
    got = files.read_pack_job(tier.disk, job[0], checked)
    assert len(job) == 1 and len(got) == len(job[0])
    outcomes: list[object] = [None] * len(keys)
    for (_, which, *_), read in zip(job[0], got, strict=True):
        for n, outcome in zip(which, read, strict=True):
            outcomes[n] = _describe(outcome)
    return outcomes, [bytes(o) for o in outs]


@pytest.mark.parametrize("checked", [False, True])
def test_the_compiled_and_the_python_reader_agree_on_every_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """One pack of 64 records, damaged one field per record (payload, magic, version, header length,
    key, payload length, checksum, CRC, padding, a tombstone, a header naming another block) and cut
    short in its last record: both readers give each block the same outcome and destination bytes,
    and the damaged ones fail as they must (never the stored bytes)."""
    if packs._READ_RECORDS is None:
        pytest.skip(COMPILED_MISSING)
    keys, datas = _keys(64, b"diff"), _data(64)
    tier = asyncio.run(_stored(tmp_path, keys, datas))
    path = _pack_of(tier, keys[0])
    stamp = tier._index.get(keys[0])
    assert isinstance(stamp, PackedStamp) and {_pack_of(tier, k) for k in keys} == {path}
    at = dict(zip(stamp.pack.keys, stamp.pack.offsets, strict=True))
    raw = bytearray(path.read_bytes())

    def flip(n: int, field: int, value: int = 1) -> None:
        raw[at[keys[n]] + field] ^= value

    flip(1, HEADER_SIZE + 5)  # the payload
    flip(2, 0)  # magic
    raw[at[keys[3]] + 4 : at[keys[3]] + 6] = (9).to_bytes(2, "little")  # a version not readable
    flip(4, 8)  # header length
    flip(5, 12)  # key
    flip(6, 60)  # payload length
    flip(7, 68)  # checksum field (the header's CRC then fails)
    flip(8, 84)  # the CRC itself
    flip(9, 100)  # padding
    raw[at[keys[10]] : at[keys[10]] + HEADER_SIZE] = bytes(HEADER_SIZE)  # a tombstone
    raw[at[keys[11]] : at[keys[11]] + HEADER_SIZE] = raw[at[keys[12]] : at[keys[12]] + HEADER_SIZE]
    last = max(range(64), key=lambda n: at[keys[n]])
    path.write_bytes(bytes(raw[: at[keys[last]] + HEADER_SIZE + SIZE // 2]))  # the last record cut short

    compiled = _read_job(tier, keys, checked)
    monkeypatch.setattr(packs, "_READ_RECORDS", None)
    python = _read_job(tier, keys, checked)
    assert compiled == python
    outcomes, landed = compiled
    bad_header = ("CorruptBlock", packs._BAD_HEADER)
    assert outcomes[1] == (False if checked else ("CorruptBlock", "payload checksum mismatch"))
    assert outcomes[2:10] == [bad_header] * 8 and outcomes[11] == bad_header
    assert outcomes[10] == ("FileNotFoundError", "[Errno 2] deleted from its pack")
    assert outcomes[last][0] == "CorruptBlock" and "outside" in str(outcomes[last][1])
    damaged = {1, *range(2, 12), last}
    assert all(outcomes[n] is True for n in range(64) if n not in damaged)
    for n in range(64):
        if n in damaged - ({1} if checked else set()):
            assert landed[n] == bytes(SIZE), n  # zeroed: never the stored bytes
        elif n not in damaged:
            assert landed[n] == datas[n], n


def test_the_compiled_reader_fails_a_whole_run_on_a_short_file_or_a_read_error(tmp_path: Path) -> None:
    """A pack that ends before a record its size promised (it shrank after its size was taken) fails
    every block of that run as corrupt; a descriptor that cannot be read fails them with its errno;
    each destination is zeroed either way."""
    if packs._READ_RECORDS is None:
        pytest.skip(COMPILED_MISSING)
    keys, datas = _keys(64, b"short"), _data(64)
    tier = asyncio.run(_stored(tmp_path, keys, datas))
    path = _pack_of(tier, keys[0])
    size = path.stat().st_size
    outs, views = _dests(64)
    entries = [tier._index.get(k) for k in keys]
    job = packs.read_jobs(
        [(k, v, e) for k, v, e in zip(keys, views, entries, strict=True) if isinstance(e, PackedStamp)],
        1 << 20,
    )
    (read,) = job[0]
    os.truncate(path, size - SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = packs.read_records(fd, size, read, 1 << 20, checked=False)
    finally:
        os.close(fd)
    assert {_describe(o) for o in got} == {("CorruptBlock", "file ended before the payload did")}
    assert all(bytes(o) == bytes(SIZE) for o in outs)
    outs, views = _dests(64)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = packs.read_records(dir_fd, size, (read[0], read[1], read[2], read[3], views), 1 << 20, False)
    finally:
        os.close(dir_fd)
    assert all(isinstance(o, OSError) and o.errno == errno.EISDIR for o in got)
    assert all(bytes(o) == bytes(SIZE) for o in outs)
