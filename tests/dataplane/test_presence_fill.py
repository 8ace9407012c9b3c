"""A tier's report of many keys goes into the presence table in the background: never a false miss.

A snapshot's index installed at start-up (or what a tier holds when the first channel opens) is put
in the table a slice per pass of the event loop. Meanwhile the table must not answer at all (a key
not filled yet would read as missing where the RPC says present), and blocks stored or removed
meanwhile must end up as the tier holds them. In process: a real Posix tier's index and the real
presence tables, the changes made between the fill's slices; then through a real daemon restarted
on a snapshot, with a client reading the shared table while the fill runs.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from pathlib import Path

from support.dataplane import needs_native

from ucm_client import UcmClient, key_digest, namespace_id
from ucm_client.dataplane.table import Miss, TableView
from ucm_protocol.keys import BlockKey
from ucm_server.dataplane.presence import FILL_SLICE, Presence
from ucm_server.retention import RetentionTable
from ucm_server.store.format import FLAT_LAYOUT_VERSION, encode_header, payload_checksum
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.posix import PosixTier, index_snapshot
from ucm_server.store.posix.block_index import BlockIndex
from ucm_server.testing.daemon import DaemonProcess

pytestmark = needs_native
NS = b"F" * 16


def _answers(presence: Presence, digests: list[bytes]) -> tuple[int, bytearray] | Miss:
    table = presence.tables[""]
    return TableView(table.map, table.generation).lookup(NS, digests)


def test_blocks_stored_and_removed_between_the_slices_of_a_fill_end_up_as_the_tier_holds_them(
    tmp_path: Path,
) -> None:
    n = 5 * FILL_SLICE + 123
    rng = random.Random(7)

    async def run() -> None:
        tier = PosixTier(roots=[tmp_path])
        presence = Presence(Pipeline([tier]), RetentionTable(None), tenants=False, max_keys=1 << 20)
        presence.table("")  # the first channel: the tier reports its (empty) index, then every change
        index = tier._index
        keys = [NS + os.urandom(32) for _ in range(n)]
        stamp = index.stamp(4096, time.time())
        index.install(BlockIndex.build(keys, [stamp] * n), 4096 * n, keys)  # as a snapshot load does
        assert presence.fills, "a million-block report would hold the loop: it must fill in the background"
        assert _answers(presence, [keys[0][16:]]) is Miss.STALE, "a table being filled answered"
        held = set(keys)
        new = [NS + os.urandom(32) for _ in range(2000)]
        passes = 0
        while presence.fills:
            passes += 1
            for _ in range(40):  # removals ahead of the fill and behind it, stores, both in one pass
                key = rng.choice(keys)
                if rng.random() < 0.5 and key in held:
                    index.forget(key)
                    held.discard(key)
                    if rng.random() < 0.3:  # removed and stored again before the removal is flushed
                        index.add(BlockKey(key[:16], key[16:]), 4096, time.time())
                        held.add(key)
                elif key not in held:
                    index.add(BlockKey(key[:16], key[16:]), 4096, time.time())
                    held.add(key)
                fresh = new.pop()
                index.add(BlockKey(fresh[:16], fresh[16:]), 4096, time.time())
                held.add(fresh)
                keys.append(fresh)
            presence.refresh()
            assert not presence.fills or _answers(presence, [keys[0][16:]]) is Miss.STALE
            await asyncio.sleep(0)
        assert passes >= 5, f"the fill took {passes} passes of the loop: not sliced"
        await asyncio.sleep(0)  # the last removals' flush
        everything = sorted(set(keys))  # before the lease is renewed: sorting a million keys outlasts it
        presence.refresh()
        answer = _answers(presence, [k[16:] for k in everything])
        assert not isinstance(answer, Miss), answer
        got = {k for k, present in zip(everything, answer[1], strict=True) if present}
        assert got == held == {k for k in everything if k in index}
        await presence.close()

    asyncio.run(run())


def test_a_tier_cleared_during_a_fill_is_left_empty_in_the_table(tmp_path: Path) -> None:
    async def run() -> None:
        tier = PosixTier(roots=[tmp_path])
        presence = Presence(Pipeline([tier]), RetentionTable(None), tenants=False, max_keys=1 << 20)
        presence.table("")
        keys = [NS + os.urandom(32) for _ in range(3 * FILL_SLICE)]
        stamp = tier._index.stamp(10, time.time())
        tier._index.install(BlockIndex.build(keys, [stamp] * len(keys)), 10 * len(keys), keys)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        tier._index.clear()
        assert not presence.fills
        for _ in range(10):
            await asyncio.sleep(0)
        presence.refresh()
        answer = _answers(presence, [k[16:] for k in keys])
        assert not isinstance(answer, Miss) and not any(answer[1])
        await presence.close()

    asyncio.run(run())


# -- through a real daemon --------------------------------------------------------------------------
DNS = namespace_id(model="presence-fill", dtype="uint8")
PAYLOAD = b"p" * 64


def _plant_with_snapshot(root: Path, n: int) -> list[bytes]:
    """``n`` block files written as the daemon writes them, and the clean-shutdown snapshot listing
    them (as a daemon stopped over them leaves it): the next start indexes them from the snapshot."""
    tier = PosixTier(roots=[root])
    checksum = payload_checksum([memoryview(PAYLOAD)])
    digests, keys, made = [], [], set()
    for i in range(n):
        digest = key_digest("fill", i)
        key = BlockKey(DNS, digest)
        path = tier.path_of(key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            made.add(path.parent)
        path.write_bytes(encode_header(key, len(PAYLOAD), checksum, version=FLAT_LAYOUT_VERSION) + PAYLOAD)
        digests.append(digest)
        keys.append(bytes(key))
    now = time.time()
    index_snapshot.write_snapshot(
        root, index_snapshot.Columns(keys, [len(PAYLOAD)] * n, [now] * n), durable=False
    )
    return digests


def test_a_client_reading_the_table_while_a_restarted_daemon_fills_it_never_sees_a_false_miss(
    tmp_path: Path,
) -> None:
    """The table, read directly while the daemon starts over 6 slices' worth of snapshot, answers
    either "ask gRPC" or the truth; keys deleted and stored from the first moment on end up right."""
    n = 6 * FILL_SLICE
    d = DaemonProcess(tmp_path / "d", args=["--store-pipeline", "Posix", "--posix-pack-max-block-bytes", "0"])
    planted = _plant_with_snapshot(d.data_dir / "blocks", n)
    deleted = planted[:n:97]
    stored = [key_digest("fill-new", i) for i in range(300)]
    d.start()
    with d, UcmClient(d.target) as c:
        stop = threading.Event()
        answered: list[int] = []
        false_misses: list[str] = []

        def read_table() -> None:  # only keys nobody deletes: they are present from start to end
            steady = planted[1:n:97]
            while not stop.is_set():
                ch = c._plane.channel()
                if ch is None:
                    continue
                answer = ch.table.lookup(DNS, steady)
                if answer is Miss.STALE:
                    c._plane._refresh_table(ch)
                    time.sleep(0.001)
                elif not isinstance(answer, Miss):
                    answered.append(1)
                    if answer[0] != len(steady):
                        false_misses.append(f"the table said key {answer[0]} of {len(steady)} is missing")

        reader = threading.Thread(target=read_table)
        reader.start()
        try:
            assert c.delete(DNS, deleted) == len(deleted)
            assert c.put_blocks(DNS, [(k, PAYLOAD) for k in stored]).ok
            deadline = time.monotonic() + 60
            while not re.search(r"presence tables filled with \d+ keys", d.log()):
                assert time.monotonic() < deadline, "the daemon never logged the end of the fill"
                time.sleep(0.01)
            deadline = time.monotonic() + 10
            while not answered:
                assert time.monotonic() < deadline, "the table never answered after its fill"
                time.sleep(0.01)
        finally:
            stop.set()
            reader.join()
        assert not false_misses, false_misses[:3]
        before = c._plane.lookups_local
        assert c.lookup(DNS, deleted).hit_prefix == 0
        assert c.lookup(DNS, stored).hit_prefix == len(stored)
        gone = set(deleted)
        kept = [k for k in planted[1:n:7] if k not in gone]
        assert c.lookup(DNS, kept).hit_prefix == len(kept)
        assert c._plane.lookups_local == before + 3, "these answers came from gRPC, not the table"
