"""Write-back is a bounded queue with backpressure and admission, visible in stats.

A real daemon whose lower tier is slow (``LatencyInjectingTier``: a real Posix tier, each block write
delayed) and whose Cache is small is flooded with dumps far faster than the disk can take them. Before
the backlog was bounded, write-back leased every Cache block and later writes were refused by the
Cache ("all blocks leased", ``rejected_writes``) and went straight to the slow disk. Now:

- no Cache write is refused, and the backlog's bytes never pass its bound (polled while it is full);
- with ``writeback_overflow: cache-only`` the saturated node keeps blocks in the Cache only, counted
  (``writeback_skipped``), and a dump with ``wait_durable`` is never skipped: it waits for room,
  and after ``kill -9`` every block acknowledged durable loads byte-exact;
- with ``write-through`` nothing is skipped: every acknowledged block is on disk once the Cache is
  emptied;
- the same figures are in Prometheus (``ucm_writeback_*``).
"""

from __future__ import annotations

import re
import threading
import urllib.request
from pathlib import Path

import pytest
from support.hardening import (
    SLOW_TIER,
    admin_evict_all,
    admin_stats,
    content,
    tier_env,
    tier_named,
)
from support.polling import eventually

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(test="hardening-writeback-backlog")
SIZE = 64 << 10  # one Cache page
BATCH = 16
CACHE = 4 << 20  # 64 pages
BOUND = 1 << 20  # 16 pages may await write-down


def _daemon(tmp_path: Path, overflow: str, *, metrics: bool = False) -> DaemonProcess:
    env = tier_env(SLOW_TIER, {"root": str(tmp_path / "blocks"), "durable": True, "write_delay_s": 0.05})
    args = [
        "--store-pipeline",
        f"Cache|{SLOW_TIER}",
        "--cache-capacity",
        str(CACHE),
        "--writeback-max-bytes",
        str(BOUND),
        "--writeback-wait-s",
        "0.01",
        "--writeback-overflow",
        overflow,
        "--io-threads",
        "2",
    ]
    if metrics:
        args += ["--metrics-address", "127.0.0.1:0"]
    return DaemonProcess(tmp_path / "ucm", args=args, env=env)


def _key(i: int) -> bytes:
    return key_digest("writeback-backlog", i)


def _dump(
    c: UcmClient, buf: SharedBuffer, region: int, first: int, *, durable: bool = False
) -> list[BlockState]:
    keys = [_key(first + j) for j in range(BATCH)]
    for j, k in enumerate(keys):
        buf.buf[j * SIZE : (j + 1) * SIZE] = content(k, SIZE)
    blocks = [BlockIO(k, (Segment(region, j * SIZE, SIZE),)) for j, k in enumerate(keys)]
    return list(c.wait(c.dump(NS, blocks, wait_durable=durable), 120).states)


def _loads_exact(c: UcmClient, buf: SharedBuffer, region: int, keys: list[bytes]) -> list[bool]:
    """Whether each key loads with exactly its bytes (MISSING: False; wrong bytes fail the test)."""
    out = []
    for k in keys:
        buf.buf[:SIZE] = bytes(SIZE)
        r = c.wait(c.load(NS, [BlockIO(k, (Segment(region, 0, SIZE),))]), 60)
        ok = r.states[0] is BlockState.OK
        if ok:
            assert bytes(buf.buf[:SIZE]) == content(k, SIZE), f"wrong bytes for block {k.hex()}"
        out.append(ok)
    return out


def _watch_backlog(target: str, stop: threading.Event, seen: list[tuple[float, float]]) -> None:
    """Poll the top tier's backlog figures (bytes pending, queue depth) until ``stop``."""
    while not stop.is_set():
        extra = tier_named(admin_stats(target), "Cache").extra
        seen.append((extra["writeback_bytes_pending"], extra["writeback_queue_depth"]))
        stop.wait(0.02)


def _flood(d: DaemonProcess, c: UcmClient, buf: SharedBuffer, region: int, batches: int) -> list[BlockState]:
    """Dump ``batches`` batches back to back while watching the backlog; asserts it stayed bounded."""
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch_backlog, args=(d.target, stop, seen), daemon=True)
    watcher.start()
    try:
        states = [s for b in range(batches) for s in _dump(c, buf, region, b * BATCH)]
    finally:
        stop.set()
        watcher.join(10)
    assert seen and max(p for p, _ in seen) <= BOUND, f"backlog passed its bound: {max(seen)}"
    assert max(depth for _, depth in seen) > 0, "the backlog was never seen non-empty"
    return states


