"""Retention state is bounded by the rules in force, never by the changes made, against real daemons.

A client changing the TTL of the same 4,096 blocks over and over made the daemon append every call
to ``retention.json`` (about half a MiB a call) and to an in-memory expiry heap, neither shrinking
until a restart; at 1 GiB the daemon refused to start on its own file. Here, as that client: the
file stays within about twice one snapshot of the rules (it is compacted), the daemon's memory does
not grow with the calls, and a restart reads the file back whole. A client adding rules past
``max_retention_rules`` is refused naming the setting, while changing rules already held still
works; a daemon restarted with a lower limit than its file holds starts and keeps them all. A file
whose last line a crash cut off, then appended to, still starts the daemon.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_client.errors import ResourceExhausted
from ucm_protocol.keys import BlockKey
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.retention import COMPACT_MIN_BYTES, HEAP_SLACK, Change, RetentionTable
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 4096


def _stats(d: DaemonProcess) -> pb.StatsResponse:
    with grpc.insecure_channel(d.target) as channel:
        return rpc.AdminStub(channel).Stats(pb.StatsRequest(), timeout=30)


def _rss(d: DaemonProcess) -> int:
    assert d.proc is not None
    for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _store(client: UcmClient, count: int) -> list[bytes]:
    """``count`` blocks of 4 KiB stored; their keys."""
    keys: list[bytes] = []
    with SharedBuffer(1024 * BLOCK) as buf:
        region = client.register(buf)
        for first in range(0, count, 1024):
            n = min(1024, count - first)
            buf.buf[: n * BLOCK] = os.urandom(n * BLOCK)
            batch = blocks_in(region, n, BLOCK, first=first)
            assert client.wait(client.dump(NS, batch), 60).ok
            keys += [b.key for b in batch]
        client.unregister(region)
    return keys


def test_repeated_changes_keep_retention_json_and_memory_bounded(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "64MiB"])
    rules = d.data_dir / "retention.json"
    with d, UcmClient(d.target) as client:
        keys = _store(client, 4096)
        client.set_retention(NS, keys, pin=True, ttl_s=3600)
        d.stop()
        d.start()  # start-up writes the file as one snapshot of the 4,096 rules: its size is S
        snapshot = rules.stat().st_size
        assert 4096 * 100 < snapshot < 4096 * 200, snapshot
        with UcmClient(d.target) as attacker:
            attacker.set_retention(NS, keys, ttl_s=7200)  # the first call's allocations out of the way
            rss = _rss(d)
            biggest = 0
            for i in range(200):  # each call changes every expiry: nothing to deduplicate
                attacker.set_retention(NS, keys, ttl_s=7200 + i)
                biggest = max(biggest, rules.stat().st_size)
                attacker.set_retention(NS, keys, pin=True)  # no change at all: writes nothing
            grew = _rss(d) - rss
        # Appended lines are compacted once they outweigh the snapshot: at most the snapshot, one
        # snapshot's worth of lines (and the 1 MiB floor), and the call that crossed the line.
        assert biggest <= 3 * snapshot + COMPACT_MIN_BYTES, (biggest, snapshot)
        # 200 calls x 4,096 expiries kept on the heap grew the daemon by about 80 MiB before.
        assert grew < 24 << 20, f"the daemon grew by {grew >> 20} MiB over 200 calls"
        stats = _stats(d)
        assert stats.retention_rules == 4096 and stats.pinned_blocks == 4096
    with d:  # restarts on its own file, every rule back
        stats = _stats(d)
        assert stats.retention_rules == 4096 and stats.pinned_blocks == 4096
        assert rules.stat().st_size <= 2 * snapshot


def test_the_expiry_heap_and_journal_stay_proportional_to_the_rules(tmp_path: Path) -> None:
    """The table on its own (a real file, no daemon), with its bounds read off directly."""

    async def scenario() -> tuple[int, int, int]:
        table = RetentionTable(tmp_path / "retention.json")
        keys = [BlockKey(NS, i.to_bytes(32, "big")) for i in range(1000)]
        most_heap = most_file = 0
        for i in range(300):
            await table.change(keys, Change(ttl_s=100.0 + i), 1000.0)
            most_heap = max(most_heap, table.heap_entries)
            most_file = max(most_file, (tmp_path / "retention.json").stat().st_size)
        await table.forget(keys[:500])
        return most_heap, most_file, len(table)

    most_heap, most_file, left = asyncio.run(scenario())
    assert most_heap <= 2 * 1000 + HEAP_SLACK, most_heap  # was 300,000
    assert most_file <= 3 * 1000 * 200 + COMPACT_MIN_BYTES, most_file  # was about 40 MB
    assert left == 500
    reread = RetentionTable(tmp_path / "retention.json")
    assert len(reread) == 500 and reread.heap_entries == 500


def test_rules_past_max_retention_rules_are_refused_naming_the_setting(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=["--max-retention-rules", "8"])
    with d, UcmClient(d.target) as client:
        keys = _store(client, 12)
        assert client.set_retention(NS, keys[:8], pin=True).applied == 8
        with pytest.raises(ResourceExhausted, match=r"8 retention rules; 4 more .*max_retention_rules"):
            client.set_retention(NS, keys[4:], pin=True)
        assert _stats(d).retention_rules == 8  # refused whole: none of the four got a rule
        # Changing rules already held adds none: still allowed at the limit.
        assert client.set_retention(NS, keys[:8], ttl_s=3600, priority=3).applied == 8
        assert client.set_retention(NS, keys[:2], pin=False, ttl_s=0, priority=0).applied == 2
        assert client.set_retention(NS, keys[8:10], pin=True).applied == 2  # room again
    d.extra_args = ["--max-retention-rules", "4"]  # lowered below what the file holds
    with d, UcmClient(d.target) as client:
        assert _stats(d).retention_rules == 8, "a file the daemon wrote lost rules at start-up"
        assert "more than max_retention_rules" in d.log()
        with pytest.raises(ResourceExhausted, match="max_retention_rules"):
            client.set_retention(NS, keys[10:11], pin=True)


def test_a_torn_line_then_more_changes_still_starts(tmp_path: Path) -> None:
    """A crash cut an append; the restarted daemon appends more, and is killed again: the next
    start-up reads the file (the torn part could have been glued to the next line)."""
    d = DaemonProcess(tmp_path / "ucm")
    rules = d.data_dir / "retention.json"
    with d, UcmClient(d.target) as client:
        keys = _store(client, 4)
        client.set_retention(NS, keys[:1], pin=True)
    with rules.open("ab") as f:
        f.write(b'{"set": {"00ff')  # an append cut by a crash
    d.start()
    with UcmClient(d.target) as client:
        client.set_retention(NS, keys[1:2], pin=True)
    d.kill()
    with d:
        assert _stats(d).pinned_blocks == 2
