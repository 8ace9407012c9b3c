"""Bug reproductions: a read promoted into the Cache overwrites a newer write of the same block.

Found by the mixed-load test (a worker read back an older version of its own block, on a plain
``Cache|Posix`` daemon). The race: reader A misses the Cache and reads version 1 from disk; writer B
dumps version 2 (into the Cache, then written back); A's read finishes and ``Pipeline._promote``
writes version 1 into the Cache, replacing version 2 there. Consequences:

1. B and everyone else now load version 1 from the Cache (read-your-writes broken) until it is evicted;
2. if version 2's write-back had not started yet, the flusher sees its Cache lease ``superseded`` and
   skips it while reporting OK, so a dump acknowledged with ``wait_durable`` never reaches the disk.

A slow disk (``LatencyInjectingTier``: 1.5 s per block read, 2 s per write; a read delivers the bytes
the file held when it began, as a real slow read does) makes the window wide enough to be
deterministic: B's dump lands in the Cache ~1.3 s before A's promotion, and in the second test the
write-back of K starts ~0.7 s after it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.hardening import SLOW_TIER, admin_evict_all, tier_env

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

NS = namespace_id(test="hardening-promotion-race")
SIZE = 4096
K = key_digest("race", "K")


def _daemon(tmp_path: Path, *, write_delay_s: float) -> DaemonProcess:
    env = tier_env(
        SLOW_TIER,
        {
            "root": str(tmp_path / "blocks"),
            "durable": False,
            "read_delay_s": 1.5,
            "write_delay_s": write_delay_s,
        },
    )
    # Two write-back flushers, so two earlier blocks keep them busy while the race happens.
    args = ["--store-pipeline", f"Cache|{SLOW_TIER}", "--io-threads", "2"]
    return DaemonProcess(tmp_path / "ucm", args=args, env=env)


def _race(d: DaemonProcess, a: UcmClient, b: UcmClient, abuf: SharedBuffer, bbuf: SharedBuffer) -> bool:
    """Version 1 of K on disk only; A starts a (slow) load of K; B dumps [X0, X1, K=version 2] with
    ``wait_durable``; returns whether B was told all three are durable."""
    ra, rb = a.register(abuf), b.register(bbuf)
    bbuf.buf[:SIZE] = b"\x01" * SIZE
    assert b.wait(b.dump(NS, [BlockIO(K, (Segment(rb, 0, SIZE),))], wait_durable=True), 30).ok
    admin_evict_all(d.target, "Cache")
    task = a.load(NS, [BlockIO(K, (Segment(ra, 0, SIZE),))])
    time.sleep(0.2)  # A has read version 1 and is "still reading"
    bbuf.buf[: 3 * SIZE] = b"\x02" * (3 * SIZE)
    others = [BlockIO(key_digest("race", "X", i), (Segment(rb, (1 + i) * SIZE, SIZE),)) for i in range(2)]
    r = b.wait(b.dump(NS, [*others, BlockIO(K, (Segment(rb, 0, SIZE),))], wait_durable=True), 30)
    assert a.wait(task, 30).ok
    return r.ok


def _read_k(b: UcmClient, bbuf: SharedBuffer) -> int:
    bbuf.buf[:SIZE] = bytes(SIZE)
    assert b.wait(b.load(NS, [BlockIO(K, (Segment(1, 0, SIZE),))]), 30).ok
    return bbuf.buf[0]


def test_a_promoted_read_does_not_hide_a_newer_write(tmp_path: Path) -> None:
    with _daemon(tmp_path, write_delay_s=0.0) as d, UcmClient(d.target) as a, UcmClient(d.target) as b:
        with SharedBuffer(4 * SIZE) as abuf, SharedBuffer(4 * SIZE) as bbuf:
            assert _race(d, a, b, abuf, bbuf)
            assert _read_k(b, bbuf) == 2, "B loads the version it wrote"


def test_a_block_acknowledged_durable_is_on_disk(tmp_path: Path) -> None:
    with _daemon(tmp_path, write_delay_s=2.0) as d, UcmClient(d.target) as a, UcmClient(d.target) as b:
        with SharedBuffer(4 * SIZE) as abuf, SharedBuffer(4 * SIZE) as bbuf:
            acknowledged = _race(d, a, b, abuf, bbuf)
            admin_evict_all(d.target, "Cache")  # what is left is what the disk holds
            assert not acknowledged or _read_k(b, bbuf) == 2, "version 2 was acknowledged durable"
