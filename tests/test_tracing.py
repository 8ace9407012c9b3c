"""OpenTelemetry tracing across the client and a real daemon process.

The client's spans go to the SDK's in-memory exporter in this process; the daemon's, through its
test hook (:mod:`ucm_server.testing.trace_capture`), to a file this test reads; once, both go
over real OTLP/HTTP to a receiver the test starts, decoded with opentelemetry-proto's classes. The
daemon is told to trace by its ordinary settings (``--tracing-exporter otlp``) in every case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient, key_digest
from ucm_client import tracing as client_tracing
from ucm_client.errors import InvalidArgument
from ucm_client.vllm.config import load_config as load_connector_config
from ucm_protocol.errors import ConfigError
from ucm_server import cli
from ucm_server.testing.daemon import DaemonProcess
from ucm_server.testing.otlp_receiver import OtlpReceiver
from ucm_server.testing.trace_capture import TracedDaemonProcess

TRACING = ["--tracing-exporter", "otlp"]
Spans = list[dict[str, Any]]


@dataclass
class ClientTracing:
    tracer: trace.Tracer
    exporter: InMemorySpanExporter


@pytest.fixture
def client_spans() -> Iterator[ClientTracing]:
    """Client tracing on with an application's own provider, into memory (what ``tracing_exporter:
    global`` does with the provider vLLM sets up)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client_tracing.enable(provider)
    yield ClientTracing(provider.get_tracer("test"), exporter)
    client_tracing.disable()


def _hex(span_id: int) -> str:
    return f"{span_id:016x}"


