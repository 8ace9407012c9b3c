"""The per-block fast paths of a Dump/Load's request handling build exactly what the plain code did.

``make_keys`` builds ``BlockKey`` objects through C-level maps (packed digests in one call of the
compiled helper), ``iov_len`` and ``host_iovecs``
skip their generic walk for one-segment blocks, ``single_segment_iovecs`` checks a one-region,
one-segment-per-block batch as array operations, ``vector_io`` moves a whole iovec in one call
without per-segment Python, and a pack finds many members' offsets through one position map
(per-block Python on the critical path). Each is compared with the plain
construction, on inputs that take the fast path and on those that do not.
"""

from __future__ import annotations

import os

import pytest
from support.dataplane import needs_native

from ucm_protocol.errors import InvalidArgument
from ucm_protocol.keys import BlockKey, PackedDigests, make_keys
from ucm_protocol.native import native
from ucm_server.regions import (
    SegmentColumns,
    check_disjoint,
    check_segments,
    host_iovecs,
    single_segment_batch,
    single_segment_iovecs,
)
from ucm_server.store.copying import iov_len
from ucm_server.store.format import CorruptBlock
from ucm_server.store.posix.packs import Pack
from ucm_server.store.vector_io import IOV_MAX, preadv_all, pwritev_all, vector_io


def test_make_keys_builds_the_same_block_keys_as_the_constructor() -> None:
    ns = os.urandom(16)
    digests = [os.urandom(32), bytes(32), bytearray(b"\x07" * 32), os.urandom(31) + b"\x00"]
    keys = make_keys(ns, digests)
    expected = [BlockKey(ns, bytes(d)) for d in digests]
    assert keys == expected
    assert all(type(k) is BlockKey for k in keys)
    assert [k.namespace for k in keys] == [ns] * len(digests)
    assert [k.digest for k in keys] == [bytes(d) for d in digests]
    assert {k: i for i, k in enumerate(keys)}[ns + bytes(digests[1])] == 1  # plain bytes find them


@needs_native
def test_make_keys_of_packed_digests_builds_the_same_block_keys_in_one_call() -> None:
    """A request's packed keys (the ring's, the RPC's ``packed_keys``) become keys in the compiled
    helper, one object each, equal to the constructor's, hashed as plain bytes, and usable as
    dict keys from the start (the hash is computed on first use, never taken as 0)."""
    ns = os.urandom(16)
    digests = [os.urandom(32), bytes(32), b"\x07" * 32, os.urandom(31) + b"\x00"]
    keys = make_keys(ns, PackedDigests(b"".join(digests)))
    assert keys == [BlockKey(ns, d) for d in digests] and all(type(k) is BlockKey for k in keys)
    assert [hash(k) for k in keys] == [hash(ns + d) for d in digests]
    assert {k: i for i, k in enumerate(keys)}[ns + digests[3]] == 3
    assert [k.digest for k in keys] == digests and keys[0].namespace == ns
    assert make_keys(ns, PackedDigests(b"")) == []
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes, got 15"):
        make_keys(ns[:15], PackedDigests(b"".join(digests)))


