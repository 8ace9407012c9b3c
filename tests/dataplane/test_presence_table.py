"""The presence table itself, in process: the compiled writer and reader against a plain model.

A table says "present" exactly for the keys some tier bit holds, through replacements, deletions,
rebuilds and slot reuse; a reader in another process never takes a half-written slot for a whole
one (the per-slot sequence lock), and never answers from a table that was superseded, closed, or
whose lease ran out.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import time

import pytest
from support.dataplane import needs_native

from ucm_protocol import dataplane as dp
from ucm_protocol.native import native
from ucm_server.dataplane.table import PresenceTable, slots_for

pytestmark = needs_native
NS = b"N" * 16
OTHER = b"O" * 16
FLAGS = dp.FLAG_COMPLETE | dp.FLAG_ALL_NAMESPACES


def _table(nslots: int = 1 << 12, flags: int = FLAGS) -> PresenceTable:
    table = PresenceTable(nslots, flags=flags, max_keys=1 << 16)
    table.add_namespace(NS, NS, dp.DIR_TRACKED)
    table.valid_until(native.monotonic_ns() + 60 * 10**9)
    return table


def _lookup(table: PresenceTable, digests: list[bytes], ns_id: int = 0) -> tuple[int, bytes]:
    out = bytearray(len(digests))
    code = native.table_lookup(table.map, ns_id, digests, out)
    return code, bytes(out)


def test_layout_of_the_helper_matches_the_protocol_module() -> None:
    for name, value in native.layout().items():
        assert getattr(dp, name) == value, name


def test_random_changes_match_a_model() -> None:
    rng = random.Random(7)
    table = _table(1 << 10)
    digests = [rng.randbytes(32) for _ in range(600)]
    held: dict[bytes, int] = {}  # digest -> tier bits
    for step in range(20_000):
        d = rng.choice(digests)
        bit = 1 << rng.randrange(3)
        on = rng.random() < 0.55
        done, unknown, crowded = table.apply([NS + d], bit, on)
        assert done == 1 and not unknown
        bits = held.get(d, 0)
        bits = bits | bit if on else bits & ~bit
        if bits:
            held[d] = bits
        else:
            held.pop(d, None)
        if crowded:  # deleted slots pile up: a fresh table with the same entries
            new = table.rebuilt(slots_for(table.live + 1))
            new.valid_until(native.monotonic_ns() + 60 * 10**9)
            assert _lookup(table, digests[:1])[0] == -3  # the old one is superseded at once
            table.close()
            table = new
        if step % 997 == 0:
            code, present = _lookup(table, digests)
            assert code >= 0
            assert present == bytes(d in held for d in digests)
            assert table.live == len(held)
    code, present = _lookup(table, digests)
    assert present == bytes(d in held for d in digests)


def test_a_key_held_by_two_tiers_stays_present_until_both_drop_it() -> None:
    table = _table()
    key = NS + b"k" * 32
    table.apply([key], 1, True)
    table.apply([key], 2, True)
    table.apply([key], 1, False)
    assert _lookup(table, [b"k" * 32]) == (1, b"\x01")
    table.apply([key], 2, False)
    assert _lookup(table, [b"k" * 32]) == (0, b"\x00")
    table.apply([key], 2, True)
    assert table.clear_bit(2) == 1  # a tier that lost everything
    assert _lookup(table, [b"k" * 32]) == (0, b"\x00")


def test_namespaces_are_kept_apart_and_unknown_ones_are_reported() -> None:
    table = _table()
    d = b"d" * 32
    done, unknown, _ = table.apply([OTHER + d], 1, True)
    assert done == 1 and unknown == {OTHER}
    assert _lookup(table, [d]) == (0, b"\x00")  # not in NS
    ns_id = table.add_namespace(OTHER, OTHER, dp.DIR_TRACKED)
    table.apply([OTHER + d], 1, True)
    assert _lookup(table, [d], ns_id) == (1, b"\x01")
    assert _lookup(table, [d], 0) == (0, b"\x00")
    assert native.table_find_ns(table.map, OTHER) == ns_id
    assert native.table_find_ns(table.map, b"x" * 16) == -1


def test_a_namespace_being_filled_is_not_answered_from() -> None:
    table = _table()
    ns_id = table.add_namespace(OTHER, b"named-by-client!", dp.DIR_POPULATING)
    assert native.table_find_ns(table.map, b"named-by-client!") == -2
    table.set_namespace_state(ns_id, dp.DIR_TRACKED)
    assert native.table_find_ns(table.map, b"named-by-client!") == ns_id
    assert native.table_find_ns(table.map, OTHER) == -1  # listed under the client's name only


def test_stale_tables_do_not_answer() -> None:
    table = _table()
    table.apply([NS + b"a" * 32], 1, True)
    assert _lookup(table, [b"a" * 32])[0] == 1
    table.valid_until(native.monotonic_ns() - 1)  # the daemon stopped pushing the lease on
    assert _lookup(table, [b"a" * 32])[0] == -3
    table.valid_until(native.monotonic_ns() + 10**9)
    table.retire(dp.TABLE_CLOSED)
    assert _lookup(table, [b"a" * 32])[0] == -3


def test_an_incomplete_table_answers_only_full_hits() -> None:
    table = _table(flags=dp.FLAG_ALL_NAMESPACES)  # a tier it does not cover may hold the others
    table.apply([NS + b"a" * 32], 1, True)
    assert _lookup(table, [b"a" * 32])[0] == 1
    assert _lookup(table, [b"a" * 32, b"b" * 32])[0] == -1


def test_bad_keys_and_limits_are_left_to_the_daemon() -> None:
    table = _table()
    assert _lookup(table, [b"short"])[0] == -2
    assert _lookup(table, [bytearray(32)])[0] == -2  # type: ignore[list-item]
    small = PresenceTable(1 << 10, flags=FLAGS, max_keys=4)
    small.add_namespace(NS, NS, dp.DIR_TRACKED)
    small.valid_until(native.monotonic_ns() + 10**9)
    assert _lookup(small, [b"a" * 32] * 5)[0] == -1  # more than max_batch_blocks: gRPC refuses it
    assert _lookup(small, [b"a" * 32] * 4)[0] == 0


def test_a_corrupt_header_is_refused_not_followed() -> None:
    for field, value in (
        (dp.T_NSLOTS, 0),
        (dp.T_NSLOTS, 1 << 50),
        (dp.T_SLOTS_AT, 1 << 40),
        (dp.T_DIR_AT, 1 << 40),
    ):
        buf = bytearray(_table().map[:])
        buf[field : field + 8] = value.to_bytes(8, "little")
        with pytest.raises(ValueError, match="not a presence table"):
            native.table_lookup(bytes(buf), 0, [b"a" * 32], bytearray(1))
    with pytest.raises(ValueError, match="not a presence table"):
        native.table_lookup(b"\0" * 50, 0, [], bytearray())


def test_an_insert_with_no_slot_in_reach_asks_for_a_rebuild() -> None:
    table = PresenceTable(1 << 6, flags=FLAGS, max_keys=1 << 16)  # 64 slots, all within one probe
    table.add_namespace(NS, NS, dp.DIR_TRACKED)
    keys = [NS + os.urandom(32) for _ in range(80)]
    done, _, crowded = table.apply(keys, 1, True)
    assert done == 64 and crowded
    bigger = table.rebuilt(slots_for(80))
    bigger.valid_until(native.monotonic_ns() + 10**9)
    assert bigger.apply(keys[done:], 1, True)[0] == 16
    code, present = _lookup(bigger, [k[16:] for k in keys])
    assert code == 80 and present == b"\x01" * 80


# -- a reader in another process ------------------------------------------------------------------------
PREFIX = b"A" * 16  # every key starts so: the probe starts in one place, and each key takes the same slot


def _key(i: int) -> bytes:
    return PREFIX + bytes([i % 251 + 1]) * 16


def _churn(table: mmap.mmap, seconds: float) -> None:
    """The writer (a forked process, writing through the daemon's shared mapping it inherited: the
    seal allows no new writable one): one slot holds key 1, nothing, key 2, nothing, ... and a tier
    bit comes and goes meanwhile."""
    routes = {NS: 0}
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        key = NS + _key(i)
        native.table_set(table, key, routes, 1, True)
        native.table_set(table, key, routes, 2, True)
        native.table_set(table, key, routes, 1, False)
        native.table_set(table, key, routes, 2, False)


def test_a_reader_never_sees_a_torn_slot() -> None:
    """Every write changes the whole slot (tag, tier bits, digest). A reader copying the slot while it
    is rewritten would see parts of two writes: a digest whose second half mixes two keys' bytes, or
    a key with no tier bit, or a deleted slot with a digest. It never does."""
    table = _table(1 << 10)
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_churn, args=(table.map, 2.5))
    writer.start()
    slot = None
    try:
        while slot is None:  # the writer's slot: where the first key went
            for i in range(table.nslots):
                got = native.table_read_slot(table.map, i)
                if got is not None and got[0] != 0 and (got[0] == dp.TAG_DELETED or got[2][:16] == PREFIX):
                    slot = i
                    break
        kinds: set[str] = set()
        reads = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            got = native.table_read_slot(table.map, slot)
            if got is None:
                continue
            tag, tiers, digest = got
            reads += 1
            if tag == dp.TAG_DELETED:
                assert tiers == 0 and digest == bytes(32), got
                kinds.add("deleted")
            else:
                assert tag == 1 and tiers in (1, 2, 3), got
                assert digest[:16] == PREFIX and len(set(digest[16:])) == 1, got
                kinds.add("held")
    finally:
        writer.join(10)
    assert writer.exitcode == 0
    assert reads > 10_000 and kinds == {"deleted", "held"}  # the reader did see the slot change under it
