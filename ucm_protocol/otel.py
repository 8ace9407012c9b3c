"""OpenTelemetry set-up both sides share: settings checks, the tracer provider, context on gRPC metadata.

The daemon (``ucm_server.tracing``) and the connector (``ucm_client.tracing``) trace the same way:
a tracer provider of their own exporting OTLP over HTTP/protobuf through a batch processor, a
parent-based ratio sampler (a call whose caller sampled it is always recorded, so one request's
trace is whole on both sides), and W3C Trace Context plus Baggage on the gRPC metadata of each call.

Nothing here imports OpenTelemetry until a function needs it: with tracing off the packages are
never loaded (and a daemon installed without them runs). The standard ``OTEL_*`` environment
variables apply where a UCM setting leaves a value open: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` when no endpoint is set, ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``,
``..._TIMEOUT``, ``..._COMPRESSION`` and ``..._CERTIFICATE`` for the exporter, ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES`` for the resource, ``OTEL_BSP_*`` for the batch processor, and
``OTEL_SDK_DISABLED=true`` turns tracing off whatever the settings say.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ucm_protocol.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "ENDPOINT_ENV",
    "TracingSettings",
    "build_provider",
    "check_endpoint",
    "check_sample_ratio",
    "check_settings",
    "endpoint_from_env",
    "extract_context",
    "inject_metadata",
    "sdk_disabled",
]

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""Where the exporter sends spans when no endpoint is set (the first is the full URL, the second a
base URL to which ``/v1/traces`` is added), as the OTLP exporter specification says."""
DEFAULT_ENDPOINT = "http://localhost:4318/v1/traces"
INSTALL_HINT = (
    "the OpenTelemetry packages are not installed (pip install opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http, as `pip install ucm` does)"
)


class TracingSettings(Protocol):
    """The tracing settings the daemon's config and the connector's both have."""

    @property
    def tracing_exporter(self) -> str: ...
    @property
    def tracing_endpoint(self) -> str | None: ...
    @property
    def tracing_sample_ratio(self) -> float: ...


def check_settings(settings: TracingSettings, exporters: Iterable[str]) -> None:
    """The tracing settings both sides have, checked at start-up with the key named."""
    known = tuple(exporters)
    if settings.tracing_exporter not in known:
        raise ConfigError(
            f"tracing_exporter: unknown exporter {settings.tracing_exporter!r}; known: {', '.join(known)}"
        )
    if settings.tracing_endpoint:
        check_endpoint("tracing_endpoint", settings.tracing_endpoint)
    check_sample_ratio("tracing_sample_ratio", settings.tracing_sample_ratio)


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED=true``: the standard switch that turns every OpenTelemetry SDK off."""
    env = os.environ if environ is None else environ
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def check_endpoint(key: str, url: str) -> None:
    """An OTLP/HTTP endpoint is an ``http://`` or ``https://`` URL with a host (and a valid port):
    anything else is refused at start-up naming ``key``, not found out at the first export."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ConfigError(f"{key}: {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(
            f"{key}: {url!r} is not an OTLP/HTTP endpoint: expected http://host:port/v1/traces "
            "(or https://); OTLP over gRPC is not supported, use the collector's HTTP port (4318)"
        )
    if not parts.hostname:
        raise ConfigError(f"{key}: {url!r} names no host: expected http://host:port/v1/traces")
    if port == 0:
        raise ConfigError(f"{key}: {url!r}: port 0 is not a port to send to")


def check_sample_ratio(key: str, ratio: float) -> None:
    if not (isinstance(ratio, int | float) and math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise ConfigError(
            f"{key}: expected a fraction of traces to record in [0, 1] (1 = all, 0 = only those the "
            f"caller records), got {ratio!r}"
        )


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(variable, URL)`` of the standard endpoint variable in force, or None (the default applies)."""
    env = os.environ if environ is None else environ
    traces, base = ENDPOINT_ENV
    if env.get(traces, "").strip():
        return traces, env[traces].strip()
    if env.get(base, "").strip():
        return base, env[base].strip().rstrip("/") + "/v1/traces"
    return None


def build_provider(
    *,
    service_name: str,
    version: str,
    endpoint: str,
    sample_ratio: float,
    keys: tuple[str, str] = ("tracing_exporter", "tracing_endpoint"),
    exporter: SpanExporter | None = None,
    batch: bool = True,
) -> TracerProvider:
    """A tracer provider exporting to ``endpoint`` (empty: the ``OTEL_*`` variables, else the
    collector's default on localhost), or to ``exporter`` when given (tests: an in-memory one).
    Raises :class:`ConfigError` naming the setting (``keys``: the exporter's and the endpoint's)
    or the variable for a bad endpoint, and when the packages are missing."""
    exporter_key, endpoint_key = keys
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
    except ImportError as exc:
        raise ConfigError(f"{exporter_key}: {INSTALL_HINT}: {exc}") from None
    if exporter is None:
        if endpoint:
            check_endpoint(endpoint_key, endpoint)
        elif (found := endpoint_from_env()) is not None:
            check_endpoint(f"environment {found[0]}", found[1])
            endpoint = found[1]
        else:
            endpoint = DEFAULT_ENDPOINT
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigError(f"{exporter_key}: {INSTALL_HINT}: {exc}") from None
        exporter = OTLPSpanExporter(endpoint=endpoint)
    attributes: dict[str, Any] = {"service.version": version}
    if not _service_named_by_env():
        attributes["service.name"] = service_name
    provider = TracerProvider(
        sampler=ParentBasedTraceIdRatio(sample_ratio),
        resource=Resource.create(attributes),
        shutdown_on_exit=False,  # the owner shuts it down (flushing what is queued) when it stops
    )
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def _service_named_by_env() -> bool:
    if os.environ.get("OTEL_SERVICE_NAME", "").strip():
        return True
    return any(
        item.split("=", 1)[0].strip() == "service.name"
        for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    )


def inject_metadata(baggage: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The current span's context (``traceparent``, ``tracestate``) and ``baggage`` (with the
    entries given added) as gRPC metadata; empty when no span is current."""
    from opentelemetry import baggage as otel_baggage
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = otel_context.get_current()
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return ()
    for name, value in (baggage or {}).items():
        ctx = otel_baggage.set_baggage(name, value, ctx)
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, ctx)
    W3CBaggagePropagator().inject(carrier, ctx)
    return tuple(carrier.items())


def extract_context(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The caller's context from gRPC metadata, or None when it sent no ``traceparent``."""
    carrier = {str(k): str(v) for k, v in metadata or () if k in ("traceparent", "tracestate", "baggage")}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract(carrier)
    return W3CBaggagePropagator().extract(carrier, ctx)
