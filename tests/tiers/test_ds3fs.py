"""DS3FSTier on a local directory standing in for the 3FS mount (3FS cannot run here; its POSIX path is
the same code on a real mount). Two tier instances on one directory are two nodes sharing the mount."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ucm_protocol.errors import ConfigError, Unavailable
from ucm_protocol.keys import BlockKey
from ucm_protocol.states import BlockState
from ucm_server.store.base import Tier
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.format import HEADER_SIZE
from ucm_server.store.posix import QUARANTINE, TMP_MARK
from ucm_server.testing.tier_suite import TierSuite, key, payload

HAVE_USRBIO = importlib.util.find_spec("hf3fs_fuse") is not None


class TestDS3FSConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        (path / "mnt").mkdir(exist_ok=True)
        return DS3FSTier("DS3FS", mount=path / "mnt", usrbio="off", durable=False)

    async def stored_block(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The block's file under the mount, read with plain file I/O."""
        assert isinstance(tier, DS3FSTier)
        path = tier.path_of(key)
        return await asyncio.to_thread(path.read_bytes) if path.exists() else None


def node(mount: Path, **kw: object) -> DS3FSTier:
    mount.mkdir(exist_ok=True)
    return DS3FSTier("DS3FS", mount=mount, **kw)  # type: ignore[arg-type]


