"""Issue #13, item 1: periodic index snapshots, the base a start after ``kill -9`` loads at once.

Against a real daemon process: after a SIGKILL the next start loads the newest periodic snapshot,
then sweeps the block files (adding blocks stored after it, dropping those deleted since). A kill at
any point of a periodic write, a torn, stale or forged periodic snapshot and a disk that refuses
the write must all leave a store where every block Lookup reports loads byte-exact, every block
acknowledged durable is found, and nothing deleted or never stored is served.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
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

from ucm_client import UcmClient, key_digest
from ucm_server.store.posix import index_snapshot
from ucm_server.store.posix.index_snapshot import PERIODIC_MARKER, PERIODIC_PREFIX
from ucm_server.testing.daemon import DaemonProcess

MAX_BLOCK = 1 << 30


def _every(seconds: float) -> tuple[str, str]:
    return ("--posix-snapshot-interval-s", str(seconds))


def _tier(c: UcmClient) -> dict[str, float]:
    tier = next(t for t in c.stats().tiers if t.kind == "Posix")
    return {"blocks": float(tier.blocks), "bytes": float(tier.bytes), **dict(tier.extra)}


def _wait_snapshot(c: UcmClient, blocks: int, timeout_s: float = 60.0) -> dict[str, float]:
    """The tier's stats once a periodic snapshot of exactly ``blocks`` blocks has been written."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _tier(c)
        if stats.get("index_snapshot_blocks") == blocks:
            return stats
        assert time.monotonic() < deadline, f"no periodic snapshot of {blocks} blocks: {stats}"
        time.sleep(0.05)


def _on_disk(root: Path) -> set[bytes]:
    """The keys of the periodic snapshot the marker names (it must be whole: checked in full)."""
    return set(index_snapshot.read_periodic(root, MAX_BLOCK).keys)


def _generations(root: Path) -> list[Path]:
    return [
        p
        for p in root.iterdir()
        if p.name.startswith(PERIODIC_PREFIX) and p.name[len(PERIODIC_PREFIX) :].isdigit()
    ]


def _log_at(d: DaemonProcess) -> int:
    """Where the daemon's log ends now: :func:`_log_since` reads what a start after this wrote."""
    return d.log_path.stat().st_size if d.log_path.exists() else 0


def _log_since(d: DaemonProcess, at: int) -> str:
    with d.log_path.open("rb") as f:
        f.seek(at)
        return f.read().decode(errors="replace")


def _full(i: int) -> bytes:
    return bytes(NS) + key_digest("index", i)


def test_kill_9_after_a_periodic_snapshot_loads_it_then_sweeps(tmp_path: Path) -> None:
    """Blocks dumped after the snapshot are found, blocks deleted after it are never served (not
    even while the snapshot still lists them), and the snapshot's figures are in the stats."""
    d = posix_daemon(tmp_path, *_every(5))
    d.start()
    began = time.time()
    with UcmClient(d.target) as c:
        put(c, 0, 300)
        stats = _wait_snapshot(c, 300)
        assert began <= stats["index_snapshot_at"] <= time.time()
        assert 0 <= stats["index_snapshot_age_s"] < 5 and stats["index_snapshot_duration_s"] > 0
        assert stats["index_snapshot_stall_s"] >= 0 and stats["index_snapshot_failures"] == 0
        put(c, 300, 100)
        assert c.delete(NS, index_keys(20)) == 20
        assert _tier(c)["index_snapshots_written"] == stats["index_snapshots_written"]  # still stale
    d.kill()
    root = blocks_root(d)
    at = _log_at(d)
    listed = _on_disk(root)
    assert {_full(i) for i in range(20)} <= listed and _full(350) not in listed  # stale on both counts
    assert not (root / index_snapshot.MARKER_NAME).exists()  # no clean shutdown
    with d.start(), UcmClient(d.target) as c:
        # Listed, deleted: never served. Only half are read (a read forgets a missing file): the
        # sweep must drop the other half.
        assert c.get_blocks(NS, index_keys(10)) == [None] * 10
        assert index_done(c)["blocks"] == 380
        check_all(c, range(20, 400), absent=range(20))
        log = _log_since(d, at)
        assert "300 blocks indexed from snapshots" in log and "from its periodic snapshot" in log
        assert "20 blocks a snapshot listed are gone from disk" in log
        alive(d, c)
        d.stop()


