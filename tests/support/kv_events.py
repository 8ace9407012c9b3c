"""A real KV events subscriber (``examples/kv_events_indexer.py``) and what it must agree with.

The truth is ``ucm-admin ls --json --all``: each listed (tier, digest) as (medium, digest).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from test_admin import admin, json_of

from ucm_server.testing.daemon import DaemonProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from kv_events_indexer import NodeSubscriber

__all__ = ["MEDIUM", "NodeSubscriber", "listed", "settle", "vllm_hash"]

MEDIUM = {"Cache": "CPU", "Posix": "DISK"}


def vllm_hash(digest: bytes) -> int:
    """What vLLM's events carry for a 32-byte block hash by default (``maybe_convert_block_hash``)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def listed(d: DaemonProcess) -> set[tuple[str, int]]:
    """``ucm-admin ls --json --all`` as (medium, vLLM event hash) pairs: what a router should believe."""
    proc = admin(d, "--json", "ls", "--all")
    assert proc.returncode == 0, proc.stderr
    blocks = json_of(proc)["blocks"]
    return {(MEDIUM[t], vllm_hash(bytes.fromhex(b["digest"]))) for b in blocks for t in b["tiers"]}


def settle(sub: NodeSubscriber, d: DaemonProcess, timeout_s: float = 10.0) -> set[tuple[str, int]]:
    """Poll until the subscriber's index equals the daemon's listing (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    want = listed(d)
    while time.monotonic() < deadline:
        sub.poll(100)
        if sub.state.pairs() == want:
            return want
        want = listed(d)
    assert sub.state.pairs() == want, (len(sub.state.pairs()), len(want))
    return want
