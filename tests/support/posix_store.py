"""A real daemon over a Posix-only store, and the blocks the index and snapshot tests write to it.

Shared by the index tests (``tests/tiers/test_posix_index.py``) and the periodic snapshot tests
(``tests/tiers/test_posix_periodic_snapshot.py``): every block ``i`` has a payload derived from
``i``, so a test checks byte-exact loads of any block it knows the number of.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
from pathlib import Path

from support.blocks import NS
from ucm_client import UcmClient, key_digest
from ucm_protocol.keys import BlockKey
from ucm_server.store.format import FLAT_LAYOUT_VERSION, encode_header, payload_checksum
from ucm_server.store.posix import PosixTier, Profile
from ucm_server.testing.daemon import DaemonProcess

SIZE = 4096
POSIX_ONLY = ["--store-pipeline", "Posix"]


def posix_daemon(tmp_path: Path, *extra: str, name: str = "ucm") -> DaemonProcess:
    """A daemon (not started) whose only tier is Posix: restarts show what the files say."""
    return DaemonProcess(tmp_path / name, args=[*POSIX_ONLY, *extra])


def payload(i: int) -> bytes:
    """Block ``i``'s bytes: distinct per block, so a block served under another key shows."""
    return hashlib.sha256(b"%d" % i).digest() * (SIZE // 32)


def index_keys(n: int, first: int = 0) -> list[bytes]:
    """The digests of blocks ``first`` .. ``first + n - 1``."""
    return [key_digest("index", i) for i in range(first, first + n)]


def blocks_root(d: DaemonProcess) -> Path:
    return d.data_dir / "blocks"


def plant(d: DaemonProcess, first: int, n: int) -> None:
    """Write ``n`` block files the way the daemon writes buffered ones (fast: no fsync, no daemon)."""
    tier = PosixTier(roots=[blocks_root(d)])
    for i in range(first, first + n):
        key = BlockKey(NS, key_digest("index", i))
        data = payload(i)
        path = tier.path_of(key)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        header = encode_header(key, SIZE, payload_checksum([memoryview(data)]), version=FLAT_LAYOUT_VERSION)
        path.write_bytes(header + data)


def put(c: UcmClient, first: int, n: int) -> None:
    """Dump blocks ``first`` .. ``first + n - 1`` through the daemon (acknowledged durable)."""
    for start in range(first, first + n, 256):
        count = min(256, first + n - start)
        items = [(k, payload(start + j)) for j, k in enumerate(index_keys(count, start))]
        assert c.put_blocks(NS, items).ok


def index_done(c: UcmClient, timeout_s: float = 120.0) -> dict[str, float]:
    """The Posix tier's stats once background indexing has ended (its progress keys gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        tier = next(t for t in c.stats().tiers if t.kind == "Posix")
        if "index_adopting" not in tier.extra:
            return {"blocks": float(tier.blocks), **dict(tier.extra)}
        assert time.monotonic() < deadline, f"indexing did not end: {dict(tier.extra)}"
        time.sleep(0.05)


def check_all(c: UcmClient, present: range, absent: range = range(0)) -> None:
    """Every block in ``present`` is reported and loads byte-exact; none in ``absent`` is served."""
    numbers = list(present)
    keys = [key_digest("index", i) for i in numbers]
    assert all(c.lookup(NS, keys).present)
    for start in range(0, len(keys), 512):
        got = c.get_blocks(NS, keys[start : start + 512])
        for j, data in enumerate(got):
            assert data == payload(numbers[start + j])
    if absent:
        gone = index_keys(len(absent), absent.start)
        assert not any(c.lookup(NS, gone).present)
        assert c.get_blocks(NS, gone) == [None] * len(gone)


def alive(d: DaemonProcess, c: UcmClient) -> None:
    """The daemon still answers and stores: one fresh block round-trips."""
    assert d.healthy()
    key = key_digest("alive", random.randrange(1 << 30))
    assert c.put_blocks(NS, [(key, b"x" * SIZE)]).ok
    assert c.get_blocks(NS, [key]) == [b"x" * SIZE]


class DumpsUntilKilled:
    """Blocks ``first``, ``first + 1``, ... dumped ``batch`` at a time from a thread of its own until
    :meth:`kill` SIGKILLs the daemon under them. ``durable`` holds every block acknowledged. A
    failure before the kill (a refused dump, a timeout, an error) is the test's failure; after it,
    the daemon's death is what ends the thread."""

    def __init__(self, d: DaemonProcess, first: int, batch: int) -> None:
        self.durable: list[int] = []
        self.errors: list[str] = []
        self._killed = threading.Event()
        self._thread = threading.Thread(target=self._dump, args=(d, first, batch))
        self._thread.start()

    def _dump(self, d: DaemonProcess, first: int, batch: int) -> None:
        try:
            with UcmClient(d.target, rpc_timeout_s=30) as c:
                i = first
                while not self._killed.is_set():
                    result = c.put_blocks(
                        NS, [(k, payload(i + j)) for j, k in enumerate(index_keys(batch, i))]
                    )
                    if not result.ok:
                        raise AssertionError(f"blocks {i} .. {i + batch - 1} refused: {result}")
                    self.durable.extend(range(i, i + batch))
                    i += batch
        except Exception as exc:
            if not self._killed.is_set():
                self.errors.append(repr(exc))

    def kill(self, d: DaemonProcess) -> None:
        """SIGKILL the daemon while the dumps run; the thread must then end, every dump before the
        kill must have been acknowledged, and at least one was."""
        self._killed.set()
        d.kill()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the dumping thread did not end after the kill"
        assert self.errors == [], self.errors
        assert self.durable, "no dump was acknowledged before the kill"


class FileSizeLimitedDaemon(DaemonProcess):
    """The daemon under ``prlimit --fsize``: writing past the limit fails with EFBIG, a real refusal
    standing in for a full disk (ENOSPC) that a test cannot cause without its own file system."""

    def command(self) -> list[str]:
        return ["prlimit", f"--fsize={64 << 10}", *super().command()]


def previous_release_sizes(root: Path, n: int) -> list[int | None]:
    """Blocks 0 .. ``n - 1`` as a release without index snapshots sees them: its start-up scan (kept
    as the DS3FS path) over ``root``, checked to quarantine and skip nothing."""

    async def read() -> list[int | None]:
        tier = PosixTier(roots=[root], profile=Profile(index_snapshots=False))
        await tier.open()
        sizes = await tier.lookup([BlockKey(NS, k) for k in index_keys(n)])
        stats = tier.stats()
        assert stats.corrupt == 0 and "skipped_files" not in stats.extra
        await tier.close()
        return sizes

    return asyncio.run(read())
