"""Faults a production daemon meets, injected into real daemon processes; each test says what holds.

Real where the fault can be caused on any Linux test machine: a full disk (a 1 MiB tmpfs), a client
killed with SIGKILL mid-task, the daemon killed with SIGKILL under load. Test doubles from
:mod:`ucm_server.testing.faults` only where it cannot: a read failing with EIO
(``FaultInjectingTier``; device-mapper is not available in containers) and a slow disk
(``LatencyInjectingTier``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.hardening import (
    FAULT_TIER,
    SLOW_TIER,
    admin_evict_all,
    admin_stats,
    content,
    tier_env,
    tier_named,
)
from support.polling import eventually

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.errors import UcmError
from ucm_server.store.posix import block_file_header
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

NS = namespace_id(test="hardening-faults")
SENTINEL = 0xEE


def _fill(buf: SharedBuffer, keys: list[bytes], size: int, *, offset: int = 0) -> list[BlockIO]:
    """Write each key's deterministic content into ``buf`` and describe the blocks (region 1 = buf)."""
    blocks = []
    for i, k in enumerate(keys):
        start = offset + i * size
        buf.buf[start : start + size] = content(k, size)
        blocks.append(BlockIO(k, (Segment(1, start, size),)))
    return blocks


def _at(region: int, keys: list[bytes], size: int, offset: int = 0) -> list[BlockIO]:
    return [BlockIO(k, (Segment(region, offset + i * size, size),)) for i, k in enumerate(keys)]


def _metric(text: str, name: str, tier: str) -> float:
    m = re.search(rf'^{name}\{{kind="[^"]*",tier="{re.escape(tier)}"\}} (\S+)$', text, re.MULTILINE)
    assert m, f"{name} for tier {tier} missing from /metrics"
    return float(m.group(1))


# -- disk full, for real ---------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, so ``ENOSPC`` comes from the kernel, not from a double; unmounted after."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix"])
def test_disk_full_fails_per_block_and_keeps_what_was_stored(
    tmp_path: Path, small_tmpfs: Path, pipeline: str
) -> None:
    """Dumping 40 blocks of 64 KiB into a 1 MiB tmpfs with ``wait_durable``: the blocks that did not
    fit fail one by one saying so, nothing torn or temporary is left on disk, the blocks stored
    earlier still load byte for byte, the tier counts the errors, and deleting frees room again."""
    size, n_first, n = 64 << 10, 4, 40
    keys = [key_digest("disk-full", i) for i in range(n)]
    d = DaemonProcess(
        tmp_path / "ucm",
        args=[
            "--store-pipeline", pipeline,
            "--storage-backends", str(small_tmpfs),
            "--cache-capacity", "16MiB",
            "--metrics-address", "127.0.0.1:0",
            "--posix-pack-max-block-bytes", "0",  # one file per block: each visible one checked below
        ],
    )  # fmt: skip
    with d, UcmClient(d.target) as c, SharedBuffer(2 * n * size) as buf:
        region = c.register(buf)
        blocks = _fill(buf, keys, size)
        assert region == 1
        first = c.wait(c.dump(NS, blocks[:n_first], wait_durable=True), 30)
        assert first.ok, first.reasons
        r = c.wait(c.dump(NS, blocks[n_first:], wait_durable=True), 60)
        assert r.done and not r.cancelled
        failed = r.indices(BlockState.FAILED)
        stored = r.indices(BlockState.OK)
        assert failed, "1 MiB cannot hold 40 blocks of 64 KiB, yet no block failed"
        assert len(failed) + len(stored) == n - n_first, r.states
        for i in failed:
            assert "No space left on device" in r.reasons[i], r.reasons[i]
        assert d.healthy()

        # On disk: no temporary file, and every visible block file is complete.
        names = [p for p in small_tmpfs.rglob("*") if p.is_file()]
        assert not [p for p in names if ".tmp." in p.name], "a temp file was left behind"
        blk = [p for p in names if p.name.endswith(".blk")]
        assert len(blk) == n_first + len(stored)
        assert all(block_file_header(p).payload_len == size for p in blk)  # size checked too

        # What was stored (before and during the overflow) loads from disk, byte for byte.
        if pipeline.startswith("Cache"):
            admin_evict_all(d.target, "Cache")
        good = [keys[i] for i in range(n_first)] + [keys[n_first + i] for i in stored]
        loaded = c.wait(c.load(NS, _at(region, good, size, offset=n * size)), 30)
        assert loaded.ok, loaded.reasons
        for i, k in enumerate(good):
            start = n * size + i * size
            assert bytes(buf.buf[start : start + size]) == content(k, size), f"block {i} differs"

        # The failures are counted: Admin Stats and Prometheus agree.
        posix = tier_named(admin_stats(d.target), "Posix")
        assert posix.errors >= len(failed)
        m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())
        assert m, d.log()
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=5).read().decode()
        assert _metric(text, "ucm_tier_errors_total", "Posix") == posix.errors

        # Deleting makes room: the same blocks now go in.
        assert c.delete(NS, good) == len(good)
        retry = [blocks[n_first + i] for i in failed[:4]]
        again = c.wait(c.dump(NS, retry, wait_durable=True), 30)
        assert again.ok, again.reasons