@pytest.mark.parametrize("interval", [1.0, 0.0])
def test_a_crash_soon_after_a_clean_restart_finds_the_clean_snapshot(tmp_path: Path, interval: float) -> None:
    """The clean snapshot a start loads becomes the newest periodic generation (a rename), so a
    crash before the next periodic write still restarts from it; with periodic snapshots off
    (negative control) the same crash leaves no snapshot to trust and every header is read."""
    d = posix_daemon(tmp_path, *_every(interval))
    with d, UcmClient(d.target) as c:
        put(c, 0, 200)
    root = blocks_root(d)
    d.start()
    with UcmClient(d.target) as c:
        index_done(c)
    d.kill()
    assert (root / index_snapshot.SNAPSHOT_NAME).exists() is not bool(interval)
    at = _log_at(d)
    with d.start(), UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == 200
        check_all(c, range(200))
        d.stop()
    log = _log_since(d, at)  # the start after the crash
    if interval:
        assert len(_generations(root)) == 1 and "200 blocks indexed from snapshots" in log
    else:
        assert "from block headers (no clean-shutdown marker)" in log and not _generations(root)


def test_kill_9_at_random_points_of_periodic_writes_never_leaves_a_torn_base(tmp_path: Path) -> None:
    """Dumps keep the index changing while snapshots of 20,000+ blocks are written every 50 ms;
    SIGKILL at random moments (fixed seed), every other time as soon as a periodic write's
    temporary file shows (mid-write). Each time the periodic marker names a whole file (or there
    is none), and the next start finds every acknowledged block byte-exact."""
    n = 20_000
    d = posix_daemon(tmp_path, *_every(0.05))
    plant(d, 0, n)
    root = blocks_root(d)
    rng = random.Random(2026)
    durable: list[int] = []
    next_block = n
    interrupted = seen_writing = 0
    for attempt in range(6):
        d.start()
        dumps = DumpsUntilKilled(d, next_block, 8)
        time.sleep(rng.uniform(0.5, 2.0))
        if attempt % 2:
            seen_writing += _wait_for_a_write(root, rng)
        dumps.kill(d)
        durable += dumps.durable
        next_block = max([next_block, *durable]) + 64
        interrupted += any(".tmp." in p.name for p in root.iterdir())
        if (root / PERIODIC_MARKER).exists():
            assert len(_on_disk(root)) >= n  # whole (else read_periodic raises), and not empty
    with d.start(), UcmClient(d.target) as c:
        index_done(c)
        check_all(c, range(0, n, 41))
        for start in range(0, len(durable), 512):
            numbers = durable[start : start + 512]
            got = c.get_blocks(NS, [key_digest("index", i) for i in numbers])
            assert got == [payload(i) for i in numbers]
        candidates = index_keys(next_block - n, n)
        present = c.lookup(NS, candidates).present
        reported = [k for k, p in zip(candidates, present, strict=True) if p]
        for key, data in zip(reported, c.get_blocks(NS, reported), strict=True):
            assert data == payload(n + candidates.index(key))
        alive(d, c)
        d.stop()
    assert seen_writing >= 1  # at least one kill landed while a periodic snapshot was written
    print(f"kills during a periodic write: {seen_writing} seen, {interrupted} left a temporary file")


