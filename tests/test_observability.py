"""Health, reflection, Prometheus metrics and structured logs of a real daemon."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_server.testing.daemon import DaemonProcess


def test_health_and_reflection(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "ucm.v1.KVStore", "ucm.v1.Admin"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = list(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"ucm.v1.KVStore", "ucm.v1.Admin", "grpc.health.v1.Health"} <= names


@pytest.mark.slow
def test_prometheus_metrics(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=["--metrics-address", "127.0.0.1:0"])  # the last flag wins
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        blocks = blocks_in(region, 4, 64 << 10)
        assert c.wait(c.dump(NS, blocks), 10).ok
        assert c.wait(c.load(NS, blocks), 10).ok
        c.lookup(NS, [b.key for b in blocks] + [b"\0" * 32] * 4)
        port = int(re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log()).group(1))  # type: ignore[union-attr]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "ucm_lookup_hit_rate 0.5",
        "ucm_load_duration_ms_bucket",
        "ucm_load_speed_gbps",
        "ucm_save_duration_ms_count 1.0",
        "ucm_save_speed_gbps",
        'ucm_tier_blocks{kind="Cache",tier="Cache"} 4.0',
        'ucm_tier_capacity_bytes{kind="Cache",tier="Cache"}',
        'ucm_tier_evictions_total{kind="Posix",tier="Posix"}',
        'ucm_task_queue_depth{state="running"}',
        "ucm_pinned_blocks 0.0",
        "ucm_expired_blocks_total 0.0",
    ):
        assert name in text, f"{name} missing from /metrics"


@pytest.mark.slow
def test_json_logs_and_log_level_from_env(tmp_path: Path) -> None:
    env = {"UNIFIED_CACHE_LOG_LEVEL": "DEBUG", "UCM_LOG_FORMAT": "json"}
    with DaemonProcess(tmp_path / "ucm", env=env) as d, UcmClient(d.target) as c, SharedBuffer(4096) as buf:
        c.register(buf)
        time.sleep(0.2)
        lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert any(rec["level"] == "DEBUG" and "registered region" in rec["msg"] for rec in lines)
    assert all({"ts", "level", "logger", "msg"} <= rec.keys() for rec in lines)