# -- EIO on read (test double) ---------------------------------------------------------------------


def test_eio_on_read_fails_those_blocks_and_serves_no_bytes(tmp_path: Path) -> None:
    """Two of eight blocks fail to read with EIO (``FaultInjectingTier``): exactly those two are
    FAILED with the OS's reason, not one of their bytes reaches the client, they are not promoted into
    the Cache, the other six load intact, and the daemon stays healthy and counts the errors."""
    size, n, bad = 32 << 10, 8, (2, 5)
    keys = [key_digest("eio", i) for i in range(n)]
    settings = {"root": str(tmp_path / "blocks"), "eio_read_digests": [keys[i].hex() for i in bad]}
    env = tier_env(FAULT_TIER, settings)
    d = DaemonProcess(tmp_path / "ucm", args=["--store-pipeline", f"Cache|{FAULT_TIER}"], env=env)
    with d, UcmClient(d.target) as c, SharedBuffer(2 * n * size) as buf:
        region = c.register(buf)
        assert c.wait(c.dump(NS, _fill(buf, keys, size), wait_durable=True), 30).ok
        admin_evict_all(d.target, "Cache")  # so every read goes to the faulty disk
        for attempt in range(2):  # a failed read is not cached as something good
            buf.buf[n * size :] = bytes([SENTINEL]) * (n * size)
            r = c.wait(c.load(NS, _at(region, keys, size, offset=n * size)), 30)
            assert r.done
            assert r.indices(BlockState.FAILED) == list(bad), (attempt, r.states, r.reasons)
            for i in bad:
                assert "Input/output error" in r.reasons[i]
                start = n * size + i * size
                assert bytes(buf.buf[start : start + size]) == bytes([SENTINEL]) * size
            for i in set(range(n)) - set(bad):
                start = n * size + i * size
                assert bytes(buf.buf[start : start + size]) == content(keys[i], size)
            assert r.bytes_done == (n - len(bad)) * size
        stats = admin_stats(d.target)
        faulty = tier_named(stats, "FaultInjecting")
        assert faulty.errors == 2 * len(bad)
        assert faulty.extra["injected_eio"] == 2 * len(bad)
        assert tier_named(stats, "Cache").blocks == n - len(bad)
        assert d.healthy()


# -- a slow disk (test double) ---------------------------------------------------------------------