def _wait_for_a_write(root: Path, rng: random.Random, timeout_s: float = 10.0) -> bool:
    """Return as soon as a periodic write's temporary file is in ``root`` (after 0-3 ms more), or
    False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.name.startswith(PERIODIC_PREFIX) and ".tmp." in p.name for p in root.iterdir()):
            time.sleep(rng.uniform(0, 0.003))
            return True
    return False


def _crash_with_a_periodic_snapshot(d: DaemonProcess, blocks: int, *, dump: int = 0) -> None:
    """Start, dump blocks 0 .. ``dump - 1``, wait for a periodic snapshot of ``blocks`` blocks,
    then SIGKILL (no clean snapshot: the periodic one is what the next start finds)."""
    d.start()
    with UcmClient(d.target) as c:
        put(c, 0, dump)
        _wait_snapshot(c, blocks)
    d.kill()


def _generation(root: Path) -> Path:
    (newest,) = _generations(root)
    return newest


def _forge(root: Path, keys: list[bytes], sizes: list[int]) -> None:
    """A periodic generation in the version-1 columns with a valid checksum, and its marker."""
    head = struct.pack("<8sII16sQ", b"UCMISNAP", 1, 48, b"F" * 16, len(keys))
    times = [1.0] * len(keys)
    body = (
        head + b"".join(keys) + struct.pack(f"<{len(keys)}Q", *sizes) + struct.pack(f"<{len(keys)}d", *times)
    )
    (root / f"{PERIODIC_PREFIX}7").write_bytes(body + hashlib.sha256(body).digest())
    (root / PERIODIC_MARKER).write_bytes(struct.pack("<16sQ", b"F" * 16, 7))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _replace_with_fifo(path: Path) -> None:
    """A FIFO where a file is expected: reading it would wait for a writer forever."""
    path.unlink()
    os.mkfifo(path)


def _replace_with_symlink(path: Path, target: Path) -> None:
    """``path`` becomes a symlink to ``target`` (a file of the data directory, not a snapshot)."""
    path.unlink()
    path.symlink_to(target)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40 + 5 * 48 + 1] ^= 0xFF  # a byte of the sixth record's size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "logged"),
    [
        (lambda root: _truncate(_generation(root)), "(torn)"),
        (lambda root: _flip(_generation(root)), "checksum mismatch"),
        (lambda root: (root / PERIODIC_MARKER).write_bytes(b"half a marker"), "periodic marker of 13 bytes"),
        (lambda root: _generation(root).unlink(), "cannot read"),
        (
            lambda root: (root / PERIODIC_MARKER).write_bytes(
                os.urandom(16) + (root / PERIODIC_MARKER).read_bytes()[16:]
            ),
            "its epoch is not its marker's",
        ),
        (lambda root: _replace_with_fifo(root / PERIODIC_MARKER), "not a regular file (fifo)"),
        (
            lambda root: _replace_with_symlink(_generation(root), root / PERIODIC_MARKER),
            "not a regular file (symlink)",
        ),
    ],
    ids=[
        "torn-file",
        "flipped-byte",
        "torn-marker",
        "missing-file",
        "foreign-marker",
        "fifo-marker",
        "symlinked-file",
    ],
)
def test_a_damaged_periodic_snapshot_is_never_trusted(
    tmp_path: Path, damage: Callable[[Path], object], logged: str
) -> None:
    d = posix_daemon(tmp_path, *_every(0.2))
    _crash_with_a_periodic_snapshot(d, 120, dump=120)
    damage(blocks_root(d))
    at = _log_at(d)
    with d.start(), UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == 120
        log = _log_since(d, at)
        assert logged in log and "from block headers" in log and "indexed from snapshots" not in log
        check_all(c, range(120))
        alive(d, c)
        d.stop()


def test_an_interrupted_write_leaves_the_previous_generation(tmp_path: Path) -> None:
    """A crash mid-write leaves a temporary file and the marker still naming the previous
    generation: that one is loaded, the temporary file is removed, never read."""
    d = posix_daemon(tmp_path, *_every(0.2))
    _crash_with_a_periodic_snapshot(d, 100, dump=100)
    root = blocks_root(d)
    torn = root / f"{PERIODIC_PREFIX}{time.time_ns()}.tmp.0123456789ab"
    torn.write_bytes(_generation(root).read_bytes()[:500])
    os.utime(torn, (time.time() - 60, time.time() - 60))
    at = _log_at(d)
    with d.start(), UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == 100
        assert "100 blocks indexed from snapshots" in _log_since(d, at)
        check_all(c, range(100))
        d.stop()
    assert not torn.exists()


def test_a_stale_or_forged_periodic_snapshot_serves_nothing_wrong(tmp_path: Path) -> None:
    """An old generation put back with its marker (a restored backup) and a forgery with a valid
    checksum (wrong sizes, blocks never stored): Lookup may report what the file lists until the
    sweep ends; no Load returns wrong bytes, and after the sweep only what is on disk is indexed."""
    d = posix_daemon(tmp_path, *_every(0.2))
    _crash_with_a_periodic_snapshot(d, 100, dump=100)
    root = blocks_root(d)
    old = {p.name: p.read_bytes() for p in [root / PERIODIC_MARKER, _generation(root)]}
    d.start()
    with UcmClient(d.target) as c:
        put(c, 100, 100)
        assert c.delete(NS, index_keys(30)) == 30
        _wait_snapshot(c, 170)
    d.kill()
    for path in _generations(root):
        path.unlink()
    for name, data in old.items():
        (root / name).write_bytes(data)
    with d.start(), UcmClient(d.target) as c:
        assert c.get_blocks(NS, index_keys(10)) == [None] * 10  # the rest is left to the sweep
        assert index_done(c)["blocks"] == 170
        check_all(c, range(30, 200), absent=range(30))
        d.kill()
    for path in _generations(root):
        path.unlink()
    never = [bytes(NS) + key_digest("never", i) for i in range(40)]
    _forge(root, [_full(i) for i in range(30, 200)] + never, [SIZE * 3] * 210)
    with d.start(), UcmClient(d.target) as c:
        assert c.get_blocks(NS, [k[16:] for k in never[:20]]) == [None] * 20
        assert index_done(c)["blocks"] == 170
        assert not any(c.lookup(NS, [k[16:] for k in never]).present)  # dropped by the sweep
        assert _tier(c)["bytes"] == 170 * SIZE  # the files' sizes, not the forged ones
        check_all(c, range(30, 200), absent=range(30))
        alive(d, c)
        d.stop()


def test_a_periodic_snapshot_the_disk_refuses__efbig_stand_in_for_enospc(tmp_path: Path) -> None:
    """The disk refuses a periodic snapshot (``prlimit --fsize``: EFBIG where a full disk says
    ENOSPC): logged and counted, the daemon keeps serving, the previous generation stays named and
    whole, no partial file is left, and the next start is correct."""
    d = posix_daemon(tmp_path, *_every(0.2))
    plant(d, 0, 500)  # a 32 KiB snapshot: under the limit
    _crash_with_a_periodic_snapshot(d, 500)
    plant(d, 500, 2000)  # with them a 160 KiB snapshot: over it, while each block file is under it
    limited = FileSizeLimitedDaemon(d.workdir, args=[*POSIX_ONLY, *_every(0.2)])
    limited.start()
    with UcmClient(limited.target) as c:
        assert index_done(c)["blocks"] == 2500
        deadline = time.monotonic() + 30
        while _tier(c).get("index_snapshot_failures", 0) < 2:  # tried, refused, tried again
            assert time.monotonic() < deadline, _tier(c)
            time.sleep(0.05)
        put(c, 2500, 10)
        check_all(c, range(0, 2510, 7))
        alive(limited, c)
        assert _tier(c)["index_snapshots_written"] == 0
    limited.kill()
    assert "periodic index snapshot not written" in limited.log()
    root = blocks_root(d)
    assert len(_on_disk(root)) == 500 and len(_generations(root)) == 1  # the previous generation
    assert not [p for p in root.iterdir() if ".tmp." in p.name]  # the partial file is removed
    at = _log_at(d)
    with d.start(), UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == 2511
        assert "500 blocks indexed from snapshots" in _log_since(d, at)
        check_all(c, range(2510))
        d.stop()


def test_releases_without_periodic_snapshots_ignore_their_files(tmp_path: Path) -> None:
    """A downgrade: the scan of releases without snapshots (the DS3FS path) and this release with
    periodic snapshots off both read the block files, take the periodic files for no block and
    remove nothing."""
    d = posix_daemon(tmp_path, *_every(0.2))
    _crash_with_a_periodic_snapshot(d, 64, dump=64)
    root = blocks_root(d)
    before = {p.name for p in root.iterdir()}
    assert PERIODIC_MARKER in before

    assert previous_release_sizes(root, 64) == [SIZE] * 64
    assert {p.name for p in root.iterdir()} == before and not (root / ".quarantine").exists()
    off = DaemonProcess(d.workdir, args=[*POSIX_ONLY, *_every(0)])
    at = _log_at(off)
    off.start()
    with UcmClient(off.target) as c:
        assert index_done(c)["blocks"] == 64
        check_all(c, range(64))
    off.kill()
    log = _log_since(off, at)
    assert "from block headers" in log and "indexed from snapshots" not in log
    assert {PERIODIC_MARKER, _generation(root).name} <= {p.name for p in root.iterdir()}


def test_admin_stats_and_metrics_show_the_periodic_snapshot(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, *_every(0.2), "--metrics-address", "127.0.0.1:0")
    with d, UcmClient(d.target) as c:
        put(c, 0, 50)
        _wait_snapshot(c, 50)
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
        shown = subprocess.run(
            [sys.executable, "-m", "ucm_client.admin", "--socket", str(d.socket), "--json", "stats"],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        posix = next(t for t in json.loads(shown.stdout)["tiers"] if t["kind"] == "Posix")
        assert (
            posix["extra"]["index_snapshot_blocks"] == 50 and posix["extra"]["index_snapshot_failures"] == 0
        )
        port = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())
        assert port is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5).read().decode()
        assert re.search(r'ucm_tier_index_snapshot_blocks\{kind="Posix",tier="Posix"\} 50\.0', text)
        assert re.search(r'ucm_tier_index_snapshot_age_s\{kind="Posix",tier="Posix"\} [0-9.]+', text)
        assert "ucm_tier_index_snapshot_failures" in text


def test_a_periodic_snapshot_is_written_only_when_the_index_changed(tmp_path: Path) -> None:
    """Idle, the daemon does not rewrite the same index every interval; a deletion is a change."""
    d = posix_daemon(tmp_path, *_every(0.2))
    with d, UcmClient(d.target) as c:
        put(c, 0, 30)
        written = _wait_snapshot(c, 30)["index_snapshots_written"]
        root = blocks_root(d)
        generation = _generation(root).name
        c.get_blocks(NS, index_keys(30))  # reads change the LRU order, not what is stored
        time.sleep(1.5)  # seven intervals
        assert _tier(c)["index_snapshots_written"] == written and _generation(root).name == generation
        assert c.delete(NS, index_keys(1)) == 1
        assert _wait_snapshot(c, 29)["index_snapshots_written"] == written + 1
        assert _generation(root).name != generation  # a new generation; the old one removed