def test_make_keys_of_packed_digests_without_the_compiled_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compiled builder does not serve (no helper, or a Python whose ``bytes`` layout it
    does not know: 3.14 on), packed digests take the Python path to the same keys."""
    import ucm_protocol.keys as keys_module

    monkeypatch.setattr(keys_module, "_KEYS_IN_C", False)
    ns = os.urandom(16)
    digests = [os.urandom(32), bytes(32)]
    keys = make_keys(ns, PackedDigests(b"".join(digests)))
    assert keys == [BlockKey(ns, d) for d in digests] and all(type(k) is BlockKey for k in keys)
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes, got 15"):
        make_keys(ns[:15], PackedDigests(b"".join(digests)))


@needs_native
def test_the_compiled_key_builder_refuses_what_it_cannot_build() -> None:
    class WithDict(bytes):
        pass

    with pytest.raises(TypeError, match="bytes subclass with no instance dict"):
        native.block_keys(WithDict, bytes(16), bytes(32))
    with pytest.raises(TypeError, match="bytes subclass"):
        native.block_keys(int, bytes(16), bytes(32))
    with pytest.raises(ValueError, match="16-byte namespace and whole 32-byte digests, not 16 and 33"):
        native.block_keys(BlockKey, bytes(16), bytes(33))
    with pytest.raises(ValueError, match="not 17 and 32"):
        native.block_keys(BlockKey, bytes(17), bytes(32))


def test_make_keys_still_names_a_bad_digest_and_namespace() -> None:
    with pytest.raises(InvalidArgument, match=r"keys\[2\] must be 32 bytes, got 33"):
        make_keys(os.urandom(16), [os.urandom(32), os.urandom(32), os.urandom(33)])
    with pytest.raises(InvalidArgument, match="namespace must be 16 bytes"):
        make_keys(os.urandom(15), [os.urandom(32)])


class _Region:
    def __init__(self, size: int) -> None:
        self.view = memoryview(bytearray(os.urandom(size)))
        self.size = size


def test_host_iovecs_and_iov_len_one_and_several_segments() -> None:
    a, b = _Region(1 << 16), _Region(1 << 16)
    blocks = [
        [(a, 0, 4096)],  # one segment: the fast path
        [(a, 4096, 100), (b, 10, 5), (a, 9000, 1)],  # several: the generic walk
        [(b, 65535, 1)],
    ]
    iovs = host_iovecs(blocks)
    assert [[bytes(v) for v in iov] for iov in iovs] == [
        [bytes(r.view[o : o + n]) for r, o, n in segs] for segs in blocks
    ]
    assert [iov_len(iov) for iov in iovs] == [4096, 106, 1]
    iovs[0][0][:4] = b"abcd"  # views into the region, not copies
    assert bytes(a.view[:4]) == b"abcd"
    assert iov_len([]) == 0


def _plain_plan(columns: SegmentColumns, found: dict[int, _Region], limit: int) -> list[list[bytes]]:
    counts = columns.block_counts(len(columns.counts or columns.offsets))
    blocks = check_segments(columns, counts, found, limit)
    return [[bytes(v) for v in iov] for iov in host_iovecs(blocks)]


def test_single_segment_iovecs_match_the_per_segment_checks() -> None:
    region = _Region(1 << 16)
    found = {7: region}
    for counts in ([], [1, 1, 1, 1]):  # no counts (one segment a block) or all ones
        columns = SegmentColumns(counts, [7] * 4, [0, 4096, 65536 - 10, 100], [4096, 1000, 10, 1])
        fast = single_segment_iovecs(columns, found, 1 << 20)
        assert fast is not None
        assert [[bytes(v) for v in iov] for iov in fast] == _plain_plan(columns, found, 1 << 20)
        fast[0][0][:3] = b"xyz"  # views into the region, not copies
        assert bytes(region.view[:3]) == b"xyz"


@pytest.mark.parametrize(
    ("offsets", "lengths", "ascending", "overlap"),
    [
        ([0, 4096, 8192], [4096, 4096, 4096], True, False),  # back to back: the usual Load
        ([0, 5000, 9000], [4096, 4000, 10], True, False),  # gaps between
        ([0, 4095], [4096, 4096], False, True),  # one byte shared
        ([0, 0], [4096, 4096], False, True),  # the same bytes twice
        ([8192, 0], [4096, 4096], False, False),  # disjoint, but out of order: the sorting check decides
    ],
)
def test_a_batch_in_ascending_disjoint_order_is_known_disjoint_and_no_other(
    offsets: list[int], lengths: list[int], ascending: bool, overlap: bool
) -> None:
    """The flag that lets a Load skip :func:`check_disjoint` is set only where no two spans can
    share a byte; every other batch is still sorted and checked (an overlap is then refused)."""
    columns = SegmentColumns([], [7] * len(offsets), offsets, lengths)
    batch = single_segment_batch(columns, {7: _Region(1 << 16)}, 1 << 20)
    assert batch is not None and batch.ascending is ascending
    if overlap:
        with pytest.raises(InvalidArgument, match="overlap"):
            check_disjoint(columns, [1] * len(offsets))
    else:
        check_disjoint(columns, [1] * len(offsets))


@pytest.mark.parametrize(
    ("counts", "region_ids", "offsets", "lengths", "limit", "error"),
    [
        ([], [7, 7], [0, 4096], [4096, 0], 1 << 20, r"block 1: segment of length 0"),
        ([], [7, 7], [0, 65000], [4096, 1000], 1 << 20, r"block 1: segment \[65000, 66000\) is outside"),
        ([], [7], [(1 << 64) - 1], [2], 1 << 20, r"block 0: segment .* is outside region 7"),
        ([], [7], [65535], [(1 << 64) - 65535], 1 << 20, r"block 0: segment .* is outside region 7"),
        ([], [7, 7], [0, 8192], [4096, 8192], 4096, r"block 1 is 8192 bytes, more than max_block_bytes 4096"),
        ([2], [7, 7], [0, 0], [1, 70000], 1 << 20, r"block 0: segment \[0, 70000\) is outside region 7"),
        ([], [7, 8], [0, 65536], [4096, 1], 1 << 20, r"block 1: segment \[65536, 65537\) is outside reg"),
    ],
)
def test_a_batch_the_array_checks_refuse_gets_the_per_segment_error(
    counts: list[int], region_ids: list[int], offsets: list[int], lengths: list[int], limit: int, error: str
) -> None:
    """Every bad batch makes the fast path decline (None, nothing half-built), and the per-segment
    checks the engine then runs name the block: the wrap-around of ``offset + length`` past 2**64 in
    unsigned arithmetic must not let a segment through."""
    found = {7: _Region(1 << 16), 8: _Region(1 << 16)}
    found = {rid: found[rid] for rid in region_ids}
    columns = SegmentColumns(counts, region_ids, offsets, lengths)
    assert single_segment_iovecs(columns, found, limit) is None
    with pytest.raises(InvalidArgument, match=error):
        check_segments(columns, columns.block_counts(len(counts or offsets)), found, limit)


def _short_transfer_stand_in(real, most: int):  # type: ignore[no-untyped-def]
    """A ``preadv``/``pwritev`` that moves at most ``most`` bytes a call: the short transfers a
    signal or a full pipe cause, which a regular file on this machine never shows on demand."""

    def call(fd: int, views: list[memoryview], offset: int) -> int:
        budget, take = most, []
        for v in views:
            flat = v.cast("B") if v.format != "B" or v.ndim != 1 else v
            if budget <= 0:
                break
            take.append(flat[:budget])
            budget -= min(budget, flat.nbytes)
        return int(real(fd, take, offset))

    return call


@pytest.mark.parametrize("most", [None, 1, 777, 4096 * 3 + 5])
@pytest.mark.parametrize("nsegs", [1, 5, IOV_MAX + 3])
def test_vector_io_moves_every_byte_with_whole_and_short_transfers(tmp_path, most, nsegs) -> None:  # type: ignore[no-untyped-def]
    sizes = [(i * 37) % (5000 if nsegs < IOV_MAX else 50) for i in range(nsegs)]  # zero-length ones too
    data = os.urandom(sum(sizes))
    src, pos = [], 0
    for n in sizes:
        src.append(memoryview(data)[pos : pos + n])
        pos += n
    if nsegs > 1:
        src[1] = memoryview(bytearray(src[1])).cast("B").cast("c")  # a view of another format
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write = os.pwritev if most is None else _short_transfer_stand_in(os.pwritev, most)
        vector_io(write, fd, src, 100, short="")
        assert path.read_bytes()[100:] == data
        dest = [memoryview(bytearray(n)) for n in sizes]
        read = os.preadv if most is None else _short_transfer_stand_in(os.preadv, most)
        vector_io(read, fd, dest, 100, short="ended")
        assert b"".join(bytes(v) for v in dest) == data
        too_long = [memoryview(bytearray(len(data) + 1))]
        with pytest.raises(CorruptBlock, match="ended"):
            vector_io(read, fd, too_long, 100, short="ended")
    finally:
        os.close(fd)


def test_preadv_all_and_pwritev_all_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fd = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        payload = os.urandom(10000)
        pwritev_all(fd, [memoryview(payload)[:1], memoryview(payload)[1:]], 0)
        back = [memoryview(bytearray(4000)), memoryview(bytearray(6000))]
        preadv_all(fd, back, 0)
        assert bytes(back[0]) + bytes(back[1]) == payload
        pwritev_all(fd, [], 0)  # nothing to move: no call, no error
        with pytest.raises(CorruptBlock, match="file ended before the payload did"):
            preadv_all(fd, [memoryview(bytearray(10))], 9995)
    finally:
        os.close(fd)


def test_pack_offsets_of_finds_what_offset_of_finds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pack = Pack(1, tmp_path)
    keys = [os.urandom(48) for _ in range(40)]
    for n, k in enumerate(keys):
        pack.add(k, 1000 + n * 10)
    pack.add(keys[3], 99999)  # listed twice (a snapshot's leftover): the first place wins
    pack.kill(keys[5])
    asked = [bytes(k) for k in keys] + [os.urandom(48), bytes(keys[3])]
    expected = [pack.offset_of(k) for k in asked]
    assert pack.offsets_of(asked) == expected
    assert expected[5] is None and expected[-2] is None and expected[3] == expected[-1] == 1030
    assert pack.offsets_of(asked[:2]) == expected[:2]  # a few keys: searched one by one
