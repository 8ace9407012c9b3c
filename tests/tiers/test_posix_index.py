"""Issue #13, item 1: instant, safe restart of the Posix tier's index, against a real daemon.

The daemon serves before its index is complete (``posix_index_wait_s``), brings the index back from
the snapshot a clean shutdown leaves, and re-adopts block files in the background otherwise. These
tests restart it with a stale, torn or forged snapshot, kill it with SIGKILL while it dumps, while it
writes its snapshot and while it re-adopts, and check what a user would see: every block Lookup
reports loads byte-exact, every block acknowledged durable is found, nothing wrong is ever served.
"""

from __future__ import annotations

import hashlib
import random
import struct
import sys
import time
import tracemalloc
from pathlib import Path

from support.blocks import NS
from support.posix_store import (
    POSIX_ONLY,
    SIZE,
    DumpsUntilKilled,
    FileSizeLimitedDaemon,
    alive,
    blocks_root,
    check_all,
    index_done,
    index_keys,
    payload,
    plant,
    posix_daemon,
    previous_release_sizes,
    put,
)

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_protocol.keys import BlockKey
from ucm_server.store.posix.block_index import BlockIndex
from ucm_server.store.posix.index_snapshot import MARKER_NAME, SNAPSHOT_NAME
from ucm_server.testing.daemon import DaemonProcess


def _forge(snap: Path, keys: list[bytes], sizes: list[int], times: list[float]) -> None:
    """A snapshot in the version-1 columns with a valid checksum, and the marker that vouches for it."""
    head = struct.pack("<8sII16sQ", b"UCMISNAP", 1, 48, b"E" * 16, len(keys))
    body = (
        head + b"".join(keys) + struct.pack(f"<{len(keys)}Q", *sizes) + struct.pack(f"<{len(keys)}d", *times)
    )
    snap.write_bytes(body + hashlib.sha256(body).digest())
    (snap.parent / MARKER_NAME).write_bytes(b"E" * 16)


def test_a_clean_restart_takes_the_index_from_the_snapshot(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 300)
    root = blocks_root(d)
    assert (root / SNAPSHOT_NAME).is_file() and (root / MARKER_NAME).is_file()
    with d, UcmClient(d.target) as c:
        assert not (root / MARKER_NAME).exists()  # taken at start: a crash from now on leaves none
        assert index_done(c)["blocks"] == 300
        check_all(c, range(300))
        assert "300 from snapshots" in d.log()
        alive(d, c)


def test_a_torn_snapshot_is_never_trusted(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 200)
    snap = blocks_root(d) / SNAPSHOT_NAME
    snap.write_bytes(snap.read_bytes()[:-100])  # torn: the marker still vouches for it
    with d, UcmClient(d.target) as c:
        index_done(c)
        assert "torn" in d.log()
        check_all(c, range(200))
        alive(d, c)


def test_a_forged_snapshot_never_serves_wrong_bytes(tmp_path: Path) -> None:
    """A snapshot edited in place fails its checksum; one rebuilt whole with a valid checksum and a
    matching marker (a forgery) may make Lookup report blocks, but every Load checks the file."""
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 100)
    snap = blocks_root(d) / SNAPSHOT_NAME
    data = bytearray(snap.read_bytes())
    data[40 + 100 * 48 + 1] ^= 0xFF  # a byte of the first record's size
    snap.write_bytes(bytes(data))
    with d, UcmClient(d.target) as c:
        index_done(c)
        assert "checksum mismatch" in d.log()
        check_all(c, range(100))
    # The forgery: every record claims a wrong size, plus blocks that were never stored.
    records = [bytes(NS) + k for k in index_keys(100)] + [bytes(NS) + k for k in index_keys(50, 1000)]
    _forge(snap, records, [SIZE * 2] * len(records), [1.0] * len(records))
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        assert c.get_blocks(NS, index_keys(50, 1000)) == [None] * 50  # listed, not there: missing
        check_all(c, range(100))  # real blocks: the sweep corrected their sizes
        alive(d, c)
        d.stop()


def test_a_stale_snapshot_is_not_trusted_after_a_crash(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 100)
    root = blocks_root(d)
    saved = {name: (root / name).read_bytes() for name in (SNAPSHOT_NAME, MARKER_NAME)}
    d.start()
    with UcmClient(d.target) as c:
        put(c, 100, 100)
        assert c.delete(NS, index_keys(20)) == 20
    d.kill()
    with d.start(), UcmClient(d.target) as c:  # no marker (taken at the last start): headers read
        index_done(c)
        assert "no clean-shutdown marker" in d.log()
        check_all(c, range(20, 200), absent=range(20))
        d.stop()
    # The stale snapshot put back with its own marker (a restored backup, say): the sweep after it
    # adopts the blocks it lacks, and the deleted ones it lists are not served.
    for name, data in saved.items():
        (root / name).write_bytes(data)
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        assert c.get_blocks(NS, index_keys(20)) == [None] * 20
        check_all(c, range(20, 200))
        alive(d, c)
        d.stop()


