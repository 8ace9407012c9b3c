"""The Posix index with a snapshot's cold base, against a plain model of an LRU list.

A restart installs the snapshot's blocks as a cold base (a plain dict in the snapshot's order) beside
the ordered dict of what changed since; adoption after that puts blocks in front of both. Whatever
the split, the index must answer as one LRU list would: the same keys, sizes and byte total, the
same eviction order (a cold block read since is newer than every cold one), and a snapshot of it
that brings back the same list. Random operations check that against a model; a real daemon then
restarts from such an index, reads, deletes, stores and evicts, restarts again and finds every block.
"""

from __future__ import annotations

import itertools
import os
import random
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from support.blocks import NS
from support.posix_store import blocks_root, index_done, index_keys, payload, posix_daemon, put

from ucm_client import UcmClient
from ucm_protocol.keys import BlockKey, PackedDigests
from ucm_protocol.native import MISSING, native
from ucm_server.store.posix import index_snapshot
from ucm_server.store.posix.block_index import BlockIndex

T0 = 1_700_000_000.0


def _key(n: int) -> bytes:
    return bytes(NS) + n.to_bytes(32, "little")


class Model:
    """What the index must say: one ordered map, least recently used first, key -> (size, second)."""

    def __init__(self) -> None:
        self.od: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def put(self, key: bytes, size: int, at: float) -> None:
        self.od.pop(key, None)
        self.od[key] = (size, int(at))

    def adopt(self, key: bytes, size: int, at: float) -> bool:
        if key in self.od:
            return False
        self.od[key] = (size, int(at))
        self.od.move_to_end(key, last=False)
        return True

    def set(self, key: bytes, size: int, at: float) -> None:
        if key in self.od:
            self.od[key] = (size, int(at))

    def touch(self, key: bytes) -> None:
        if key in self.od:
            self.od.move_to_end(key)


def _same(index: BlockIndex, model: Model, probe: list[bytes]) -> None:
    """Every question the index answers, as the model says."""
    want = [(k, *v) for k, v in model.od.items()]
    assert len(index) == len(model.od)
    assert index.bytes == sum(size for size, _ in model.od.values())
    assert [(bytes(k), s.size, int(s.stored_at)) for k, s in index.oldest()] == want
    assert [(bytes(k), s.size, int(s.stored_at)) for k, s in index.items()] == want
    keys, stamps = index.columns()
    assert [(k, s.size, int(s.stored_at)) for k, s in zip(keys, stamps, strict=True)] == want
    assert sorted(index.columns_by_store()[0]) == sorted(model.od)
    sizes = [model.od[k][0] if k in model.od else None for k in probe]
    assert index.lookup(probe) == sizes
    assert [None if s is None else int(s) for s in index.get_many(probe)] == sizes
    assert [None if (s := index.get(k)) is None else int(s) for k in probe] == sizes
    assert [k in index for k in probe] == [k in model.od for k in probe]
    digests = [k[len(NS) :] for k in probe]
    assert index.lookup_digests(bytes(NS), digests) == sizes
    assert index.lookup_digests(bytes(NS), PackedDigests(b"".join(digests))) == sizes


def _snapshot_of(n: int, rng: random.Random) -> tuple[list[bytes], list[int], list[float]]:
    keys = [_key(i) for i in range(n)]
    return keys, [rng.choice((4096, 8192, 100)) for _ in keys], [T0 + i * 0.4 for i in range(n)]


