"""Admission policies: which blocks cross a tier boundary, and what becomes of those turned away.

The policies are checked on their own (hashes in, flags out), then in the daemon's real pipeline (a
Cache over a Posix tier in a temporary directory, installed as the daemon installs them), then in a
real daemon over its socket: settings, the figures operators read, cache-only dumps.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.blocks import NS, blocks_in
from support.daemon_stats import tiers_by_name

from ucm_client import SharedBuffer, UcmClient
from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.admission import (
    NO_VICTIM,
    AdmissionSettings,
    SecondUse,
    TinyLFU,
    digest_hashes,
    key_hashes,
    make_admission,
    policy_class,
)
from ucm_server.store.admitting import AdmittingTier, cache_only, install_admission
from ucm_server.store.cache import CacheTier
from ucm_server.store.copying import IoVec
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier
from ucm_server.store.watch import Watchable
from ucm_server.testing.daemon import DaemonProcess

SIZE = 4096
NSB = Namespace(b"admission-tests!")


def _hashes(*names: object) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return key_hashes([NSB + bytes(32 - len(str(n))) + str(n).encode() for n in names])


# -- the policies -----------------------------------------------------------------------------------


def test_key_and_digest_hashes_agree_and_are_never_zero() -> None:
    digests = [os.urandom(32) for _ in range(100)]
    by_key = key_hashes([BlockKey(NSB, d) for d in digests])
    assert (by_key == digest_hashes(NSB, digests)).all()
    assert (by_key == digest_hashes(NSB, b"".join(digests))).all()
    assert (by_key != NO_VICTIM).all() and len(set(by_key.tolist())) == 100


def test_second_use_admits_a_block_at_its_second_use_only() -> None:
    policy = SecondUse(AdmissionSettings())
    once, twice = _hashes(*range(50)), _hashes(*range(50, 100))
    policy.record(once)
    policy.record(twice)
    policy.record(twice)
    none = np.zeros(50, dtype=np.uint64)
    assert not policy.admit(once, none).any()
    assert policy.admit(twice, none).all()


def test_second_use_forgets_uses_older_than_its_window() -> None:
    """A hundred keys used once, then again after two turnovers: about none admitted. Not "none":
    the filters' hashes are drawn per process and answer "seen" for ~3% of keys never recorded, so
    one key alone would fail this now and then; all hundred would be admitted had the early uses
    been remembered. The same keys used twice within the window are all admitted."""
    policy = SecondUse(AdmissionSettings(window_keys=400))  # turns over every 200 keys recorded
    early = _hashes(*(f"early-{i}" for i in range(100)))
    policy.record(early)
    for round_ in range(3):  # two turnovers at least: the early uses are gone
        policy.record(_hashes(*(f"{round_}-{i}" for i in range(200))))
    policy.record(early)
    admitted = int(policy.admit(early, early * 0).sum())
    assert admitted <= 20, f"{admitted} of 100 uses older than the window counted"
    policy.record(early)  # a second use within the window
    assert policy.admit(early, early * 0).all()


def test_tinylfu_admits_with_room_and_compares_frequencies_without() -> None:
    policy = TinyLFU(AdmissionSettings(window_keys=4096))
    hot, cold, victim = _hashes("hot"), _hashes("cold"), _hashes("victim")
    for _ in range(5):
        policy.record(hot)
    policy.record(cold)
    for _ in range(2):
        policy.record(victim)
    assert policy.admit(cold, np.array([NO_VICTIM], dtype=np.uint64)).all(), "room: no one is displaced"
    assert policy.admit(hot, victim).all()
    assert not policy.admit(cold, victim).any()


def test_tinylfu_ages_its_counts() -> None:
    policy = TinyLFU(AdmissionSettings(window_keys=16))  # a reset every 160 records
    old = _hashes("old")
    for _ in range(10):
        policy.record(old)
    before = int(policy.frequency(old)[0])
    policy.record(_hashes(*range(200)))
    assert int(policy.frequency(old)[0]) < before


def test_unknown_policies_are_refused_with_the_choices_named() -> None:
    with pytest.raises(ConfigError, match=r"admission_local: unknown admission policy 'lfu'; known: always"):
        policy_class("lfu", "admission_local")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        policy_class("no.such.module:Policy", "admission_shared")
    with pytest.raises(ConfigError, match="not an AdmissionPolicy"):
        policy_class("ucm_server.store.admission:BloomFilter", "admission_daemon")
    assert policy_class("ucm_server.store.admission:SecondUse") is SecondUse
    assert isinstance(make_admission("tinylfu", AdmissionSettings()), TinyLFU)


# -- in the daemon's pipeline ---------------------------------------------------------------------------


class _Settings:
    def __init__(self, daemon: str = "always", local: str = "always", window_keys: int = 1 << 16) -> None:
        self.admission_daemon, self.admission_local, self.admission_shared = daemon, local, "always"
        self.admission_window_s, self.admission_window_keys = 3600.0, window_keys


class _Store:
    """A real Cache | Posix pipeline with admission installed, and calls as the daemon makes them."""

    def __init__(self, root: Path, *, write_back: bool, cache_blocks: int = 64, **policies: str) -> None:
        self.cache = CacheTier(capacity=cache_blocks * SIZE, page_size=SIZE)
        self.posix = PosixTier(roots=[root], durable=False, direct_io=False)
        self.pipeline = Pipeline([self.cache, self.posix], write_back=write_back)
        self.admission = install_admission(self.pipeline, _Settings(**policies))
        self.pipeline.admission = self.admission

    async def dump(self, digests: list[bytes], *, durable: bool = False) -> None:
        items: list[tuple[BlockKey, IoVec]] = [(BlockKey(NSB, d), [memoryview(d * 128)]) for d in digests]
        results = await self.pipeline.write_many(items, durable=durable, owned=True)
        assert all(r.ok for r in results)
        await self.settle()

    async def lookup(self, digests: list[bytes]) -> list[bool]:
        sizes, _ = await self.pipeline.lookup_presence(NSB, digests)
        await self.settle()
        return [s is not None for s in sizes]

    async def on_disk(self, digests: list[bytes]) -> list[bool]:
        return [s is not None for s in await self.posix.lookup([BlockKey(NSB, d) for d in digests])]

    async def settle(self) -> None:
        if self.admission is not None:
            await self.admission.settle()
        await self.pipeline.drain()


def _run(root: Path, body: Callable[[_Store], Coroutine[Any, Any, None]], **kwargs: Any) -> None:
    async def main() -> None:
        store = _Store(root, **kwargs)
        await store.pipeline.open()
        try:
            await body(store)
        finally:
            await store.pipeline.close()

    asyncio.run(main())


def _digests(name: str, n: int) -> list[bytes]:
    return [name.encode().ljust(32, b"-")[:28] + i.to_bytes(4, "little") for i in range(n)]


@pytest.mark.parametrize("write_back", [True, False])
def test_second_use_writes_a_block_down_at_its_second_use(tmp_path: Path, write_back: bool) -> None:
    async def body(s: _Store) -> None:
        shared, one_off = _digests("shared", 8), _digests("one-off", 8)
        await s.dump(shared + one_off)
        assert not any(await s.on_disk(shared + one_off)), "written below at their first use"
        assert all(await s.lookup(shared))  # served from the Cache: a second use
        assert all(await s.on_disk(shared)) and not any(await s.on_disk(one_off))
        boundary = s.pipeline.tiers[1]
        assert isinstance(boundary, AdmittingTier)
        f = boundary.figures
        assert (f.offered, f.admitted, f.deferred, f.readmitted) == (16, 0, 16, 8)
        extra = boundary.stats().extra
        assert extra["admission_readmitted"] == 8 and boundary.stats().kind == "Posix"

    _run(tmp_path, body, write_back=write_back, local="second-use")


def test_a_block_evicted_before_its_second_use_is_admitted_when_dumped_again(tmp_path: Path) -> None:
    async def body(s: _Store) -> None:
        first = _digests("first", 4)
        await s.dump(first)
        await s.dump(_digests("flood", 32))  # an 8-block Cache: the first blocks are evicted
        assert not any(await s.lookup(first)) and not any(await s.on_disk(first))
        await s.dump(first)  # recomputed and dumped again: the second use
        assert all(await s.on_disk(first))

    _run(tmp_path, body, write_back=True, local="second-use", cache_blocks=8)


def test_durable_dumps_and_blocks_the_cache_refused_are_always_written(tmp_path: Path) -> None:
    async def body(s: _Store) -> None:
        durable = _digests("durable", 4)
        await s.dump(durable, durable=True)
        assert all(await s.on_disk(durable))
        big = BlockKey(NSB, _digests("big", 1)[0])  # larger than the whole Cache: it refuses it
        (r,) = await s.pipeline.write_many([(big, [memoryview(bytes(4 * SIZE))])], owned=True)
        assert r.ok
        await s.settle()
        assert await s.posix.lookup([big]) == [4 * SIZE]

    _run(tmp_path, body, write_back=True, local="tinylfu", cache_blocks=2)


def test_the_door_stores_a_block_only_at_its_second_dump(tmp_path: Path) -> None:
    async def body(s: _Store) -> None:
        blocks = _digests("door", 4)
        await s.dump(blocks)
        assert not any(await s.lookup(blocks)), "stored at its first dump"
        await s.dump(blocks)
        assert all(await s.lookup(blocks)) and all(await s.on_disk(blocks))
        assert s.admission is not None
        extra = s.admission.door_extra()
        assert extra["admission_offered"] == 8 and extra["admission_deferred"] == 4

    _run(tmp_path, body, write_back=True, daemon="second-use")


def test_cache_only_writes_nothing_below_and_drops_an_older_copy_there(tmp_path: Path) -> None:
    async def body(s: _Store) -> None:
        blocks = _digests("kept", 4)
        await s.dump(blocks)
        assert all(await s.on_disk(blocks))  # an older version below
        token = cache_only.set(True)
        try:
            await s.dump(blocks)
        finally:
            cache_only.reset(token)
        assert all(await s.lookup(blocks)) and not any(await s.on_disk(blocks))
        assert s.pipeline.writeback_figures().skipped == 0, "counted as a saturated node's skip"

    _run(tmp_path, body, write_back=True)


def test_always_everywhere_installs_nothing(tmp_path: Path) -> None:
    store = _Store(tmp_path, write_back=True)
    assert store.admission is None and store.pipeline.tiers[1] is store.posix


def test_a_boundary_stays_watchable_and_never_announces_a_deferred_block(tmp_path: Path) -> None:
    stored: list[bytes] = []

    class Watch:
        def stored(self, key: bytes) -> None:
            stored.append(key)

        def stored_many(self, keys: Any) -> None:
            stored.extend(keys)

        def removed(self, key: bytes) -> None: ...

        def cleared(self) -> None: ...

    async def body(s: _Store) -> None:
        boundary = s.pipeline.tiers[1]
        assert isinstance(boundary, AdmittingTier) and isinstance(boundary, Watchable)
        boundary.watch_index(Watch())
        blocks = _digests("watched", 2)
        await s.dump(blocks)
        assert stored == []
        await s.lookup(blocks)
        assert sorted(stored) == sorted(BlockKey(NSB, d) for d in blocks)

    _run(tmp_path, body, write_back=True, local="second-use")


# -- in a real daemon -------------------------------------------------------------------------------------


def test_a_daemon_with_second_use_writes_down_what_is_used_again(tmp_path: Path) -> None:
    n = 8
    args = ["--admission-local", "second-use"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target) as c:
        with SharedBuffer(2 * n * SIZE) as buf:
            buf.buf[:] = os.urandom(2 * n * SIZE)
            region = c.register(buf)
            shared = blocks_in(region, n, SIZE)
            one_off = blocks_in(region, n, SIZE, first=n, offset=n * SIZE)
            assert c.wait(c.dump(NS, shared + one_off), 10).ok
            _until(lambda: not c.stats().pending_writeback)
            assert tiers_by_name(c)["Posix"].blocks == 0
            assert c.lookup(NS, [b.key for b in shared]).hit_prefix == n  # the second use
            _until(lambda: tiers_by_name(c)["Posix"].blocks == n)
            posix = tiers_by_name(c)["Posix"]
            assert posix.kind == "Posix"
            assert posix.extra["admission_deferred"] == 2 * n and posix.extra["admission_readmitted"] == n


@pytest.mark.slow
def test_a_daemon_keeps_a_cache_only_dump_off_the_disk(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm") as d, UcmClient(d.target) as c, SharedBuffer(4 * SIZE) as buf:
        region = c.register(buf)
        assert c.wait(c.dump(NS, blocks_in(region, 4, SIZE), cache_only=True), 10).ok
        assert c.wait(c.dump(NS, blocks_in(region, 4, SIZE, first=4)), 10).ok
        _until(lambda: not c.stats().pending_writeback)
        assert tiers_by_name(c)["Posix"].blocks == 4 and tiers_by_name(c)["Cache"].blocks == 8


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--admission-local", "lru", "admission_local: unknown admission policy 'lru'; known: always"),
        (
            "--admission-daemon",
            "nope:Nope",
            "admission_daemon: admission policy 'nope:Nope' cannot be loaded",
        ),
        ("--admission-window-keys", "0", "admission_window_keys: must be positive"),
    ],
)
def test_a_bad_admission_setting_stops_the_daemon_naming_it(
    tmp_path: Path, flag: str, value: str, message: str
) -> None:
    with pytest.raises(RuntimeError) as failed:
        DaemonProcess(tmp_path / "ucm", args=[flag, value]).start(timeout_s=20)
    assert message in str(failed.value)


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "did not happen in time"
        time.sleep(0.05)


def test_installing_an_unknown_policy_names_the_setting() -> None:
    pipeline = Pipeline([CacheTier(capacity=SIZE * 4, page_size=SIZE)])
    with pytest.raises(ConfigError, match="admission_daemon: unknown admission policy 'x'"):
        install_admission(pipeline, _Settings(daemon="x"))
