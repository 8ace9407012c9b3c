"""Bytes that passed through client memory are never trusted afterwards.

Before the fix the daemon read a lower-tier block into the client's destination, checked its checksum
there and promoted it into the Cache from there. A client loading two blocks into the same bytes, or
two loads racing into one buffer (a racing vLLM worker can), then made it (a) quarantine good block
files (the checksum failed in client memory) and (b) promote block B's bytes under key A, so every later
reader got B's bytes with status OK. A client rewriting its buffer during a dump made it store a file
whose checksum did not match its payload, quarantined at the next read.

These tests attack that as a careless or hostile client would, against a real daemon:

* overlapping destinations inside one Load are refused with INVALID_ARGUMENT before anything is copied;
* a randomized race (fixed seed, ``UCM_FUZZ_SECONDS`` per pipeline, default 5) of two clients loading
  into one shared buffer while dumps run, some from a buffer being scribbled on, on ``Cache|Posix`` with
  a Cache far smaller than the data and on ``Posix`` alone. Every block content is made of 4 KiB chunks
  that name their key and position, so each OK load's destination is checked right after it returns:
  every chunk must be that key's, unless a load by the other client that overlapped in time and space
  put its own (correct) chunk there. Afterwards nothing is quarantined and every key loads exactly
  right into a private buffer; scribbled dumps load OK too (a consistent block, whatever the bytes).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.blocks import NS

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import InvalidArgument
from ucm_client.types import BlockState
from ucm_server.testing.daemon import DaemonProcess

CHUNK = 4096
BLOCK = 16 * CHUNK
NKEYS = 40
SHARED = 24 * BLOCK
SEED = 20261201
FUZZ_SECONDS = float(os.environ.get("UCM_FUZZ_SECONDS", "5"))


def _chunk(key: int, index: int) -> bytes:
    rnd = random.Random(key * 7919 + index)
    head = f"key {key:04d} chunk {index:02d} ".encode()
    return head + rnd.randbytes(CHUNK - len(head))


CONTENT = {k: b"".join(_chunk(k, i) for i in range(BLOCK // CHUNK)) for k in range(NKEYS)}
WHO = {_chunk(k, i): (k, i) for k in range(NKEYS) for i in range(BLOCK // CHUNK)}


def _key(k: int) -> bytes:
    return key_digest("no-wrong-bytes", k)


def _garbage_key(g: int) -> bytes:
    return key_digest("no-wrong-bytes", "scribbled", g)


def _daemon(tmp_path: Path, pipeline: str) -> DaemonProcess:
    # A Cache of 8 blocks for 40 keys: most loads come from the Posix tier and are promoted.
    # "+packs": the Posix tier writes a dump's blocks into pack files (posix_pack_max_block_bytes).
    pipeline, packs = pipeline.removesuffix("+packs"), pipeline.endswith("+packs")
    args = ["--store-pipeline", pipeline, "--cache-capacity", f"{8 * BLOCK}", "--cache-page-size", "64KiB"]
    args += ["--posix-pack-max-block-bytes", str(BLOCK) if packs else "0"]  # else one file per block
    return DaemonProcess(tmp_path / "ucm", args=args, env={"UCM_DURABLE": "false"})


def _quarantined(d: DaemonProcess) -> list[Path]:
    return [p for q in d.data_dir.rglob(".quarantine") for p in q.iterdir()]


def _store_all(c: UcmClient, buf: SharedBuffer, region: int) -> None:
    for k in range(NKEYS):
        buf.buf[k * BLOCK : (k + 1) * BLOCK] = CONTENT[k]
    blocks = [BlockIO(_key(k), (Segment(region, k * BLOCK, BLOCK),)) for k in range(NKEYS)]
    assert c.wait(c.dump(NS, blocks, wait_durable=True), 60).ok


def _check_private(c: UcmClient, buf: SharedBuffer, region: int, keys: list[int]) -> None:
    """Load ``keys`` into memory nobody else touches: status OK and exactly the dumped bytes."""
    buf.buf[: len(keys) * BLOCK] = bytes(len(keys) * BLOCK)
    blocks = [BlockIO(_key(k), (Segment(region, j * BLOCK, BLOCK),)) for j, k in enumerate(keys)]
    r = c.wait(c.load(NS, blocks), 60)
    assert r.ok, f"private load of {keys}: {r.states} {r.reasons}"
    for j, k in enumerate(keys):
        got = bytes(buf.buf[j * BLOCK : (j + 1) * BLOCK])
        assert got == CONTENT[k], f"key {k} loaded with status OK but holds other bytes"


@pytest.fixture
def private() -> Iterator[SharedBuffer]:
    with SharedBuffer(NKEYS * BLOCK) as buf:
        yield buf


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix"])
@pytest.mark.slow
def test_overlapping_destinations_in_one_load_are_refused(
    tmp_path: Path, pipeline: str, private: SharedBuffer
) -> None:
    with _daemon(tmp_path, pipeline) as d, UcmClient(d.target) as c, SharedBuffer(4 * BLOCK) as buf:
        _store_all(c, private, c.register(private))
        region = c.register(buf)
        buf.buf[:] = b"\x5a" * len(buf.buf)
        two_blocks = [
            BlockIO(_key(0), (Segment(region, 0, BLOCK),)),
            BlockIO(_key(1), (Segment(region, BLOCK // 2, BLOCK),)),
        ]
        with pytest.raises(InvalidArgument, match=r"blocks 0 and 1: destination segments .* overlap"):
            c.load(NS, two_blocks)
        same_bytes = [BlockIO(_key(k), (Segment(region, 0, BLOCK),)) for k in (2, 3, 4)]
        with pytest.raises(InvalidArgument, match=r"blocks 0 and 1: .* overlap"):
            c.load(NS, same_bytes)
        one_block = [BlockIO(_key(5), (Segment(region, 0, BLOCK // 2), Segment(region, CHUNK, BLOCK // 2)))]
        with pytest.raises(InvalidArgument, match=r"block 0: destination segments \[0, 32768\) and "):
            c.load(NS, one_block)
        assert bytes(buf.buf) == b"\x5a" * len(buf.buf), "a refused load copied something"
        # Segments that only touch are fine, and a Dump may read the same bytes twice.
        halves = (Segment(region, 0, BLOCK // 2), Segment(region, BLOCK // 2, BLOCK // 2))
        touching = [BlockIO(_key(6), halves)]
        assert c.wait(c.load(NS, touching), 30).ok
        assert bytes(buf.buf[:BLOCK]) == CONTENT[6]
        twice = [BlockIO(key_digest("twice", i), (Segment(region, 0, BLOCK),)) for i in range(2)]
        assert c.wait(c.dump(NS, twice), 30).ok
        assert d.healthy()
        assert not _quarantined(d)


def test_overlap_check_is_per_region(tmp_path: Path, private: SharedBuffer) -> None:
    """The same offsets in two different regions do not overlap."""
    with _daemon(tmp_path, "Cache|Posix") as d, UcmClient(d.target) as c:
        _store_all(c, private, c.register(private))
        with SharedBuffer(BLOCK) as a, SharedBuffer(BLOCK) as b:
            ra, rb = c.register(a), c.register(b)
            blocks = [BlockIO(_key(7), (Segment(ra, 0, BLOCK),)), BlockIO(_key(8), (Segment(rb, 0, BLOCK),))]
            assert c.wait(c.load(NS, blocks), 30).ok
            assert bytes(a.buf) == CONTENT[7] and bytes(b.buf) == CONTENT[8]
        assert d.healthy()


@dataclass
class _Op:
    thread: int
    key: int
    offset: int
    start: float
    end: float = float("inf")


class _Race:
    """Two clients loading into one shared buffer, with a shared log of their loads in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: list[_Op] = []
        self.failures: list[str] = []
        self.counts = {"checked": 0, "explained": 0, "refused": 0, "private": 0, "dumps": 0, "scribbled": 0}

    def begin(self, thread: int, blocks: list[tuple[int, int]]) -> list[_Op]:
        now = time.monotonic()
        ops = [_Op(thread, k, off, now) for k, off in blocks]
        with self.lock:
            self.ops.extend(ops)
        return ops

    def end(self, ops: list[_Op]) -> None:
        now = time.monotonic()
        with self.lock:
            for op in ops:
                op.end = now

    def explain(self, op: _Op, seen: bytes, until: float) -> None:
        """Each byte of an OK load is the key's own, or was put there by a load of the other client
        that overlapped it in time (copies are not atomic: a chunk may be torn between the two)."""
        with self.lock:
            others = [
                o
                for o in self.ops
                if o.thread != op.thread
                and o.start <= until
                and o.end >= op.start
                and o.offset < op.offset + BLOCK
                and op.offset < o.offset + BLOCK
            ]
        got = np.frombuffer(seen, dtype=np.uint8)
        covered = got == np.frombuffer(CONTENT[op.key], dtype=np.uint8)
        if covered.all():
            self.counts["checked"] += 1
            return
        for o in others:  # the other load's bytes, where they sit in our destination
            lo, hi = max(o.offset, op.offset), min(o.offset, op.offset) + BLOCK
            theirs = np.frombuffer(CONTENT[o.key], dtype=np.uint8)[lo - o.offset : hi - o.offset]
            covered[lo - op.offset : hi - op.offset] |= got[lo - op.offset : hi - op.offset] == theirs
        if not covered.all():
            at = int(np.flatnonzero(~covered)[0])
            chunk = seen[at // CHUNK * CHUNK : at // CHUNK * CHUNK + CHUNK]
            who = WHO.get(chunk)
            name = f"key {who[0]} chunk {who[1]}" if who else f"bytes of no block ({chunk[:24]!r})"
            self.failures.append(
                f"load of key {op.key} at {op.offset}: byte {at} is wrong; its chunk holds {name}; "
                f"{len(others)} concurrent loads overlapped it"
            )
            return
        self.counts["explained"] += 1
        self.counts["checked"] += 1


def _racer(
    race: _Race, n: int, target: str, shared: SharedBuffer, seconds: float, stop: threading.Event
) -> None:
    rnd = random.Random(SEED + n)
    slots = SHARED // CHUNK
    with UcmClient(target, client_name=f"racer-{n}") as c, SharedBuffer(8 * BLOCK) as mine:
        region, own = c.register(shared), c.register(mine)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set() and not race.failures:
            roll = rnd.random()
            if roll < 0.65:  # loads into the shared buffer, racing the other client
                count = rnd.randint(1, 4)
                starts = sorted(rnd.sample(range(0, slots - BLOCK // CHUNK, BLOCK // CHUNK // 2), count))
                picked = [(rnd.randrange(NKEYS), s * CHUNK) for s in starts]
                picked = [p for j, p in enumerate(picked) if j == 0 or p[1] >= picked[j - 1][1] + BLOCK]
                ops = race.begin(n, picked)
                blocks = [BlockIO(_key(k), (Segment(region, off, BLOCK),)) for k, off in picked]
                r = c.wait(c.load(NS, blocks), 60)
                seen = [bytes(shared.buf[op.offset : op.offset + BLOCK]) for op in ops]
                until = time.monotonic()
                race.end(ops)
                for op, state, got in zip(ops, r.states, seen, strict=True):
                    if state is BlockState.OK:
                        race.explain(op, got, until)
                    else:
                        race.failures.append(f"load of key {op.key}: {state.name} {r.reasons}")
            elif roll < 0.72:  # a Load naming the same bytes twice: refused whole
                off = rnd.randrange(0, slots - 2 * BLOCK // CHUNK) * CHUNK
                with pytest.raises(InvalidArgument, match="overlap"):
                    c.load(NS, [BlockIO(_key(k), (Segment(region, off + k * CHUNK, BLOCK),)) for k in (0, 1)])
                race.counts["refused"] += 1
            elif roll < 0.87:  # a private load: must be exactly right
                keys = rnd.sample(range(NKEYS), rnd.randint(1, 8))
                _check_private(c, mine, own, keys)
                race.counts["private"] += 1
            elif roll < 0.95:  # re-dump known contents (writes racing reads and promotions)
                keys = rnd.sample(range(NKEYS), 4)
                for j, k in enumerate(keys):
                    mine.buf[j * BLOCK : (j + 1) * BLOCK] = CONTENT[k]
                blocks = [BlockIO(_key(k), (Segment(own, j * BLOCK, BLOCK),)) for j, k in enumerate(keys)]
                assert c.wait(c.dump(NS, blocks), 60).ok
                race.counts["dumps"] += 1
            else:  # dump from a buffer this client keeps rewriting while the dump runs
                g = rnd.randrange(4)
                blocks = [BlockIO(_garbage_key(g), (Segment(own, 0, BLOCK),))]
                task = c.dump(NS, blocks)
                r = c.wait(task, 0)
                while not r.done:
                    at = rnd.randrange(0, BLOCK - 64)
                    mine.buf[at : at + 64] = rnd.randbytes(64)
                    r = c.wait(task, 0.0005)
                race.counts["scribbled"] += 1


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix", "Cache|Posix+packs", "Posix+packs"])
@pytest.mark.slow
def test_racing_loads_never_return_wrong_bytes_nor_quarantine(
    tmp_path: Path, pipeline: str, private: SharedBuffer
) -> None:
    with _daemon(tmp_path, pipeline) as d, UcmClient(d.target) as c, SharedBuffer(SHARED) as shared:
        own = c.register(private)
        _store_all(c, private, own)
        race, stop = _Race(), threading.Event()
        errors: list[BaseException] = []

        def run(n: int) -> None:
            try:
                _racer(race, n, d.target, shared, FUZZ_SECONDS, stop)
            except BaseException as exc:  # reported below, with the other thread stopped
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(FUZZ_SECONDS + 120)
        if errors:
            raise errors[0]
        assert not race.failures, race.failures[:5]
        assert race.counts["checked"] > 20, race.counts
        # Nothing good was quarantined, and every key still loads exactly right (Cache or disk).
        assert not _quarantined(d), _quarantined(d)
        for first in range(0, NKEYS, 8):
            _check_private(c, private, own, list(range(first, first + 8)))
        # Scribbled dumps stored their own garbage consistently: it loads OK, the same twice.
        for g in range(4):
            views = []
            for _ in range(2):
                r = c.wait(c.load(NS, [BlockIO(_garbage_key(g), (Segment(own, 0, BLOCK),))]), 30)
                if r.states == [BlockState.MISSING]:
                    break  # never dumped in this run
                assert r.ok, f"scribbled block {g}: {r.states} {r.reasons}"
                views.append(bytes(private.buf[:BLOCK]))
            assert len(set(views)) <= 1
        assert not _quarantined(d), _quarantined(d)
        assert d.healthy()


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix"])
@pytest.mark.slow
def test_two_clients_loading_into_the_same_bytes_never_quarantine(
    tmp_path: Path, pipeline: str, private: SharedBuffer
) -> None:
    """Two clients load different keys into the same 16 blocks of one buffer, round after round.
    Whatever the shared bytes end up holding, no good file is quarantined, no load fails, and every
    key still loads exactly right into memory nobody else touches."""
    rounds = 30
    with _daemon(tmp_path, pipeline) as d, UcmClient(d.target) as c, SharedBuffer(16 * BLOCK) as shared:
        own = c.register(private)
        _store_all(c, private, own)
        failures: list[str] = []

        def loader(keys: range) -> None:
            with UcmClient(d.target) as mine:
                region = mine.register(shared)
                blocks = [BlockIO(_key(k), (Segment(region, j * BLOCK, BLOCK),)) for j, k in enumerate(keys)]
                for _ in range(rounds):
                    r = mine.wait(mine.load(NS, blocks), 60)
                    if not r.ok:
                        failures.append(f"{r.states} {r.reasons}")

        threads = [threading.Thread(target=loader, args=(keys,)) for keys in (range(0, 16), range(16, 32))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        assert not _quarantined(d), _quarantined(d)
        for first in range(0, NKEYS, 8):
            _check_private(c, private, own, list(range(first, first + 8)))
        assert d.healthy()


@pytest.mark.parametrize("pipeline", ["Cache|Posix", "Posix"])
@pytest.mark.slow
def test_a_dump_of_memory_rewritten_meanwhile_stores_a_consistent_block(
    tmp_path: Path, pipeline: str
) -> None:
    """A client keeps rewriting a block while it is being dumped. It may store any mix of its bytes,
    but what is stored agrees with its checksum: it loads OK (from disk too) and nothing is
    quarantined. The block is larger than the Cache, so even ``Cache|Posix`` writes it down from a
    copy of the daemon's own rather than from the Cache."""
    big = 32 * BLOCK  # 2 MiB: more than the 8-block Cache
    with _daemon(tmp_path, pipeline) as d, UcmClient(d.target) as c:
        with SharedBuffer(big) as src, SharedBuffer(big) as dst:
            rs, rd = c.register(src), c.register(dst)
            rnd = random.Random(SEED)
            for g in range(6):
                src.buf[:] = rnd.randbytes(big)
                task = c.dump(NS, [BlockIO(_garbage_key(100 + g), (Segment(rs, 0, big),))])
                r = c.wait(task, 0)
                while not r.done:  # scribble all over the source until the dump is done
                    at = rnd.randrange(0, big - 4096)
                    src.buf[at : at + 4096] = rnd.randbytes(4096)
                    r = c.wait(task, 0.0002)
                assert r.ok, (r.states, r.reasons)
            for g in range(6):
                r = c.wait(c.load(NS, [BlockIO(_garbage_key(100 + g), (Segment(rd, 0, big),))]), 30)
                assert r.ok, f"a scribbled dump stored a block that does not load: {r.states} {r.reasons}"
        assert not _quarantined(d), _quarantined(d)
        assert d.healthy()