def _named(spans: Spans, name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def _one(spans: Spans, name: str, **attributes: Any) -> dict[str, Any]:
    found = [
        s for s in _named(spans, name) if all(s["attributes"].get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, f"{len(found)} spans {name} {attributes} among {[s['name'] for s in spans]}"
    return found[0]


def _count(name: str, n: int = 1) -> Any:
    return lambda spans: len(_named(spans, name)) >= n


def test_connector_span_is_the_parent_of_the_daemons_task_and_tier_spans(
    tmp_path: Path, client_spans: ClientTracing
) -> None:
    """A load inside a caller's span: the daemon's task span is that span's child (same trace), its
    tier read a child of the task, naming the Cache with the bytes, hits and the request id."""
    tracer = client_spans.tracer
    d = TracedDaemonProcess(tmp_path / "ucm", args=[*TRACING, "--cache-capacity", "64MiB"])
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        blocks = blocks_in(region, 4, 64 << 10)
        assert c.wait(c.dump(NS, blocks), 10).ok
        ctx = baggage.set_baggage("ucm.request_id", "cmpl-7")
        token = otel_context.attach(ctx)
        try:
            with tracer.start_as_current_span("connector.load") as load_span:
                assert c.lookup(NS, [b.key for b in blocks]).hit_prefix == 4
                task = c.load(NS, blocks)
        finally:
            otel_context.detach(token)
        assert c.wait(task, 10).ok
        spans = d.spans(until=_count("ucm.task.load"))
    mine = load_span.get_span_context()
    task_span = _one(spans, "ucm.task.load")
    assert task_span["trace_id"] == f"{mine.trace_id:032x}"
    assert task_span["parent_id"] == _hex(mine.span_id), "the task hangs off the caller's span"
    attrs = task_span["attributes"]
    assert attrs["ucm.request_id"] == "cmpl-7"
    assert (attrs["ucm.blocks"], attrs["ucm.hits"], attrs["ucm.misses"], attrs["ucm.bytes"]) == (
        4,
        4,
        0,
        4 << 16,
    )
    assert attrs["ucm.hit"] is True
    assert attrs["ucm.tier.served"] == ["Cache"] and attrs["ucm.tier.served_blocks"] == [4]
    read = [s for s in _named(spans, "ucm.tier.read") if s["parent_id"] == task_span["span_id"]]
    assert [s["attributes"]["ucm.tier"] for s in read] == ["Cache"]
    assert read[0]["attributes"]["ucm.bytes"] == 4 << 16 and read[0]["attributes"]["ucm.hits"] == 4
    # The calls themselves: children of the caller's span too, the Lookup with its answer.
    load_call = _one(spans, "ucm.v1.KVStore/Load")
    assert load_call["parent_id"] == _hex(mine.span_id)
    assert load_call["attributes"]["ucm.task.id"] == attrs["ucm.task.id"]
    lookup = _one(spans, "ucm.v1.KVStore/Lookup")
    assert lookup["parent_id"] == _hex(mine.span_id), "the blocking lookup path carries the context too"
    assert lookup["attributes"]["ucm.hit_prefix"] == 4 and lookup["attributes"]["ucm.hits"] == 4
    assert lookup["resource"]["service.name"] == "ucm-server"


def test_a_load_from_disk_names_posix_and_a_miss_says_so(tmp_path: Path, client_spans: ClientTracing) -> None:
    """After a restart the Cache is empty: the load's tier spans show the Cache missing and Posix
    serving (promoted into the Cache as it is read); blocks never stored end as misses."""
    tracer = client_spans.tracer
    work = tmp_path / "ucm"
    with DaemonProcess(work) as d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        assert c.wait(c.dump(NS, blocks_in(c.register(buf), 4, 64 << 10), wait_durable=True), 10).ok
    d = TracedDaemonProcess(work, args=TRACING)
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        with tracer.start_as_current_span("from-disk"):
            assert c.wait(c.load(NS, blocks_in(region, 4, 64 << 10)), 10).ok
        with tracer.start_as_current_span("never-stored"):
            result = c.wait(c.load(NS, blocks_in(region, 2, 64 << 10, first=100)), 10)
        assert not result.ok
        spans = d.spans(until=_count("ucm.task.load", 2))
    first, missed = sorted(_named(spans, "ucm.task.load"), key=lambda s: s["start_ns"])
    assert first["attributes"]["ucm.tier.served"] == ["Posix"]
    reads = {
        s["attributes"]["ucm.tier"]: s["attributes"] for s in spans if s["parent_id"] == first["span_id"]
    }
    assert reads["Cache"]["ucm.hits"] == 0 and reads["Cache"]["ucm.misses"] == 4
    assert reads["Posix"]["ucm.hits"] == 4 and reads["Posix"]["ucm.bytes"] == 4 << 16
    m = missed["attributes"]
    assert (m["ucm.hits"], m["ucm.misses"], m["ucm.hit"]) == (0, 2, False)
    assert "ucm.tier.served" not in m


def test_refused_call_span_has_the_status_code(tmp_path: Path, client_spans: ClientTracing) -> None:
    d = TracedDaemonProcess(tmp_path / "ucm", args=TRACING)
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        region = c.register(buf)
        assert c.wait(c.dump(NS, blocks_in(region, 1, 64 << 10)), 10).ok
        with client_spans.tracer.start_as_current_span("bad-load"), pytest.raises(InvalidArgument):
            c.load(NS, blocks_in(region, 1, 32 << 10))  # the wrong size: refused whole
        spans = d.spans(until=_count("ucm.v1.KVStore/Load"))
    call = _one(spans, "ucm.v1.KVStore/Load")
    assert call["status"] == "ERROR" and call["attributes"]["rpc.grpc.status_code"] == 3
    assert "32768" in call["status_description"]


def test_daemon_samples_untraced_calls_by_ratio_and_follows_a_traced_caller(
    tmp_path: Path, client_spans: ClientTracing
) -> None:
    d = TracedDaemonProcess(tmp_path / "ucm", args=[*TRACING, "--tracing-sample-ratio", "0"])
    keys = [key_digest("k", i) for i in range(3)]
    with d, UcmClient(d.target) as c:
        c.lookup(NS, keys)  # no caller span: ratio 0 records nothing
        with client_spans.tracer.start_as_current_span("traced") as span:
            c.lookup(NS, keys)
        spans = d.spans(until=_count("ucm.v1.KVStore/Lookup"))
        spans = d.spans(until=_count("ucm.v1.KVStore/Lookup", 2), timeout_s=1.0)
    (lookup,) = _named(spans, "ucm.v1.KVStore/Lookup")
    assert lookup["parent_id"] == _hex(span.get_span_context().span_id)
    assert lookup["attributes"]["ucm.misses"] == 3 and lookup["attributes"]["ucm.hit"] is False


def test_tracing_off_by_default_records_and_sends_nothing(tmp_path: Path) -> None:
    """No settings: the daemon writes no span, the client adds no metadata."""
    assert client_tracing.outgoing() == ()
    d = TracedDaemonProcess(tmp_path / "ucm")
    with d, UcmClient(d.target) as c, SharedBuffer(1 << 20) as buf:
        with TracerProvider().get_tracer("app").start_as_current_span("app-span"):  # the app traces, UCM not
            assert client_tracing.outgoing() == ()
            assert c.wait(c.dump(NS, blocks_in(c.register(buf), 2, 64 << 10)), 10).ok
        assert c.lookup(NS, [key_digest("block", 0)]).hit_prefix == 1
    assert d.spans() == []


def test_otlp_http_export_to_a_receiver(tmp_path: Path) -> None:
    """Both sides export over real OTLP/HTTP; the receiver decodes ExportTraceServiceRequest and
    finds one trace: the connector's span, the daemon's task under it, the tier read under that."""
    with OtlpReceiver() as receiver:
        config = load_connector_config(
            {"tracing_exporter": "otlp", "tracing_endpoint": receiver.endpoint}, {}
        )
        assert client_tracing.configure(config)
        try:
            args = [*TRACING, "--tracing-endpoint", receiver.endpoint]
            with (
                DaemonProcess(tmp_path / "ucm", args=args) as d,
                UcmClient(d.target) as c,
                SharedBuffer(1 << 20) as buf,
            ):
                blocks = blocks_in(c.register(buf), 3, 64 << 10)
                assert c.wait(c.dump(NS, blocks), 10).ok
                with client_tracing.request_span("app", request_id="cmpl-9"):
                    assert c.wait(c.load(NS, blocks), 10).ok
            # stopping the daemon flushed its batch; disabling the client's tracing flushes the client's
        finally:
            client_tracing.disable()
        spans = receiver.wait_for(
            lambda s: any(x.name == "app" for x in s) and any(x.name == "ucm.task.load" for x in s)
        )
    assert receiver.rejected == 0
    app = next(s for s in spans if s.name == "app")
    task = next(s for s in spans if s.name == "ucm.task.load")
    assert app.service == "ucm-connector" and task.service == "ucm-server"
    assert task.trace_id == app.trace_id and task.parent_id == app.span_id
    assert app.attributes["ucm.request_id"] == task.attributes["ucm.request_id"] == "cmpl-9"
    assert task.attributes["ucm.bytes"] == 3 << 16 and task.attributes["ucm.tier.served"] == ["Cache"]
    read = next(s for s in spans if s.name == "ucm.tier.read" and s.parent_id == task.span_id)
    assert read.attributes["ucm.tier"] == "Cache" and read.attributes["ucm.hits"] == 3


# -- bad settings, named at start-up ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tracing-exporter", "jaeger"], "tracing_exporter"),
        (["--tracing-exporter", "otlp", "--tracing-endpoint", "collector:4318"], "tracing_endpoint"),
        (["--tracing-exporter", "otlp", "--tracing-endpoint", "grpc://collector:4317"], "OTLP/HTTP"),
        (["--tracing-exporter", "otlp", "--tracing-endpoint", "http://:4318/v1/traces"], "names no host"),
        (
            ["--tracing-exporter", "otlp", "--tracing-endpoint", "http://c:99999/v1/traces"],
            "tracing_endpoint",
        ),
        (["--tracing-sample-ratio", "1.5"], "tracing_sample_ratio"),
        (["--tracing-sample-ratio", "nan"], "tracing_sample_ratio"),
    ],
)
def test_bad_daemon_settings_are_named(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["--data-dir", str(tmp_path), *flags, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and named in err, err


def test_bad_endpoint_from_the_environment_is_named_at_start(tmp_path: Path) -> None:
    d = DaemonProcess(
        tmp_path / "ucm", args=TRACING, env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "localhost:4318"}
    )
    with pytest.raises(RuntimeError, match=r"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT.*not an OTLP/HTTP endpoint"):
        d.start(timeout_s=20)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tracing_exporter": "zipkin"}, "tracing_exporter"),
        ({"tracing_exporter": "otlp", "tracing_endpoint": "ftp://x/v1/traces"}, "tracing_endpoint"),
        ({"tracing_endpoint": "http://x:4318/v1/traces"}, "only tracing_exporter: otlp"),
        ({"tracing_sample_ratio": 2}, "tracing_sample_ratio"),
    ],
)
def test_bad_connector_settings_are_named(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_connector_config(extra, {})


def test_daemon_runs_without_opentelemetry_when_tracing_is_off(tmp_path: Path) -> None:
    """With the OpenTelemetry packages unimportable the daemon still serves (tracing off), and
    refuses to start with tracing on, saying what to install."""
    blocker = tmp_path / "blocked"
    (blocker / "opentelemetry").mkdir(parents=True)
    (blocker / "opentelemetry" / "__init__.py").write_text(
        'raise ImportError("opentelemetry blocked by the test")\n'
    )
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), str(root)])}
    with DaemonProcess(tmp_path / "off", env=env) as d, UcmClient(d.target) as c:
        assert c.lookup(NS, [key_digest("k", 0)]).hit_prefix == 0
    d = DaemonProcess(tmp_path / "on", args=TRACING, env=env)
    with pytest.raises(RuntimeError, match="tracing_exporter: the OpenTelemetry packages are not installed"):
        d.start(timeout_s=20)


def test_tracing_off_imports_no_opentelemetry() -> None:
    """A client, the connector's config and a daemon built on defaults load no OpenTelemetry module."""
    code = (
        "import sys, tempfile, pathlib\n"
        "import ucm_client, ucm_client.vllm.config, ucm_server.server\n"
        "from ucm_server.config import load_config\n"
        "from ucm_server.engine import Engine\n"
        "d = pathlib.Path(tempfile.mkdtemp())\n"
        "config, _ = load_config(None, {'data_dir': d, 'store_pipeline': 'Cache'}, environ={})\n"
        "Engine(config)\n"
        "ucm_client.vllm.config.load_config({}, {})\n"
        "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "sys.exit(f'loaded: {bad}' if bad else 0)\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