def test_slow_tier_wait_times_out_cancel_is_prompt_and_lookups_stay_fast(tmp_path: Path) -> None:
    """Behind a disk taking 50 ms per block read (``LatencyInjectingTier``), a load of 1,024 blocks
    takes seconds: ``wait(0.3)`` comes back not done on time; another client's lookup of all 1,024
    keys answers in under a second meanwhile; ``cancel`` returns within one chunk with the rest of the
    blocks CANCELLED, and afterwards the daemon no longer writes into the client's memory."""
    size, n = 4096, 1024
    keys = [key_digest("slow", i) for i in range(n)]
    env = tier_env(SLOW_TIER, {"root": str(tmp_path / "blocks"), "durable": False, "read_delay_s": 0.05})
    d = DaemonProcess(tmp_path / "ucm", args=["--store-pipeline", SLOW_TIER], env=env)
    with d, UcmClient(d.target) as c, UcmClient(d.target, client_name="other") as other:
        with SharedBuffer(2 * n * size) as buf:
            region = c.register(buf)
            assert c.wait(c.dump(NS, _fill(buf, keys, size)), 60).ok
            task = c.load(NS, _at(region, keys, size, offset=n * size))

            t0 = time.monotonic()
            r = c.wait(task, 0.3)
            waited = time.monotonic() - t0
            assert not r.done and 0.25 <= waited < 2.0, (r.done, waited)  # margin for a busy 2-core box

            t0 = time.monotonic()
            answer = other.lookup(NS, keys)
            lookup_s = time.monotonic() - t0
            assert answer.hit_prefix == n
            assert lookup_s < 1.0, f"a lookup took {lookup_s:.2f}s while the slow load ran"

            t0 = time.monotonic()
            r = c.cancel(task)
            cancel_s = time.monotonic() - t0
            assert r.done and r.cancelled
            # It ends within the chunk under way: 256 blocks, 16 at a time, 50 ms each = 0.8 s.
            assert cancel_s < 2.5, f"cancel took {cancel_s:.2f}s"
            cancelled = r.indices(BlockState.CANCELLED)
            assert cancelled, r.states
            assert set(r.states) <= {BlockState.OK, BlockState.CANCELLED}
            for i in r.indices(BlockState.OK):  # what did complete is right
                start = n * size + i * size
                assert bytes(buf.buf[start : start + size]) == content(keys[i], size)

            buf.buf[n * size :] = bytes([SENTINEL]) * (n * size)
            time.sleep(0.5)  # longer than several block reads: a straggler would show
            assert bytes(buf.buf[n * size :]) == bytes([SENTINEL]) * (n * size)
            assert d.healthy()


# -- a client killed mid-task ----------------------------------------------------------------------


def _victim(target: str, mode: str, keys: list[bytes], size: int, q: Any) -> None:
    """Child process: register memory, start one big load or dump, report, then wait to be killed."""
    c = UcmClient(target, client_name=f"victim-{mode}")
    buf = SharedBuffer(len(keys) * size, label="victim")
    region = c.register(buf)
    blocks = [BlockIO(k, (Segment(region, i * size, size),)) for i, k in enumerate(keys)]
    if mode == "dump":
        for i, k in enumerate(keys):
            buf.buf[i * size : (i + 1) * size] = content(k, size)
        task = c.dump(NS, blocks, wait_durable=True)
    else:
        task = c.load(NS, blocks)
    q.put((os.getpid(), task))
    time.sleep(120)  # killed long before


@pytest.mark.parametrize("mode", ["dump", "load"])
def test_client_killed_mid_task_is_reaped(tmp_path: Path, mode: str) -> None:
    """A client process is SIGKILLed while its 512-block task runs behind a slow disk. Its session,
    region and task are reaped; once write-back drains the Cache holds no lease; evicting the Cache
    frees every page; and every block Lookup reports loads and matches what was dumped."""
    size, n = 64 << 10, 512
    keys = [key_digest("victim", mode, i) for i in range(n)]
    delays = {"write_delay_s": 0.02} if mode == "dump" else {"read_delay_s": 0.05}
    env = tier_env(SLOW_TIER, {"root": str(tmp_path / "blocks"), "durable": False, **delays})
    args = ["--store-pipeline", f"Cache|{SLOW_TIER}", "--cache-capacity", "64MiB"]
    d = DaemonProcess(tmp_path / "ucm", args=args, env=env)
    ctx = mp.get_context("spawn")
    with d, UcmClient(d.target) as c, SharedBuffer(n * size) as mine:
        region = c.register(mine)
        if mode == "load":  # the blocks exist on the slow disk only
            assert c.wait(c.dump(NS, _fill(mine, keys, size), wait_durable=True), 60).ok
            admin_evict_all(d.target, "Cache")
        base = admin_stats(d.target)
        q = ctx.Queue()
        p = ctx.Process(target=_victim, args=(d.target, mode, keys, size, q))
        p.start()
        try:
            pid, _task = q.get(timeout=60)
            eventually(lambda: admin_stats(d.target).tasks_running >= 1, 10, "the victim's task running")
            time.sleep(0.3)
            running = admin_stats(d.target)
            assert running.sessions == base.sessions + 1 and running.tasks_running >= 1
            os.kill(pid, signal.SIGKILL)
            p.join(10)
        finally:
            if p.is_alive():
                p.kill()
                p.join(10)
        # Client memory is a memfd: even a SIGKILLed client leaves nothing behind in /dev/shm.
        assert not list(Path("/dev/shm").glob(f"ucm-{p.pid}-*"))

        def reaped() -> bool:
            s = admin_stats(d.target)
            return (s.sessions, s.regions, s.tasks_running, s.tasks_queued) == (
                base.sessions,
                base.regions,
                0,
                0,
            ) and s.region_bytes == base.region_bytes

        eventually(reaped, 15, "the killed client's session, regions and tasks reaped")
        eventually(lambda: admin_stats(d.target).pending_writeback == 0, 30, "write-back drained")
        cache = tier_named(admin_stats(d.target), "Cache")
        assert cache.extra["leased_blocks"] == 0

        # Nothing half-written is visible: every block Lookup reports loads and is right.
        present = c.lookup(NS, keys).present
        found = [k for k, p in zip(keys, present, strict=True) if p]
        if mode == "load":
            assert len(found) == n  # a killed reader loses nothing
        mine.buf[:] = bytes(n * size)
        if found:
            r = c.wait(c.load(NS, _at(region, found, size)), 60)
            assert r.ok, r.reasons
            for i, k in enumerate(found):
                assert bytes(mine.buf[i * size : (i + 1) * size]) == content(k, size), f"block {i} differs"

        # No block is stuck unevictable: evicting the Cache gives back every page.
        admin_evict_all(d.target, "Cache")
        cache = tier_named(admin_stats(d.target), "Cache")
        assert cache.blocks == 0 and cache.bytes == 0
        assert cache.extra["free_bytes"] == cache.capacity_bytes
        assert d.healthy()