def _installed(
    keys: list[bytes], sizes: list[int], times: list[float], before: int, rng: random.Random
) -> tuple[BlockIndex, Model]:
    """An index that stored ``before`` blocks (some also in the snapshot, some deleted) while
    adopting, then installed the snapshot; and its model."""
    index, model = BlockIndex(), Model()
    index.start_adopting()
    for n in range(before):  # stored or deleted during start-up: newer than what the snapshot says
        key = _key(rng.randrange(len(keys) + 40))
        if rng.random() < 0.3:
            index.forget(key)
            model.od.pop(key, None)
        else:
            index.add(BlockKey(key[: len(NS)], key[len(NS) :]), 64 + n, T0 + 5000)
            model.put(key, 64 + n, T0 + 5000)
    stamps, _ = index.stamps_for(np.asarray(sizes, dtype="u8"), np.asarray(times))
    loaded = BlockIndex.build(keys, stamps.tolist())
    dropped = set(index.touched or ()) | set(model.od)
    base = OrderedDict(
        (k, (s, int(t))) for k, s, t in zip(keys, sizes, times, strict=True) if k not in dropped
    )
    added = index.install(loaded, sum(sizes), list(keys))
    assert added == len(base)
    base.update(model.od)
    model.od = base
    index.end_adopting()
    return index, model


@pytest.mark.parametrize("seed", range(12))
def test_a_cold_base_answers_as_one_lru_list_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    keys, sizes, times = _snapshot_of(rng.choice((1, 50, 400)), rng)
    index, model = _installed(keys, sizes, times, rng.choice((0, 5, 30)), rng)
    probe = [_key(i) for i in range(len(keys) + 50)]
    _same(index, model, probe)
    for step in range(600):
        key = rng.choice(probe)
        op = rng.randrange(10)
        if op == 0:  # store, or store again (a cold key re-stored is the newest)
            index.add(BlockKey(key[: len(NS)], key[len(NS) :]), 1 + step, T0 + 9000 + step)
            model.put(key, 1 + step, T0 + 9000 + step)
        elif op == 1:
            assert (index.pop(key) is not None) == (model.od.pop(key, None) is not None)
        elif op == 2:
            index.forget(key)
            model.od.pop(key, None)
        elif op == 3:  # a read
            index.move_to_end(key)
            model.touch(key)
        elif op == 4:  # a load's blocks, some gone
            batch = rng.sample(probe, 6)
            index.touch(batch)
            for k in batch:
                model.touch(k)
        elif op == 5:  # found on disk by the sweep: in front of everything, unless known
            assert index.adopt(BlockKey(key[: len(NS)], key[len(NS) :]), 77, T0) == model.adopt(key, 77, T0)
        elif op == 6:
            index.correct(key, 55, T0 + 1)
            model.set(key, 55, T0 + 1)
        elif op == 7:
            index.replace(key, index.stamp(66, T0 + 2))
            model.set(key, 66, T0 + 2)
        elif op == 8:  # eviction: the oldest few, walked lazily, then removed
            victims = [bytes(k) for k, _ in itertools.islice(index.oldest(), rng.randrange(1, 8))]
            assert victims == list(itertools.islice(model.od, len(victims)))
            for k in victims:
                index.forget(k)
                model.od.pop(k)
        elif op == 9 and rng.random() < 0.05:
            index.clear()
            model.od.clear()
        if step % 40 == 0:
            _same(index, model, probe)
    _same(index, model, probe)


def test_eviction_takes_every_cold_block_before_any_block_read_or_stored_since() -> None:
    rng = random.Random(7)
    keys, sizes, times = _snapshot_of(1000, rng)
    index, model = _installed(keys, sizes, times, 0, rng)
    read = keys[500:510]
    index.touch(read)
    for k in read:
        model.touch(k)
    fresh = _key(5000)
    index.add(BlockKey(fresh[: len(NS)], fresh[len(NS) :]), 9, T0 + 1e4)
    model.put(fresh, 9, T0 + 1e4)
    order = []
    while len(index):  # evicted in slices, as the tier does: a fresh walk each time
        victims = [bytes(k) for k, _ in itertools.islice(index.oldest(), 37)]
        for k in victims:
            index.forget(k)
        order += victims
    assert order == list(model.od)
    assert order[-11:] == [*read, fresh]
    assert index.bytes == 0 and index.columns() == ([], [])


