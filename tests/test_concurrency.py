"""Eight client processes dump and load at once for a bounded time; nothing is lost or mixed."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from pathlib import Path

import pytest

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

SIZE = 32 << 10
PER_ROUND = 16
NS = namespace_id(test="concurrency")


def _content(worker: int, round_: int, i: int) -> bytes:
    """Deterministic per-block content, so any process can check any block it loads."""
    seed = hashlib.sha256(f"{worker}/{round_}/{i}".encode()).digest()
    return seed * (SIZE // len(seed))


def _worker(target: str, worker: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    checked = rounds = 0
    errors: list[str] = []
    with UcmClient(target, client_name=f"w{worker}") as c, SharedBuffer(2 * PER_ROUND * SIZE) as buf:
        region = c.register(buf)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            keys = [key_digest(worker, rounds, i) for i in range(PER_ROUND)]
            for i in range(PER_ROUND):
                buf.buf[i * SIZE : (i + 1) * SIZE] = _content(worker, rounds, i)
            dump = [BlockIO(k, (Segment(region, i * SIZE, SIZE),)) for i, k in enumerate(keys)]
            r = c.wait(c.dump(NS, dump), 30)
            if not r.ok:
                errors.append(f"dump round {rounds}: {r.reasons}")
            # Load back this round and, when it exists, a block of the previous worker's same round.
            other = (worker + 1) % 8
            load_keys = [*keys, key_digest(other, rounds, 0)]
            base = PER_ROUND * SIZE
            load = [
                BlockIO(k, (Segment(region, base + i * SIZE, SIZE),))
                for i, k in enumerate(load_keys[:PER_ROUND])
            ]
            r = c.wait(c.load(NS, load), 30)
            if not r.ok:
                errors.append(f"load round {rounds}: {r.reasons}")
            for i in range(PER_ROUND):
                if bytes(buf.buf[base + i * SIZE : base + (i + 1) * SIZE]) != _content(worker, rounds, i):
                    errors.append(f"mixed bytes in round {rounds} block {i}")
                checked += 1
            present = c.lookup(NS, load_keys[-1:]).present[0]
            if present:
                one = [BlockIO(load_keys[-1], (Segment(region, base, SIZE),))]
                if c.wait(c.load(NS, one), 30).ok:
                    if bytes(buf.buf[base : base + SIZE]) != _content(other, rounds, 0):
                        errors.append(f"another worker's block {other}/{rounds} came back wrong")
                    checked += 1
            rounds += 1
    out.put((worker, rounds, checked, errors))


def test_eight_processes_dump_and_load_concurrently(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "8MiB"]) as d:
        procs = [ctx.Process(target=_worker, args=(d.target, w, 8.0, out)) for w in range(8)]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert d.healthy()
        with UcmClient(d.target) as c:
            stats = c.stats()
    errors = [e for _, _, _, errs in results for e in errs]
    assert not errors, errors[:5]
    total_checked = sum(c for _, _, c, _ in results)
    assert all(rounds > 0 for _, rounds, _, _ in results)
    assert total_checked >= 8 * PER_ROUND
    # The 8 MiB cache overflowed, so blocks were evicted and re-read from disk along the way.
    assert {t.name: t.evictions for t in stats.tiers}["Cache"] > 0
