"""A real OTLP/HTTP trace receiver on loopback, for tests and benchmarks: what a collector would get.

:class:`OtlpReceiver` listens on ``127.0.0.1`` (a free port), accepts ``POST /v1/traces`` with an
``application/x-protobuf`` body (gzip or deflate encoded, or not), decodes it as the OTLP
``ExportTraceServiceRequest`` with ``opentelemetry-proto``'s own classes and keeps every span as a
:class:`ReceivedSpan`; anything else is answered 404 or 400 and counted in :attr:`rejected`. It is
the receiving end of the exporter the daemon and the connector use, so a test that reads spans here
has seen them cross a real HTTP connection in the wire format, with no SDK on the receiving side.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: int
    attributes: dict[str, Any]
    status_code: int
    service: str
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    """An OTLP ``AnyValue`` as a Python value."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which is not None else None


class OtlpReceiver:
    """``with OtlpReceiver() as r: ... r.endpoint ... r.spans``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.rejected = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if self.path != "/v1/traces":
                    self._answer(404)
                    return
                try:
                    receiver._take(body, self.headers.get("Content-Encoding", ""))
                except Exception:  # not an OTLP trace request: what a collector answers
                    self._answer(400)
                    return
                self._answer(200)

            def _answer(self, code: int) -> None:
                if code != 200:
                    with receiver._lock:
                        receiver.rejected += 1
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceResponse,
                )

                payload = ExportTraceServiceResponse().SerializeToString() if code == 200 else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _take(self, body: bytes, encoding: str) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        got = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex() or None,
                            kind=s.kind,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            status_code=s.status.code,
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(got)

    def wait_for(
        self, until: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0
    ) -> list[ReceivedSpan]:
        """The spans received, once ``until`` holds for them (or the timeout passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if until(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