def test_block_written_by_another_node_is_found_and_read(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = node(tmp_path / "mnt"), node(tmp_path / "mnt")
        await a.open()
        await b.open()
        datas = [payload(i, 4096 + i) for i in range(6)]
        assert all(r.ok for r in await a.write_many([(key(i), [memoryview(d)]) for i, d in enumerate(datas)]))
        assert await b.lookup([key(i) for i in range(7)]) == [len(d) for d in datas] + [None]
        outs = [bytearray(len(d)) for d in datas]
        results = await b.read_many([(key(i), [memoryview(o)]) for i, o in enumerate(outs)])
        assert all(r.ok for r in results), results
        assert [bytes(o) for o in outs] == datas
        assert {i.key async for i in b.list_blocks(key(0).namespace)} == {key(i) for i in range(6)}
        assert await b.delete([key(0)]) == 1  # B deletes a block only A's index knew
        assert not a.path_of(key(0)).exists()
        await a.close()
        await b.close()

    asyncio.run(main())


def test_negative_cache_is_short_and_own_writes_clear_it(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = node(tmp_path / "mnt", negative_ttl_s=0.3), node(tmp_path / "mnt", negative_ttl_s=0.3)
        await a.open()
        await b.open()
        assert await b.lookup([key(1), key(2)]) == [None, None]
        await a.write_from(key(1), [memoryview(b"x" * 100)])
        assert await b.lookup([key(1)]) == [None]  # still cached as absent: no filesystem hit
        await asyncio.sleep(0.35)
        assert await b.lookup([key(1)]) == [100]
        await b.write_from(key(2), [memoryview(b"y" * 50)])
        assert await b.lookup([key(2)]) == [50]
        await a.close()
        await b.close()

    asyncio.run(main())


def test_concurrent_writes_by_two_nodes_leave_one_intact_block(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = node(tmp_path / "mnt"), node(tmp_path / "mnt")
        await a.open()
        await b.open()
        for round_ in range(10):
            k = key(100 + round_)
            va, vb = payload(1, 256 << 10), payload(2, 256 << 10)
            ra, rb = await asyncio.gather(
                a.write_from(k, [memoryview(va)]), b.write_from(k, [memoryview(vb)])
            )
            assert ra.ok and rb.ok
            for reader in (a, b):
                out = bytearray(len(va))
                assert (await reader.read_into(k, [memoryview(out)])).ok
                assert bytes(out) in (va, vb)
        leftovers = [p for p in (tmp_path / "mnt").rglob("*") if TMP_MARK in p.name]
        assert leftovers == []
        await a.close()
        await b.close()

    asyncio.run(main())


def test_corrupt_file_from_another_node_is_failed_and_quarantined(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = node(tmp_path / "mnt"), node(tmp_path / "mnt")
        await a.open()
        await b.open()
        data = payload(5, 8192)
        await a.write_from(key(5), [memoryview(data)])
        path = a.path_of(key(5))
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 9] ^= 0xFF
        path.write_bytes(bytes(raw))
        out = bytearray(len(data))
        r = await b.read_into(key(5), [memoryview(out)])
        # Like the Posix tier, the POSIX path reads straight into the destination and then verifies:
        # the bytes there are not to be used, which the FAILED result says.
        assert r.state is BlockState.FAILED and "checksum" in r.reason
        assert not path.exists()
        assert list((tmp_path / "mnt" / "ucm" / QUARANTINE).iterdir())
        await a.close()
        await b.close()

    asyncio.run(main())


def test_start_up_scan_keeps_other_nodes_writes_in_flight(tmp_path: Path) -> None:
    async def main() -> None:
        a = node(tmp_path / "mnt")
        await a.open()
        await a.write_from(key(7), [memoryview(b"z" * 64)])
        final = a.path_of(key(7))
        young = final.with_name(final.name + TMP_MARK + "young")
        old = final.with_name(final.name + TMP_MARK + "old")
        young.write_bytes(b"partial")
        old.write_bytes(b"partial")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        b = node(tmp_path / "mnt", scan_on_open=True, stale_tmp_s=3600)
        await b.open()
        assert young.exists() and not old.exists()
        assert b.stats().blocks == 1
        await a.close()
        await b.close()

    asyncio.run(main())


def test_hung_file_times_out_per_block(tmp_path: Path) -> None:
    """A FIFO where a block should be once blocked ``open()`` like a hung mount; the tier must give up.
    Files are now opened ``O_NONBLOCK`` and only regular ones kept (files on disk are data, not
    instructions), so the FIFO is skipped at once and counted as a skipped file rather than timing out."""

    async def main() -> None:
        t = node(tmp_path / "mnt", timeout_s=0.5)
        await t.open()
        path = t.path_of(key(9))
        path.parent.mkdir(parents=True)
        os.mkfifo(path)
        try:
            started = time.monotonic()
            assert await t.lookup([key(9)]) == [None]
            assert time.monotonic() - started < 2
            assert t.stats().extra.get("skipped_files") == 1
        finally:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # wake the stuck reader thread
                os.close(fd)
            except OSError:  # ENXIO: no reader is waiting, nothing to wake
                pass
        await t.close()

    asyncio.run(main())


@pytest.mark.skipif(HAVE_USRBIO, reason="hf3fs_fuse is installed: the POSIX fallback is not what runs")
def test_posix_fallback_is_logged_and_usrbio_on_requires_binding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        t = node(tmp_path / "mnt")
        await t.open()
        assert t.io_path == "posix"
        await t.close()
        with pytest.raises(Unavailable, match="hf3fs_fuse"):
            await node(tmp_path / "mnt", usrbio="on").open()

    caplog.set_level(logging.INFO, logger="ucm_server.store.ds3fs")
    asyncio.run(main())
    assert "using POSIX I/O" in caplog.text


def test_missing_mount_is_unavailable(tmp_path: Path) -> None:
    t = DS3FSTier("D", mount=tmp_path / "not-mounted")
    with pytest.raises(Unavailable, match="not-mounted"):
        asyncio.run(t.open())


def test_from_settings() -> None:
    t = DS3FSTier.from_settings("D", {"mount": "/3fs/stage", "capacity": "1GiB", "negative_ttl_s": 2})
    assert (t.mount, t.capacity, t.negative_ttl_s) == (Path("/3fs/stage"), 1 << 30, 2.0)
    assert t.roots == [Path("/3fs/stage/ucm")]
    with pytest.raises(ConfigError, match="'mount'"):
        DS3FSTier.from_settings("D", {})
    with pytest.raises(ConfigError, match="'mnt'"):
        DS3FSTier.from_settings("D", {"mount": "/x", "mnt": "/y"})
    with pytest.raises(ConfigError, match="usrbio"):
        DS3FSTier.from_settings("D", {"mount": "/x", "usrbio": "maybe"})
    assert DS3FSTier.shared and DS3FSTier.persistent


def test_rewrite_by_another_node_is_seen_by_reader_with_stale_index(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = node(tmp_path / "mnt", positive_ttl_s=60), node(tmp_path / "mnt", positive_ttl_s=60)
        await a.open()
        await b.open()
        await a.write_from(key(1), [memoryview(b"s" * 100)])
        assert await a.lookup([key(1)]) == [100]
        await b.write_from(key(1), [memoryview(b"L" * 300)])  # A's index still says 100 bytes
        out = bytearray(300)
        r = await a.read_into(key(1), [memoryview(out)])
        assert r.ok, r.reason
        assert bytes(out) == b"L" * 300
        await a.close()
        await b.close()

    asyncio.run(main())


_KEYS = [key(i) for i in range(5)]


class TwoNodesOnOneMount(RuleBasedStateMachine):
    """Random writes, reads, deletes and restarts through two nodes sharing one mount, checked after
    every step against one model: with both TTLs at zero, either node sees every change at once."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="ucm-ds3fs-"))
        self.model: dict[BlockKey, bytes] = {}
        self.nodes = [self.loop.run_until_complete(self._open()) for _ in range(2)]

    async def _open(self) -> DS3FSTier:
        t = node(self.dir, negative_ttl_s=0, positive_ttl_s=0, durable=False)
        await t.open()
        return t

    @rule(n=st.integers(0, 1), k=st.sampled_from(_KEYS), data=st.binary(min_size=1, max_size=3000))
    def write(self, n: int, k: BlockKey, data: bytes) -> None:
        (r,) = self.loop.run_until_complete(self.nodes[n].write_many([(k, [memoryview(data)])]))
        assert r.ok, r.reason
        self.model[k] = data

    @rule(n=st.integers(0, 1), k=st.sampled_from(_KEYS))
    def read(self, n: int, k: BlockKey) -> None:
        expected = self.model.get(k)
        out = bytearray(len(expected) if expected is not None else 7)
        (r,) = self.loop.run_until_complete(self.nodes[n].read_many([(k, [memoryview(out)])]))
        if expected is None:
            assert r.state is BlockState.MISSING, r
        else:
            assert r.ok, r.reason
            assert bytes(out) == expected

    @rule(n=st.integers(0, 1), k=st.sampled_from(_KEYS))
    def delete(self, n: int, k: BlockKey) -> None:
        removed = self.loop.run_until_complete(self.nodes[n].delete([k]))
        assert removed == (1 if k in self.model else 0)
        self.model.pop(k, None)

    @rule(n=st.integers(0, 1))
    def restart(self, n: int) -> None:
        self.loop.run_until_complete(self.nodes[n].close())
        self.nodes[n] = self.loop.run_until_complete(self._open())

    @invariant()
    def both_nodes_agree_with_the_model(self) -> None:
        want = [len(self.model[k]) if k in self.model else None for k in _KEYS]
        for t in self.nodes:
            assert self.loop.run_until_complete(t.lookup(_KEYS)) == want

    def teardown(self) -> None:
        for t in self.nodes:
            self.loop.run_until_complete(t.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTwoNodesOnOneMount = TwoNodesOnOneMount.TestCase
TestTwoNodesOnOneMount.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
TestTwoNodesOnOneMount.pytestmark = [pytest.mark.slow]  # 30 examples of 20 steps: seconds
