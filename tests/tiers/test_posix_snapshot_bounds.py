"""Forged index snapshots, as an attacker who can write into the data directory would plant them.

A snapshot is checked against what can be known before it is read (its size against its record
count, the count against what the root can hold), then its values and checksum in chunks, and only
then built into the index: a forged one costs the daemon no more memory than a trusted one, and it
falls back to re-adopting its files. Meanwhile no stored block answers missing: a Lookup or Load of
a block not indexed yet is answered from its file. A real daemon over 20,000 block files; its peak
resident memory is read from ``/proc/<pid>/status`` (VmHWM).
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.blocks import NS
from support.posix_store import SIZE, blocks_root, index_done, index_keys, payload, plant, posix_daemon

from ucm_client import UcmClient, key_digest
from ucm_server.store.posix.index_snapshot import MARKER_NAME, SNAPSHOT_NAME
from ucm_server.testing.daemon import DaemonProcess

N = 20_000
CAPACITY = 128 << 20  # room for the 80 MiB of blocks, not for what the forgeries claim
HEAD = struct.Struct("<8sII16sQ")
MEMORY_SLACK = 64 << 20
"""What a refused snapshot may cost beyond a trusted one's start: its chunks, never its size."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, int]]:
    """The daemon over N planted blocks, and its peak memory over a start from a trusted snapshot."""
    args = [
        "--posix-capacity",
        str(CAPACITY),
        "--posix-index-wait-s",
        "0",
        "--posix-snapshot-interval-s",
        "0",
    ]
    d = posix_daemon(tmp_path_factory.mktemp("bounds"), *args)  # no periodic base: a forgery re-adopts
    plant(d, 0, N)
    with d, UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == N  # then stopped cleanly: a trusted snapshot and its marker
    with d, UcmClient(d.target) as c:
        assert index_done(c)["blocks"] == N and f"{N} from snapshots" in d.log()
        trusted = _peak_memory(d)
    yield d, trusted


def _peak_memory(d: DaemonProcess) -> int:
    assert d.proc is not None
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _epoch(root: Path) -> bytes:
    return (root / MARKER_NAME).read_bytes()


def huge(root: Path) -> str:
    """2 GiB whose head promises as many records as that size holds (sparse: no disk is used): more
    block files than the filesystem holds files, refused unread."""
    count = ((2 << 30) - HEAD.size - 32) // 64
    with (root / SNAPSHOT_NAME).open("wb") as f:
        f.write(HEAD.pack(b"UCMISNAP", 1, 48, _epoch(root), count))
        f.truncate(HEAD.size + count * 64 + 32)
    return "this root can hold at most"


def lying_count(root: Path) -> str:
    """A head claiming 2**40 records in a file of 1 MiB."""
    with (root / SNAPSHOT_NAME).open("wb") as f:
        f.write(HEAD.pack(b"UCMISNAP", 1, 48, _epoch(root), 1 << 40))
        f.truncate(1 << 20)
    return "(torn)"


def junk(root: Path) -> str:
    """320 MiB of 4M packed-format records with plausible sizes and times (what a count within
    every bound and a field-by-field check lets through) and a checksum that does not match."""
    count, step = 4 << 20, 1 << 20
    with (root / SNAPSHOT_NAME).open("wb") as f:
        f.write(HEAD.pack(b"UCMISNAP", 2, 48, _epoch(root), count))
        for _ in range(count // step):
            f.write(os.urandom(48 * step))
        for column in (array("Q", [1]), array("d", [1.7e9]), array("Q", [0]), array("Q", [0])):
            for _ in range(count // step):
                f.write((column * step).tobytes())
        f.write(os.urandom(32))
    return "checksum mismatch"


def over_capacity(root: Path) -> str:
    """A whole, checksummed snapshot of 50,000 blocks of 4 KiB: more than the tier's capacity."""
    count = 50_000
    keys = b"".join(bytes(NS) + hashlib.sha256(b"forged%d" % i).digest() for i in range(count))
    body = HEAD.pack(b"UCMISNAP", 1, 48, _epoch(root), count) + keys
    body += (array("Q", [SIZE]) * count).tobytes() + (array("d", [1.7e9]) * count).tobytes()
    (root / SNAPSHOT_NAME).write_bytes(body + hashlib.sha256(body).digest())
    return "more than the tier's capacity"


@pytest.mark.parametrize("forge", [huge, lying_count, junk, over_capacity], ids=lambda f: f.__name__)
def test_a_forged_snapshot_costs_no_memory_and_no_block_answers_missing(
    store: tuple[DaemonProcess, int], forge: Callable[[Path], str]
) -> None:
    d, trusted = store
    root = blocks_root(d)
    if not (root / MARKER_NAME).exists():  # a case before failed mid-way: start from a clean stop
        with d, UcmClient(d.target) as c:
            index_done(c)
    logged = forge(root)
    keys = index_keys(N)
    at = d.log_path.stat().st_size
    with d, UcmClient(d.target) as c:
        posix = next(t for t in c.stats().tiers if t.kind == "Posix")
        assert "index_adopting" in posix.extra, "re-adoption ended before the first question"
        present = c.lookup(NS, keys).present  # answered from the files where not indexed yet
        sample = list(range(0, N, 97))
        got = c.get_blocks(NS, [keys[i] for i in sample])
        assert [i for i, p in enumerate(present) if not p] == []
        assert got == [payload(i) for i in sample]
        assert index_done(c)["blocks"] == N
        log = _log_since(d, at)
        assert logged in log and "from block headers" in log and "indexed from snapshots" not in log, log
        peak = _peak_memory(d)
        assert peak <= trusted + MEMORY_SLACK, (
            f"peak {peak >> 20} MiB, {trusted >> 20} MiB from a trusted one"
        )
        fresh = key_digest("fresh", 0)  # still stores (removed again: the next case counts N)
        assert c.put_blocks(NS, [(fresh, b"x" * SIZE)]).ok and c.get_blocks(NS, [fresh]) == [b"x" * SIZE]
        assert c.delete(NS, [fresh]) == 1


def _log_since(d: DaemonProcess, at: int) -> str:
    with d.log_path.open("rb") as f:
        f.seek(at)
        return f.read().decode(errors="replace")
