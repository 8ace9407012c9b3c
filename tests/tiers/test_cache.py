"""The Cache tier passes the shared conformance suite, plus its own eviction and lease rules."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey
from ucm_protocol.states import BlockState
from ucm_server.store.base import OK, Tier
from ucm_server.store.cache import CacheTier
from ucm_server.testing.tier_suite import TierSuite, key, payload

T = TypeVar("T")


class TestCacheConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return CacheTier(capacity=16 << 20, page_size=4096)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return arena_bytes(tier, key)


class TestArcCacheConformance(TierSuite):
    """The same suite with the ARC eviction policy."""

    async def make_tier(self, path: Path) -> Tier:
        return CacheTier(capacity=16 << 20, page_size=4096, eviction="arc")

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return arena_bytes(tier, key)


class TestPrefaultingCacheConformance(TierSuite):
    """The same suite while the arena is being faulted in underneath: no block's bytes may change."""

    async def make_tier(self, path: Path) -> Tier:
        return CacheTier(capacity=64 << 20, page_size=4096, prefault=True)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        return arena_bytes(tier, key)


def arena_bytes(tier: Tier, key: BlockKey) -> bytes | None:
    """The Cache's back door: the arena pages the block's entry holds, joined (a lease, not a read)."""
    assert isinstance(tier, CacheTier)
    lease = tier.lease(key)
    if lease is None:
        return None
    try:
        return b"".join(bytes(view) for view in lease.iov)
    finally:
        lease.release()


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _wait_prefaulted(tier: CacheTier, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while tier.arena.prefaulted < tier.arena.capacity and time.monotonic() < deadline:
        time.sleep(0.05)


def test_prefault_faults_the_whole_arena_in_and_keeps_written_bytes() -> None:
    capacity = 256 << 20

    async def main() -> None:
        t = CacheTier(capacity=capacity, page_size=64 << 10, prefault=True)
        before = _rss()
        data = payload(1, 1 << 20)
        await t.open()
        assert (await t.write_from(key(1), [memoryview(data)])).ok  # while the prefault runs
        await asyncio.to_thread(_wait_prefaulted, t, 30)
        assert t.arena.prefaulted == capacity
        assert t.stats().extra["prefault_pending_bytes"] == 0
        assert _rss() - before >= capacity * 0.9  # resident now, not on first use
        out = bytearray(len(data))
        assert (await t.read_into(key(1), [memoryview(out)])).ok and out == data
        await t.close()

    asyncio.run(main())


def test_close_during_prefault_stops_it() -> None:
    async def main() -> None:
        t = CacheTier(capacity=4 << 30, page_size=64 << 10, prefault=True)
        await t.open()
        pending = t.stats().extra["prefault_pending_bytes"]  # 4 GiB take seconds to fault in
        assert 0 < pending <= 4 << 30
        started = time.monotonic()
        await t.close()
        assert time.monotonic() - started < 5
        assert t.arena.prefaulted < 4 << 30
        assert t.stats().extra["prefault_pending_bytes"] == 0  # stopped: nothing more will fault in

    asyncio.run(main())


def test_lru_evicts_least_recently_used() -> None:
    async def main() -> None:
        t = CacheTier(capacity=4 * 4096, page_size=4096)
        for i in range(4):
            assert (await t.write_from(key(i), [memoryview(payload(i, 4096))])).ok
        assert (await t.read_into(key(0), [memoryview(bytearray(4096))])).ok  # 0 is now recent
        assert (await t.write_from(key(4), [memoryview(payload(4, 4096))])).ok
        assert await t.lookup([key(0), key(1), key(4)]) == [4096, None, 4096]
        assert t.stats().evictions == 1
        await t.close()

    asyncio.run(main())


def test_leased_block_is_never_evicted_or_overwritten() -> None:
    async def main() -> None:
        t = CacheTier(capacity=2 * 4096, page_size=4096)
        data = payload(1, 4096)
        await t.write_from(key(1), [memoryview(data)])
        lease = t.lease(key(1))
        assert lease is not None
        await t.write_from(key(2), [memoryview(payload(2, 4096))])
        r = await t.write_from(key(3), [memoryview(payload(3, 4096))])  # evicts 2, not the leased 1
        assert r.ok and await t.lookup([key(1), key(2)]) == [4096, None]
        # Replacing the leased block unlinks it but keeps its pages until the lease ends.
        await t.delete([key(3)])
        await t.write_from(key(1), [memoryview(payload(9, 4096))])
        assert bytes(lease.iov[0]) == data
        lease2 = t.lease(key(1))  # the new version, now also in use: every page is held
        assert lease2 is not None
        full = await t.write_from(key(5), [memoryview(payload(5, 4096))])
        assert full.state is BlockState.FAILED and "cache full" in full.reason
        lease.release()
        lease2.release()
        assert (await t.write_from(key(5), [memoryview(payload(5, 4096))])).ok
        await t.close()

    asyncio.run(main())


def test_a_batch_evicts_the_oldest_unleased_blocks_past_the_leased_ones_in_front() -> None:
    """A batch makes its room in one walk of the eviction order (blocks awaiting write-back, leased
    at its front, are walked past once): the same blocks go as one block at a time would evict, the
    oldest unleased ones, and a block larger than the Cache evicts nothing."""

    async def main() -> None:
        t = CacheTier(capacity=8 * 4096, page_size=4096)
        for i in range(8):
            assert (await t.write_from(key(i), [memoryview(payload(i, 4096))])).ok
        leases = [t.lease(key(i)) for i in range(3)]  # the three oldest await write-back
        batch = [(key(100 + i), [memoryview(payload(100 + i, 4096))]) for i in range(3)]
        batch.append((key(200), [memoryview(bytearray(9 * 4096))]))  # never fits: refused, evicts nothing
        got = await t.write_many(batch)
        assert [r.ok for r in got] == [True, True, True, False]
        held = await t.lookup([key(i) for i in range(8)])
        assert held == [4096] * 3 + [None] * 3 + [4096] * 2, "not the oldest unleased blocks"
        assert t.stats().evictions == 3
        for lease in leases:
            assert lease is not None
            lease.release()
        await t.close()

    asyncio.run(main())


def test_block_larger_than_cache_fails_cleanly() -> None:
    async def main() -> None:
        t = CacheTier(capacity=4096, page_size=4096)
        r = await t.write_from(key(1), [memoryview(bytearray(8192))])
        assert r.state is BlockState.FAILED
        await t.close()

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_scan_of_one_off_blocks_flushes_shared_ones_under_lru_not_arc(policy: str) -> None:
    """8 shared blocks read twice, then 64 one-off blocks through a 32-block Cache: ARC keeps the
    shared ones (they were used again: T2), LRU loses them all (the negative control)."""

    async def main() -> list[bool]:
        tier = CacheTier(capacity=32 * 4096, page_size=4096, eviction=policy)
        await tier.open()
        shared = [BlockKey(b"s" * 16, i.to_bytes(32, "little")) for i in range(8)]
        for k in shared:
            assert (await tier.write_from(k, [memoryview(bytes(4096))])).ok
        for _ in range(2):
            for k in shared:
                assert (await tier.read_into(k, [memoryview(bytearray(4096))])).ok
        for i in range(64):
            one_off = BlockKey(b"o" * 16, i.to_bytes(32, "little"))
            assert (await tier.write_from(one_off, [memoryview(bytes(4096))])).ok
        present = [size is not None for size in await tier.lookup(shared)]
        await tier.close()
        return present

    present = asyncio.run(main())
    assert present == ([True] * 8 if policy == "arc" else [False] * 8)


def test_an_unknown_policy_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy 'lfu'; known: lru, arc"):
        CacheTier(capacity=1 << 20, eviction="lfu")


def test_arena_allocation_gives_exact_runs_from_a_fragmented_free_list() -> None:
    """Pages handed out are exactly the pages asked for, as runs of consecutive pages: one run when
    the free pages are consecutive, several when freeing left holes (never a page twice)."""
    from ucm_server.store.arena import Arena

    arena = Arena(64 * 4096, 4096)
    try:
        blocks = [arena.allocate(4 * 4096) for _ in range(16)]
        assert all(b is not None and len(b) == 1 for b in blocks)  # a fresh arena: one run each
        for b in blocks[::2]:  # free every other block: holes of 4 pages
            assert b is not None
            arena.free(b)
        extents = arena.allocate(12 * 4096)
        assert extents is not None
        pages = [p for first, npages in extents for p in range(first, first + npages)]
        assert len(pages) == len(set(pages)) == 12
        assert len(extents) == 3  # three holes of 4, not one run
        held = {p for b in blocks[1::2] if b for first, npages in b for p in range(first, first + npages)}
        assert not held & set(pages)  # never a page still in use
        assert arena.free_pages == 64 - 8 * 4 - 12
    finally:
        arena.close()


class _GateNextJob(Executor):
    """A real thread pool whose next job, once :meth:`arm`-ed, waits for the gate: a test stand-in
    that holds a batch's copy in flight while the test changes the Cache under it."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2)
        self.gate = threading.Event()
        self.armed = False
        self.held = threading.Event()

    def arm(self) -> None:
        self.armed = True

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> Future[T]:
        if not self.armed:
            return self.pool.submit(fn, *args, **kwargs)
        self.armed = False

        def gated() -> T:
            self.held.set()
            self.gate.wait(10)
            return fn(*args, **kwargs)

        return self.pool.submit(gated)


def test_a_batched_read_keeps_its_blocks_through_replacement_and_eviction() -> None:
    """A batch read holds every block it copies from (no Lease object each): while its copy is in
    flight, replacing those blocks and then filling the Cache so that it must evict neither evicts
    them nor reuses their pages; the read gets the versions it found, whole, and the replaced pages
    are freed when it ends."""

    async def main() -> None:
        size, n = 64 << 10, 16  # 1 MiB: copied in the executor, not inline
        ex = _GateNextJob()
        t = CacheTier(capacity=2 * n * size, page_size=size, executor=ex)
        old = [payload(i, size) for i in range(n)]
        assert all(r.ok for r in await t.write_many([(key(i), [memoryview(old[i])]) for i in range(n)]))
        dests = [bytearray(size) for _ in range(n)]
        ex.arm()
        reader = asyncio.create_task(t.read_many([(key(i), [memoryview(dests[i])]) for i in range(n)]))
        assert await asyncio.to_thread(ex.held.wait, 10)  # the copy is in flight, held
        assert t.stats().extra["leased_blocks"] == n
        new = [(key(i), [memoryview(payload(100 + i, size))]) for i in range(n)]
        assert all(r.ok for r in await t.write_many(new))  # replaced: the old pages stay, unlinked
        others = [(key(200 + i), [memoryview(payload(200 + i, size))]) for i in range(n)]
        assert all(r.ok for r in await t.write_many(others))  # evicts the new versions, not the held pages
        assert await t.lookup([key(0), key(200)]) == [None, size]
        assert t.arena.free_pages == 0
        ex.gate.set()
        assert all(r.ok for r in await reader)
        assert [bytes(d) for d in dests] == old
        assert t.arena.free_pages == n  # the replaced versions' pages, freed with the read's hold
        assert t.stats().extra["leased_blocks"] == 0
        await t.close()
        ex.pool.shutdown()

    asyncio.run(main())


def test_an_ordered_read_that_cannot_take_every_block_holds_none() -> None:
    """``read_in_order`` copies nothing unless every block is here at the destination's size; a
    batch it declines leaves no block held (each could then never be evicted)."""

    async def main() -> None:
        t = CacheTier(capacity=8 * 4096, page_size=4096)
        for i in range(3):
            assert (await t.write_from(key(i), [memoryview(payload(i, 4096))])).ok
        dests = [bytearray(4096) for _ in range(4)]
        items = [(key(i), [memoryview(d)]) for i, d in enumerate(dests)]
        assert await t.read_in_order(items, lambda k: None) is None  # key(3) is missing
        wrong = [*items[:2], (key(2), [memoryview(bytearray(100))])]
        assert await t.read_in_order(wrong, lambda k: None) is None  # key(2) at another size
        assert t.stats().extra["leased_blocks"] == 0 and dests == [bytearray(4096)] * 4
        reported: list[int] = []
        assert await t.read_in_order(items[:3], reported.append) == [OK] * 3
        assert reported == [1] and [bytes(d) for d in dests[:3]] == [await _stored(t, i) for i in range(3)]
        await t.close()

    asyncio.run(main())


async def _stored(t: CacheTier, i: int) -> bytes:
    out = bytearray(4096)
    assert (await t.read_into(key(i), [memoryview(out)])).ok
    return bytes(out)


class _Recorder:
    """A watcher of the Cache's index that keeps every statement, in order; ``batched``: it takes a
    batch of removals in one call, as the data plane's and the KV events' watchers do."""

    def __init__(self, *, batched: bool) -> None:
        self.said: list[tuple[str, bytes]] = []
        self.removal_calls = 0
        if batched:
            self.removed_many = self._removed_many

    def stored(self, key: bytes) -> None:
        self.said.append(("stored", bytes(key)))

    def stored_many(self, keys: Iterable[bytes]) -> None:
        self.said.extend(("stored", bytes(k)) for k in keys)

    def removed(self, key: bytes) -> None:
        self.removal_calls += 1
        self.said.append(("removed", bytes(key)))

    def _removed_many(self, keys: Sequence[bytes]) -> None:
        self.removal_calls += 1
        self.said.extend(("removed", bytes(k)) for k in keys)

    def cleared(self) -> None:
        self.said.append(("cleared", b""))

    def held(self) -> set[bytes]:
        held: set[bytes] = set()
        for what, k in self.said:
            if what == "stored":
                held.add(k)
            elif what == "removed":
                held.discard(k)
        return held


@pytest.mark.parametrize("batched", [True, False])
def test_a_replacing_batch_tells_its_watcher_each_removal_before_the_new_version(batched: bool) -> None:
    """A batch replacing stored blocks (one of them twice in the batch) says each old version is
    gone before its new one is there, in one call where the watcher takes a batch; what the watcher
    then holds is what the Cache holds, and the replaced pages are all free again."""

    async def main() -> None:
        t = CacheTier(capacity=16 * 4096, page_size=4096)
        w = _Recorder(batched=batched)
        t.watch_index(w)
        assert all(
            r.ok for r in await t.write_many([(key(i), [memoryview(payload(i, 4096))]) for i in range(4)])
        )
        start = len(w.said)
        batch = [(key(i), [memoryview(payload(10 + i, 4096))]) for i in (0, 1, 1, 2, 7)]
        assert all(r.ok for r in await t.write_many(batch))
        for k in (key(0), key(1), key(2)):
            said = [what for what, got in w.said[start:] if got == bytes(k)]
            assert said[0] == "removed" and said[-1] == "stored", said
        assert w.removal_calls == (1 if batched else 4)  # key(1) twice: its first new version replaced too
        assert w.held() == {bytes(key(i)) for i in (0, 1, 2, 3, 7)}
        assert await t.lookup([key(i) for i in (0, 1, 2, 3, 7)]) == [4096] * 5
        assert t.arena.free_pages == 16 - 5
        out = bytearray(4096)
        assert (await t.read_into(key(1), [memoryview(out)])).ok and bytes(out) == bytes(batch[2][1][0])
        await t.close()

    asyncio.run(main())