# -- the daemon killed under load ------------------------------------------------------------------


def _durable_dumper(target: str, worker: int, record: str, seconds: float) -> None:
    """Child process: dump rounds of 8 blocks with ``wait_durable`` and append every block reported OK
    to ``record`` (flushed at once), until the daemon dies under it or time is up."""
    size = 32 << 10
    deadline = time.monotonic() + seconds
    try:
        with (
            UcmClient(target, client_name=f"durable-{worker}", rpc_timeout_s=5) as c,
            SharedBuffer(8 * size) as buf,
            Path(record).open("a") as out,
        ):
            region = c.register(buf)
            rnd = 0
            while time.monotonic() < deadline:
                keys = [key_digest("durable", worker, rnd, i) for i in range(8)]
                for i, k in enumerate(keys):
                    buf.buf[i * size : (i + 1) * size] = content(k, size)
                r = c.wait(c.dump(NS, _at(region, keys, size), wait_durable=True), 10)
                for i in r.indices(BlockState.OK):
                    out.write(keys[i].hex() + "\n")
                out.flush()
                rnd += 1
    except UcmError:
        return  # the daemon was killed: expected


def test_daemon_kill_9_under_concurrent_durable_dumps_loses_nothing(tmp_path: Path) -> None:
    """Four client processes dump with ``wait_durable``; the daemon is SIGKILLed mid-stream and
    restarted: every block any of them was told was durable loads, byte for byte."""
    size, workers = 32 << 10, 4
    d = DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "32MiB"])
    records = [str(tmp_path / f"durable-{w}.txt") for w in range(workers)]
    ctx = mp.get_context("spawn")
    d.start()
    procs = [
        ctx.Process(target=_durable_dumper, args=(d.target, w, records[w], 60.0)) for w in range(workers)
    ]
    try:
        for p in procs:
            p.start()

        def reported() -> int:
            return sum(Path(r).read_text().count("\n") for r in records if Path(r).exists())

        eventually(lambda: reported() >= 400, 45, "400 blocks reported durable")
        d.kill()
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        d.kill()
    durable = sorted({bytes.fromhex(line) for r in records for line in Path(r).read_text().split()})
    assert len(durable) >= 400

    with d.start(), UcmClient(d.target) as c, SharedBuffer(len(durable) * size) as buf:
        region = c.register(buf)
        assert c.lookup(NS, durable).hit_prefix == len(durable), "a block reported durable was lost"
        r = c.wait(c.load(NS, _at(region, durable, size)), 60)
        assert r.ok, r.reasons
        bad = [
            i for i, k in enumerate(durable) if bytes(buf.buf[i * size : (i + 1) * size]) != content(k, size)
        ]
        assert not bad, f"{len(bad)} durable blocks came back wrong"
        d.stop()
