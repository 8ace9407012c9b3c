"""A real KV events subscriber (``examples/kv_events_indexer.py``) and what it must agree with.

The truth is ``ucm-admin ls --json --all``: each listed (tier, digest) as (medium, digest).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from test_admin import admin, json_of

from ucm_server.testing.daemon import DaemonProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from kv_events_indexer import NodeSubscriber

__all__ = [
    "MEDIUM",
    "NodeSubscriber",
    "listed",
    "node",
    "poll_until",
    "record_removals",
    "settle",
    "vllm_hash",
]

MEDIUM = {"Cache": "CPU", "Posix": "STORAGE", "DS3FS": "SHARED", "Mooncake": "SHARED", "S3": "SHARED"}


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


def record_removals(sub: NodeSubscriber) -> list[Any]:
    """The ``BlockRemoved`` events ``sub`` applies from now on (to prove removals were published,
    not inferred from a snapshot)."""
    from vllm.distributed.kv_events import BlockRemoved

    removals: list[Any] = []
    original_apply = sub.state.apply

    def apply(batch: Any) -> None:
        removals.extend(e for e in batch.events if isinstance(e, BlockRemoved))
        original_apply(batch)

    sub.state.apply = apply  # type: ignore[method-assign]
    return removals


def poll_until(sub: NodeSubscriber, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll until ``done()`` (or time runs out, then fail showing what the subscriber holds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        sub.poll(100)
    assert done(), sub.state.media


def node(tmp_path: Path, label: str, cfg: dict[str, Any], events: bool) -> DaemonProcess:
    """A daemon (not started) configured by ``cfg``; with ``events`` it publishes on
    ``ipc://<tmp_path>/b.pub`` (replay ``b.rep``): node B of the two-node tests."""
    import yaml

    if events:
        cfg = cfg | {
            "kv_events_endpoint": f"ipc://{tmp_path}/b.pub",
            "kv_events_replay_endpoint": f"ipc://{tmp_path}/b.rep",
        }
    path = tmp_path / f"{label}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return DaemonProcess(tmp_path / label, args=["--config", str(path)])