def test_the_daemon_serves_while_it_re_adopts_and_survives_kill_9_then(tmp_path: Path) -> None:
    """After a crash the daemon answers at once; Loads of blocks not adopted yet still return their
    exact bytes; stats show progress; a SIGKILL mid-way leaves every block for the next start."""
    n = 20_000
    d = posix_daemon(tmp_path, "--posix-index-wait-s", "0")
    plant(d, 0, n)
    probe = random.Random(7).sample(range(n), 64)
    for attempt in range(2):
        started = time.monotonic()
        with d.start(), UcmClient(d.target) as c:
            answered = time.monotonic() - started
            with SharedBuffer(len(probe) * SIZE) as dst:
                region = c.register(dst)
                blocks = [
                    BlockIO(key_digest("index", i), (Segment(region, j * SIZE, SIZE),))
                    for j, i in enumerate(probe)
                ]
                assert c.wait(c.load(NS, blocks), 60).ok  # by path where not adopted yet
                assert bytes(dst.buf) == b"".join(payload(i) for i in probe)
            tier = next(t for t in c.stats().tiers if t.kind == "Posix")
            if "index_adopting" in tier.extra:  # progress, while it lasts
                assert tier.extra["index_adopted"] <= tier.extra["index_files_read"] <= n
            if attempt == 0:
                d.kill()  # SIGKILL during re-adoption (most likely still running: 20,000 headers)
                continue
            assert index_done(c)["blocks"] == n
            log = d.log()
            assert log.rindex("ready on unix://") < log.rindex("indexed from")  # served first
            check_all(c, range(0, n, 7))
            alive(d, c)
            d.stop()
        assert answered < 30


def test_kill_9_while_dumping_after_a_snapshot_loses_no_durable_block(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 200)
    d.start()
    dumps = DumpsUntilKilled(d, 200, 16)
    time.sleep(random.uniform(0.3, 0.8))
    dumps.kill(d)
    durable = dumps.durable
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, range(200))
        for i in durable:
            assert c.get_blocks(NS, [key_digest("index", i)]) == [payload(i)]
        everything = index_keys(len(durable) + 64, 200)
        present = c.lookup(NS, everything).present
        reported = [everything[j] for j, p in enumerate(present) if p]
        for key, data in zip(reported, c.get_blocks(NS, reported), strict=True):
            assert data is not None and data == payload(200 + everything.index(key))
        alive(d, c)
        d.stop()


def test_kill_9_while_the_snapshot_is_written_is_never_trusted_later(tmp_path: Path) -> None:
    """SIGTERM then SIGKILL at random points of the shutdown (often while the snapshot or the marker
    is being written): whatever was left, the next start serves every block correctly."""
    n = 6_000
    d = posix_daemon(tmp_path, "--posix-index-wait-s", "60")
    plant(d, 0, n)
    rng = random.Random(13)
    for delay in (0.0, 0.02, 0.05, 0.1, rng.uniform(0, 0.3)):
        d.start()
        assert d.proc is not None
        d.proc.send_signal(15)
        time.sleep(delay)
        d.kill()
        with d.start(), UcmClient(d.target) as c:
            assert index_done(c)["blocks"] == n
            check_all(c, range(0, n, 97))
    with d.start(), UcmClient(d.target) as c:
        check_all(c, range(n))
        alive(d, c)
        d.stop()


def test_a_snapshot_the_disk_refuses__efbig_stand_in_for_enospc(tmp_path: Path) -> None:
    d = FileSizeLimitedDaemon(tmp_path / "ucm", args=POSIX_ONLY)
    plant(d, 0, 2000)  # a 128 KiB snapshot: over the limit, while each block file is under it
    with d, UcmClient(d.target) as c:
        index_done(c)
        alive(d, c)
    assert d.proc is None and "index snapshot not written" in d.log()
    assert not (blocks_root(d) / MARKER_NAME).exists()
    assert not [p for p in blocks_root(d).iterdir() if ".tmp." in p.name]  # the partial file is removed
    plain = DaemonProcess(d.workdir, args=POSIX_ONLY)
    with plain, UcmClient(plain.target) as c:
        assert index_done(c)["blocks"] == 2001
        check_all(c, range(2000))


def test_the_previous_release_reads_the_block_files_and_ignores_the_snapshot(tmp_path: Path) -> None:
    """A downgrade: the start-up scan of releases without snapshots (kept as the DS3FS path) reads
    every block after a clean shutdown, takes the snapshot files for no block and removes nothing."""
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 64)
    root = blocks_root(d)
    before = {p.name for p in root.iterdir()}

    assert previous_release_sizes(root, 64) == [SIZE] * 64
    assert {p.name for p in root.iterdir()} == before  # nothing quarantined, nothing removed
    assert not (root / ".quarantine").exists()


def test_the_index_holds_a_block_in_under_256_bytes() -> None:
    """Issue #13, item 5: 100,000 indexed blocks, keys included, measured with tracemalloc."""
    n = 100_000
    keys = [BlockKey(NS, hashlib.sha256(b"%d" % i).digest()) for i in range(n)]
    key_bytes = n * sys.getsizeof(keys[0])
    tracemalloc.start()
    try:
        index = BlockIndex()
        for i, key in enumerate(keys):
            index.add(key, SIZE * (1 + i % 4), 1_700_000_000 + i / 1000)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (used + key_bytes) / n <= 256
    assert index.lookup_digests(bytes(NS), [keys[5].digest, b"\0" * 32]) == [SIZE * 2, None]
    assert len(index) == n and index.bytes == sum(SIZE * (1 + i % 4) for i in range(n))


def test_a_forged_snapshot_claiming_huge_blocks_is_refused(tmp_path: Path) -> None:
    """A valid-checksum snapshot whose record claims 2**62 bytes (or a time that is not a number)
    would have the daemon allocate for it: refused whole, the headers are read instead."""
    d = posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        put(c, 0, 10)
    snap = blocks_root(d) / SNAPSHOT_NAME
    for size, stored in ((1 << 62, 1.0), (SIZE, float("nan"))):
        records = [bytes(NS) + k for k in index_keys(10)]
        _forge(snap, records, [size if j == 3 else SIZE for j in range(10)], [stored] * 10)
        with d.start(), UcmClient(d.target) as c:
            index_done(c)
            assert "(forged)" in d.log()
            check_all(c, range(10))
            alive(d, c)
            d.stop()
