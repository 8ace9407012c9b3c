"""GetBlocks replies share one byte budget (``reply_bytes``): stalled streams cannot exhaust memory.

Each GetBlocks stream holds the block it is sending until gRPC has sent it. Without a bound, a
client opening many streams and reading none would make the daemon hold one block per stream at
once. These tests stall a real stream (the client reads one message, then nothing), start a second,
and read the daemon's own figures from its Prometheus endpoint while they run.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.blocks import NS

from ucm_client import UcmClient, key_digest
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.slow  # each test takes seconds: not part of `make test-fast`

BLOCK = 1 << 20
STALLED_KEYS = [key_digest(f"stalled-{i}") for i in range(32)]
OTHER_KEYS = [key_digest(f"other-{i}") for i in range(2)]


def _content(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


def _daemon(tmp_path: Path, reply_bytes: str) -> DaemonProcess:
    return DaemonProcess(
        tmp_path / "ucm",
        args=["--cache-capacity", "128MiB", "--reply-bytes", reply_bytes, "--metrics-address", "127.0.0.1:0"],
    )


def _stall_then_read_other(tmp_path: Path, reply_bytes: str) -> tuple[float, float, bool, list[bytes | None]]:
    """Stall one 32-block stream after its first block, fetch two other blocks meanwhile; return the
    held bytes seen at most, the waits, whether the other fetch ended while the stall lasted, and
    what it got once the stalled stream was cancelled."""
    with _daemon(tmp_path, reply_bytes) as d, UcmClient(d.target) as c, grpc.insecure_channel(d.target) as ch:
        port = int(re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log()).group(1))  # type: ignore[union-attr]
        assert c.put_blocks(NS, [(k, _content(k)) for k in STALLED_KEYS + OTHER_KEYS]).ok
        stalled = rpc.KVStoreStub(ch).GetBlocks(
            pb.GetBlocksRequest(namespace=NS, keys=STALLED_KEYS), timeout=60
        )
        first = next(stalled)
        assert first.data == _content(STALLED_KEYS[0])
        got: list[list[bytes | None]] = []
        other = threading.Thread(target=lambda: got.append(c.get_blocks(NS, OTHER_KEYS)), daemon=True)
        other.start()
        held = 0.0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and other.is_alive():
            held = max(held, _metric(port, "ucm_reply_bytes_held"))
            time.sleep(0.05)
        ended_during_stall = not other.is_alive()
        waits = _metric(port, "ucm_reply_waits_total")
        stalled.cancel()
        other.join(20)
        assert not other.is_alive(), "GetBlocks never ended after the stalled stream was cancelled"
        deadline = time.monotonic() + 10
        while _metric(port, "ucm_reply_bytes_held") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(port, "ucm_reply_bytes_held") == 0, "a cancelled stream kept its reply bytes"
        assert c.get_blocks(NS, STALLED_KEYS[:2]) == [_content(k) for k in STALLED_KEYS[:2]]
        assert d.healthy()
        return held, waits, ended_during_stall, got[0]


def test_a_stalled_stream_holds_at_most_the_budget_and_gives_it_back(tmp_path: Path) -> None:
    held, waits, ended_during_stall, other = _stall_then_read_other(tmp_path, "1536KiB")
    assert held <= 1536 * 1024  # one 1 MiB block at a time fits; two would not
    assert waits >= 1  # the second stream waited for the stalled one's bytes
    assert not ended_during_stall
    assert other == [_content(k) for k in OTHER_KEYS]  # byte-exact once the budget came back


def test_control_a_budget_with_room_serves_the_other_stream_at_once(tmp_path: Path) -> None:
    _, waits, ended_during_stall, other = _stall_then_read_other(tmp_path, "64MiB")
    assert ended_during_stall and waits == 0
    assert other == [_content(k) for k in OTHER_KEYS]