def test_a_snapshot_of_a_mixed_index_brings_back_the_same_lru_list(tmp_path: Path) -> None:
    rng = random.Random(3)
    keys, sizes, times = _snapshot_of(300, rng)
    index, model = _installed(keys, sizes, times, 10, rng)
    index.touch(keys[100:120])
    for k in keys[100:120]:
        model.touch(k)
    for k in keys[200:230]:
        index.forget(k)
        model.od.pop(k, None)
    index.adopt(BlockKey(NS, os.urandom(32)), 12, T0)  # in front of the cold base
    ordered, stamps = index.columns()
    index_snapshot.write_snapshot(
        tmp_path, index_snapshot.Columns(ordered, stamps, [s.stored_at for s in stamps]), durable=False
    )
    epoch = (tmp_path / index_snapshot.MARKER_NAME).read_bytes()
    back = index_snapshot.read_snapshot(tmp_path, epoch, 1 << 20)
    again = BlockIndex()
    got, _ = again.stamps_for(back.sizes, back.times)  # type: ignore[arg-type]
    again.install(BlockIndex.build(back.keys, got.tolist()), int(back.sizes.sum()))  # type: ignore[union-attr]
    assert [(bytes(k), int(s), s.stored_at) for k, s in again.oldest()] == [
        (bytes(k), int(s), s.stored_at) for k, s in index.oldest()
    ]
    assert again.bytes == index.bytes == sum(s for s, _ in model.od.values()) + 12


def test_a_snapshot_listing_a_key_twice_keeps_its_first_place_and_last_size() -> None:
    keys = [_key(1), _key(2), _key(1), _key(3)]
    index = BlockIndex()
    stamps = [index.stamp(size, T0) for size in (10, 20, 30, 40)]
    loaded = BlockIndex.build(keys, stamps)
    index.install(loaded, sum(loaded.values()), keys)
    assert [(bytes(k), int(s)) for k, s in index.oldest()] == [(_key(1), 30), (_key(2), 20), (_key(3), 40)]
    index.forget(_key(1))
    assert [bytes(k) for k, _ in index.oldest()] == [_key(2), _key(3)]
    assert index.bytes == 60


@pytest.mark.skipif(native is None, reason=f"the compiled helper is not built here: {MISSING}")
def test_the_compiled_build_makes_the_map_the_plain_one_makes() -> None:
    """Filled in compiled slices (lists), or by ``dict.update`` (any other sequence): the same
    keys in the same order with the same stamps, a key listed twice included; keys made from a
    snapshot's records by the helper equal numpy's."""
    index = BlockIndex()
    records = os.urandom(48 * 70_000) + os.urandom(48)
    made = native.index_keys(records, 48)
    assert made == np.frombuffer(records, dtype="V48").tolist()
    keys = [*made, made[5], made[69_999]]
    stamps = [index.stamp(n % 7 + 1, T0 + n % 3) for n in range(len(keys))]
    compiled = BlockIndex.build(keys, stamps)
    plain = BlockIndex.build(tuple(keys), tuple(stamps))
    assert list(compiled.items()) == list(plain.items())
    assert compiled[made[5]] is stamps[-2] and list(compiled)[5] == made[5]
    with pytest.raises(ValueError, match="keys and"):
        BlockIndex.build(keys, stamps[:-1])


@pytest.mark.skipif(native is None, reason=f"the compiled helper is not built here: {MISSING}")
def test_the_compiled_index_helpers_refuse_what_is_not_whole() -> None:
    with pytest.raises(ValueError, match="not whole records"):
        native.index_keys(b"x" * 47, 48)
    with pytest.raises(ValueError, match="not whole records"):
        native.index_keys(b"x" * 48, 0)
    into: dict[bytes, int] = {}
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        native.index_fill(into, [b"a", b"b"], [1], 0, 1)
    for start, stop in ((0, 3), (-1, 1), (2, 1)):
        with pytest.raises(IndexError, match="slice"):
            native.index_fill(into, [b"a", b"b"], [1, 2], start, stop)
    with pytest.raises(TypeError):
        native.index_fill([], [b"a"], [1], 0, 1)
    with pytest.raises(TypeError):
        native.index_fill(into, [[]], [1], 0, 1)  # unhashable: refused
    native.index_fill(into, [b"a", b"b"], [1, 2], 0, 2)
    assert into == {b"a": 1, b"b": 2}


