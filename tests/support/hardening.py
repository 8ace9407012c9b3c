"""Helpers shared by the hardening tests: deterministic block content, Admin calls, fault tiers.

Content is derived from the key alone, so any process (a killed client's successor, a restarted
daemon's reader) can check every byte it loads without being told what was written.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc

from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc

FAULTS = "ucm_server.testing.faults"
FAULT_TIER = f"{FAULTS}:FaultInjectingTier"
SLOW_TIER = f"{FAULTS}:LatencyInjectingTier"

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # ``benchmarks`` (the load generator) importable under plain `pytest` too
    sys.path.insert(0, str(REPO))


def content(key: bytes, size: int) -> bytes:
    """The bytes block ``key`` holds in these tests: a function of the key, so anyone can check it."""
    return hashlib.shake_128(key).digest(size)


def tier_env(tier: str, settings: Mapping[str, object]) -> dict[str, str]:
    """``UCM_TIER_SETTINGS`` for one tier named by module path (JSON is YAML)."""
    return {"UCM_TIER_SETTINGS": json.dumps({tier: dict(settings)})}


def admin_stats(target: str) -> pb.StatsResponse:
    with grpc.insecure_channel(target) as ch:
        resp: pb.StatsResponse = rpc.AdminStub(ch).Stats(pb.StatsRequest(), timeout=5)
        return resp


def admin_evict_all(target: str, tier: str) -> pb.EvictResponse:
    with grpc.insecure_channel(target) as ch:
        resp: pb.EvictResponse = rpc.AdminStub(ch).Evict(pb.EvictRequest(tier=tier, all=True), timeout=10)
        return resp


def tier_named(stats: pb.StatsResponse, name: str) -> pb.TierStats:
    for t in stats.tiers:
        if name in (t.name, t.kind):
            return t
    raise KeyError(f"no tier {name!r} in {[t.name for t in stats.tiers]}")
