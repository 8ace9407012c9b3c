"""OpenTelemetry tracing of the daemon: off by default, and then free (nothing is wrapped or imported).

With ``tracing_exporter: otlp`` the daemon records, as spans exported over OTLP/HTTP to
``tracing_endpoint`` (or the standard ``OTEL_EXPORTER_OTLP_*`` variables):

- each KVStore call (``ucm.v1.KVStore/Lookup``, ``/Load``, ``/Dump``...), a child of the caller's
  span when the call carries W3C ``traceparent`` metadata (the connector's does), with the lookup's
  blocks, hits and hit prefix, or the task id it started (:mod:`ucm_server.tracing.rpc`);
- each task (``ucm.task.load`` / ``dump`` / ``prefetch``), also a child of the caller's span: a task
  outlives the call that started it, so it hangs beside that call, not under it; with its blocks,
  bytes, hits, misses, failures, the time it queued and the tiers that served it
  (:mod:`ucm_server.tracing.tasks`);
- each tier call made for them (``ucm.tier.read`` / ``write`` / ``lookup`` / ``delete``), naming
  the tier (:mod:`ucm_server.store.traced`).

Sampling is parent-based: a call the connector recorded is always recorded here too, so a
request's trace is whole; other calls are recorded at ``tracing_sample_ratio``. Background work
(write-back flushes, expiry) belongs to no request and is not traced.

The hooks the rest of the daemon calls are the four functions below; each is a no-op costing one
global read while tracing is off: :func:`interceptors` (the server's interceptor list),
:func:`task_body` (``TaskManager.submit``), :func:`tier_wrapper` (the store assembly's outermost layer),
and :func:`start` / :func:`stop` (the daemon's start and shutdown).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ucm_protocol import otel
from ucm_protocol.otel import TracingSettings
from ucm_protocol.tracing import EXPORTERS

if TYPE_CHECKING:
    from grpc import aio

    from ucm_server.store.base import Tier
    from ucm_server.tracing.daemon import DaemonTracing

__all__ = [
    "TracingSettings",
    "active",
    "check_settings",
    "interceptors",
    "replace_exporter_for_tests",
    "start",
    "stop",
    "task_body",
    "tier_wrapper",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_active: DaemonTracing | None = None
_test_exporter: tuple[Any, bool] | None = None


def check_settings(settings: TracingSettings) -> None:
    """Refuse bad tracing settings at start-up, naming the key (``ConfigError``)."""
    otel.check_settings(settings, EXPORTERS)


def start(settings: TracingSettings) -> DaemonTracing | None:
    """Start tracing as ``settings`` say (None: off). Call before the engine is built."""
    global _active
    stop()
    check_settings(settings)
    if settings.tracing_exporter == "off":
        if settings.tracing_endpoint:
            log.warning("tracing_endpoint is set but tracing_exporter is off: no traces are sent")
        return None
    if otel.sdk_disabled():
        log.info(
            "tracing_exporter is %s, but OTEL_SDK_DISABLED=true: tracing is off", settings.tracing_exporter
        )
        return None
    from ucm_server import __version__

    exporter, batch = _test_exporter if _test_exporter is not None else (None, True)
    provider = otel.build_provider(  # first: without the packages, this says what to install
        service_name="ucm-server",
        version=__version__,
        endpoint=settings.tracing_endpoint or "",
        sample_ratio=settings.tracing_sample_ratio,
        exporter=exporter,
        batch=batch,
    )
    from ucm_server.tracing.daemon import DaemonTracing

    _active = DaemonTracing(provider)
    log.info(
        "tracing: OTLP/HTTP to %s, recording %g of untraced calls (and every call a traced client makes)",
        settings.tracing_endpoint or _env_endpoint(),
        settings.tracing_sample_ratio,
    )
    return _active


def _env_endpoint() -> str:
    found = otel.endpoint_from_env()
    return f"{found[1]} ({found[0]})" if found is not None else otel.DEFAULT_ENDPOINT


def stop() -> None:
    """Export what is queued and stop tracing (the daemon's shutdown)."""
    global _active
    tracing, _active = _active, None
    if tracing is not None:
        tracing.shutdown()


def active() -> DaemonTracing | None:
    return _active


def interceptors() -> list[aio.ServerInterceptor]:
    """The server interceptor that opens a span per call (outermost), or none when tracing is off."""
    return [] if _active is None else [_active.interceptor()]


def task_body(kind: enum.Enum, body: Callable[[T], Awaitable[None]]) -> Callable[[T], Awaitable[None]]:
    """``body`` of a task of ``kind`` (``TaskKind.LOAD``...), run inside its span when tracing is
    on. Call it where the task is submitted (the caller's context is taken there)."""
    tracing = _active
    return body if tracing is None else tracing.task_body(kind.name.lower(), body)


def tier_wrapper() -> Callable[[Tier], Tier] | None:
    """The outermost wrapper the store assembly puts around every tier, the top one included (the
    span's time is the whole call, encryption and compression included); ``None`` when tracing is
    off, so nothing is wrapped."""
    return None if _active is None else _active.wrap_tier


def replace_exporter_for_tests(exporter: Any, *, batch: bool = False) -> None:
    """TEST HOOK: the next :func:`start` exports to ``exporter`` (an SDK ``SpanExporter``: in memory,
    or the file of :mod:`ucm_server.testing.trace_capture`) instead of OTLP; None undoes it. The
    settings still decide whether tracing is on and how it samples."""
    global _test_exporter
    _test_exporter = None if exporter is None else (exporter, batch)