def test_a_second_base_is_refused() -> None:
    index = BlockIndex()
    index.install({_key(1): index.stamp(5, T0)}, 5)
    with pytest.raises(ValueError, match="installed once"):
        index.install({_key(2): index.stamp(5, T0)}, 5)


def test_a_cold_base_holds_a_block_in_under_256_bytes_however_much_of_it_was_read() -> None:
    """The index's memory after a snapshot load of 100,000 blocks (keys included, tracemalloc), and
    as more and more of them are read (moved to the ordered dict while the cold base keeps its
    table, until it is compacted)."""
    n = 100_000
    per_block = []
    tracemalloc.start()
    try:
        keys = np.frombuffer(os.urandom(48 * n), dtype="V48").tolist()
        index = BlockIndex()
        stamps, _ = index.stamps_for(np.full(n, 4096, dtype="u8"), T0 + np.arange(n) / 1000)
        loaded = BlockIndex.build(keys, stamps.tolist())
        del stamps
        index.install(loaded, 4096 * n, keys)
        del loaded, keys
        per_block.append(tracemalloc.get_traced_memory()[0] / n)
        for read in (n // 4, n // 15, n // 6, n // 6, n // 10, n):  # to 32%, 50%, 65%, 75%, all
            index.touch([bytes(k) for k, _ in itertools.islice(index.oldest(), read)])
            per_block.append(tracemalloc.get_traced_memory()[0] / n)
    finally:
        tracemalloc.stop()
    assert max(per_block) <= 256, per_block
    assert len(index) == n and index.bytes == 4096 * n and not index._cold


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packs", "block files"])
def test_a_restarted_daemon_reads_deletes_stores_evicts_and_restarts_finding_every_block(
    tmp_path: Path, layout: str
) -> None:
    """Blocks 0-299 stored, a clean restart (the cold base), then: 0-49 read, 100-149 deleted,
    300-399 stored into a tier that holds 300 (packs off: eviction frees exactly), so the oldest
    blocks never read since go first; a second clean restart finds exactly what is left."""
    extra = ["--posix-pack-max-block-bytes", "0", "--posix-capacity", str(300 * 4096)]
    d = posix_daemon(tmp_path, *(extra if layout == "block files" else []))
    with d, UcmClient(d.target) as c:
        put(c, 0, 300)
    with d, UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == 300
        assert "300 from snapshots" in d.log()
        got = c.get_blocks(NS, index_keys(50))
        assert got == [payload(i) for i in range(50)]
        assert c.delete(NS, index_keys(50, 100)) == 50
        put(c, 300, 100)
        present = _present(c, range(400))
    assert all(present[i] for i in range(50)) and not any(present[i] for i in range(100, 150))
    assert all(present[i] for i in range(300, 400))
    cold_order = [*range(50, 100), *range(150, 300)]
    kept = [present[i] for i in cold_order]
    if layout == "block files":  # evicted from the oldest end of the cold base, nothing else
        first_kept = kept.index(True)
        assert first_kept >= 50 and all(kept[first_kept:])
    else:
        assert all(kept)
    with d, UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == sum(present)
        assert _present(c, range(400)) == present
        numbers = [i for i in range(400) if present[i]]
        for start in range(0, len(numbers), 128):
            chunk = numbers[start : start + 128]
            digests = [index_keys(1, i)[0] for i in chunk]
            assert c.get_blocks(NS, digests) == [payload(i) for i in chunk]
    assert blocks_root(d).is_dir()


def _present(c: UcmClient, numbers: range) -> list[bool]:
    return list(c.lookup(NS, index_keys(len(numbers), numbers.start)).present)