@pytest.mark.slow
def test_a_saturated_node_keeps_blocks_in_the_cache_and_never_loses_a_durable_one(tmp_path: Path) -> None:
    d = _daemon(tmp_path, "cache-only")
    with d, UcmClient(d.target) as c, SharedBuffer(BATCH * SIZE) as buf:
        region = c.register(buf)
        states = _flood(d, c, buf, region, batches=12)  # 192 blocks at 20/s of disk: saturated
        assert all(s is BlockState.OK for s in states)
        cache = tier_named(admin_stats(d.target), "Cache").extra
        assert cache["rejected_writes"] == 0, "a Cache write was refused: every block leased"
        assert cache["writeback_skipped"] > 0, "the saturated node wrote everything down?"
        assert cache["writeback_max_bytes"] == BOUND
        # A durable dump on the saturated node waits for room instead of being skipped.
        first = 1000
        assert all(s is BlockState.OK for s in _dump(c, buf, region, first, durable=True))
        assert tier_named(admin_stats(d.target), "Cache").extra["writeback_backpressure_waits"] > 0
        durable = [_key(first + j) for j in range(BATCH)]
        d.kill()  # SIGKILL: the Cache is gone, only what reached the disk is left
        d.start()
    with d, UcmClient(d.target) as c, SharedBuffer(SIZE) as buf:
        region = c.register(buf)
        assert all(_loads_exact(c, buf, region, durable)), "a block acknowledged durable was lost"
        others = _loads_exact(c, buf, region, [_key(i) for i in range(0, 12 * BATCH, 7)])
        assert any(others)  # written down ones load right; skipped ones are MISSING, never wrong
        assert d.healthy()


@pytest.mark.slow
def test_write_through_overflow_writes_every_block_down(tmp_path: Path) -> None:
    d = _daemon(tmp_path, "write-through")
    with d, UcmClient(d.target) as c, SharedBuffer(BATCH * SIZE) as buf:
        region = c.register(buf)
        states = _flood(d, c, buf, region, batches=6)
        assert all(s is BlockState.OK for s in states)
        eventually(lambda: admin_stats(d.target).pending_writeback == 0, 60, "write-back drained")
        cache = tier_named(admin_stats(d.target), "Cache").extra
        assert cache["rejected_writes"] == 0
        assert cache["writeback_skipped"] == 0
        assert cache["writeback_written_through"] > 0, "the node was never saturated"
        assert cache["writeback_bytes_pending"] == 0 and cache["leased_blocks"] == 0
        admin_evict_all(d.target, "Cache")  # what is left is what the disk holds
        keys = [_key(i) for i in range(6 * BATCH)]
        assert all(_loads_exact(c, buf, region, keys)), "an acknowledged block never reached the disk"
        assert d.healthy()


def test_backlog_figures_are_in_prometheus(tmp_path: Path) -> None:
    d = _daemon(tmp_path, "cache-only", metrics=True)
    with d, UcmClient(d.target) as c, SharedBuffer(BATCH * SIZE) as buf:
        region = c.register(buf)
        assert all(s is BlockState.OK for s in _dump(c, buf, region, 0))
        match = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())
        assert match is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=5).read().decode()
    bound = re.search(r"^ucm_writeback_max_bytes (\S+)$", text, re.M)
    assert bound is not None and float(bound.group(1)) == BOUND
    for name in (
        "ucm_writeback_queue_depth",
        "ucm_writeback_bytes_pending",
        "ucm_writeback_waiting",
        "ucm_writeback_backpressure_waits_total",
        "ucm_writeback_backpressure_wait_seconds_total",
        "ucm_writeback_skipped_total",
        "ucm_writeback_written_through_total",
        "ucm_writeback_written_total",
        "ucm_writeback_failed_total",
    ):
        assert name in text, name


@pytest.mark.parametrize("bad", [["--writeback-wait-s", "-1"], ["--writeback-overflow", "drop"]])
def test_bad_backlog_settings_stop_start_up(tmp_path: Path, bad: list[str]) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=bad)
    with pytest.raises(RuntimeError):
        d.start(timeout_s=20)
    assert bad[0].removeprefix("--").replace("-", "_") in d.log()
