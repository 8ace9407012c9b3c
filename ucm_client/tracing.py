"""Client-side tracing: the connector's spans, and the caller's context carried to the daemon.

Off by default, and then nothing here imports OpenTelemetry and every hook below is one global
read. Turned on by the connector's ``tracing_exporter`` (``otlp``: a tracer provider of its own
exporting OTLP over HTTP, see :mod:`ucm_protocol.otel` for the ``OTEL_*`` variables it honours;
``global``: the provider the process already has, e.g. vLLM's own with ``--otlp-traces-endpoint``),
or by :func:`enable` for a program that uses :class:`~ucm_client.UcmClient` directly.

Once on, every call a client makes carries the current span's W3C context (``traceparent``) and
baggage in its gRPC metadata (:func:`outgoing`), so the daemon's spans for it are children of the
caller's span. The blocking :class:`~ucm_client.UcmClient` runs its calls on a thread of its own:
:func:`carry` moves the calling thread's context there with each call.

The connector's spans (``ucm.connector.lookup`` per request in the scheduler, ``ucm.connector.load``
/ ``ucm.connector.save`` per transfer in a worker) carry the vLLM request id, the blocks asked
for and how many were hit or moved; the daemon's task for a transfer is a child of its span.
The hooks the connector calls are :func:`scheduler_lookup`, :func:`job_started`,
:func:`job_context`, :func:`job_ended` and :func:`combined_from`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ucm_protocol import otel
from ucm_protocol import tracing as names
from ucm_protocol.errors import ConfigError
from ucm_protocol.otel import TracingSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "check_settings",
    "combined_from",
    "configure",
    "disable",
    "enable",
    "enabled",
    "job_context",
    "job_ended",
    "job_started",
    "outgoing",
    "request_span",
    "scheduler_lookup",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
"""The provider this module built (``otlp``), shut down by :func:`disable`; None for ``global``."""
_jobs: OrderedDict[int, tuple[Span, str | None]] = OrderedDict()
"""Open transfer spans by ``id(job)``, oldest first; bounded (a job never ended is dropped)."""
_MAX_OPEN_JOBS = 4096
_combined: tuple[object, tuple[str, ...]] | None = None
_NULL = contextlib.nullcontext()


def check_settings(config: TracingSettings) -> None:
    """Bad tracing settings of the connector, named (``ConfigError``)."""
    otel.check_settings(config, names.CONNECTOR_EXPORTERS)
    if config.tracing_endpoint and config.tracing_exporter != "otlp":
        raise ConfigError(
            f"tracing_endpoint is set, but tracing_exporter is {config.tracing_exporter!r}: "
            "only tracing_exporter: otlp sends there"
        )


def configure(config: TracingSettings, *, service_name: str = "ucm-connector") -> bool:
    """Turn tracing on as the connector's settings say (once per process); True when on."""
    check_settings(config)
    if config.tracing_exporter == "off" or _tracer is not None:
        return _tracer is not None
    if otel.sdk_disabled():
        log.info("UCM tracing: OTEL_SDK_DISABLED=true, tracing stays off")
        return False
    if config.tracing_exporter == "global":
        enable()
        return True
    from ucm_protocol import __version__

    provider = otel.build_provider(
        service_name=service_name,
        version=__version__,
        endpoint=config.tracing_endpoint or "",
        sample_ratio=config.tracing_sample_ratio,
    )
    enable(provider, owned=True)
    atexit.register(disable)  # a process that ends exports the spans its batch still holds
    return True


def enable(provider: Any = None, *, owned: bool = False) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``; None: the process's global one).
    ``owned``: :func:`disable` shuts it down."""
    global _tracer, _provider
    from opentelemetry import trace

    from ucm_protocol import __version__

    disable()
    source = provider if provider is not None else trace.get_tracer_provider()
    _tracer = source.get_tracer("ucm_client", __version__)
    _provider = provider if owned else None


def disable() -> None:
    """Stop tracing (a provider :func:`configure` built exports what it holds, then stops)."""
    global _tracer, _provider, _combined
    provider, _provider, _tracer, _combined = _provider, None, None, None
    _jobs.clear()
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


# -- the context on the wire ----------------------------------------------------------------------------
def outgoing() -> tuple[tuple[str, str], ...]:
    """gRPC metadata entries carrying the current span's context (none when off or no span)."""
    return () if _tracer is None else otel.inject_metadata()


def carry(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """``coro``, to run on another thread's event loop in this thread's tracing context."""
    if _tracer is None:
        return coro
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    ctx = otel_context.get_current()
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return coro

    async def in_context() -> T:
        token = otel_context.attach(ctx)
        try:
            return await coro
        finally:
            otel_context.detach(token)

    return in_context()


@contextlib.contextmanager
def _current(span: Span, request_id: str | None) -> Iterator[Span]:
    """``span`` current (and ``request_id`` in the baggage the daemon reads) for the block."""
    from opentelemetry import baggage, trace
    from opentelemetry import context as otel_context

    ctx = trace.set_span_in_context(span)
    if request_id is not None:
        ctx = baggage.set_baggage(names.REQUEST_ID, request_id, ctx)
    token = otel_context.attach(ctx)
    try:
        yield span
    finally:
        otel_context.detach(token)


# -- spans ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def request_span(name: str, request_id: str | None = None, **attributes: Any) -> Iterator[Span | None]:
    """A span around a program's own client calls (one request's loads and saves, say), current
    for the block: the daemon's spans for those calls are its children, and ``request_id`` reaches
    them as ``ucm.request_id``. Yields None (and records nothing) while tracing is off."""
    tracer = _tracer
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    if request_id is not None:
        attributes[names.REQUEST_ID] = request_id
    span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
    with contextlib.ExitStack() as stack:
        stack.callback(span.end)
        yield stack.enter_context(_current(span, request_id))


@contextlib.contextmanager
def scheduler_lookup(
    request_id: str, trace_headers: Mapping[str, str] | None, keys: int
) -> Iterator[Callable[[int], None]]:
    """The scheduler's lookup of one request, ``ucm.connector.lookup``: a child of the request's own
    trace when vLLM received one (``trace_headers``: its HTTP ``traceparent``); the block yields a
    function to call with the stored prefix (blocks) found."""
    tracer = _tracer
    if tracer is None:
        yield _ignore
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(dict(trace_headers)) if trace_headers else None
    attributes: dict[str, Any] = {names.REQUEST_ID: request_id, names.BLOCKS: keys}
    span = tracer.start_span(
        "ucm.connector.lookup", context=parent, kind=SpanKind.CLIENT, attributes=attributes
    )

    def found(stored: int) -> None:
        span.set_attributes(
            {
                names.HITS: stored,
                names.MISSES: keys - stored,
                names.HIT_PREFIX: stored,
                names.HIT: stored == keys,
            }
        )

    with contextlib.ExitStack() as stack:
        stack.callback(span.end)
        stack.enter_context(_current(span, request_id))
        yield found


def _ignore(_: int) -> None:
    return None


class _Transfer(Protocol):
    req_id: str
    block_ids: tuple[int, ...]


class _Job(Protocol):
    """What the span hooks read of a connector transfer job (``ucm_client.vllm.jobs.TransferJob``)."""

    transfer: Any
    load: bool


def combined_from(combined: object, transfers: Iterable[Any]) -> None:
    """``combined`` is several requests' transfers in one (a step's saves): its span names them all."""
    global _combined
    if _tracer is not None:
        _combined = (combined, tuple(dict.fromkeys(t.req_id for t in transfers)))


def job_started(job: Any, *, parts: int = 1, is_async: bool = False) -> None:
    """A transfer job began: its ``ucm.connector.load`` / ``ucm.connector.save`` span starts."""
    global _combined
    tracer = _tracer
    if tracer is None:
        return
    from opentelemetry.trace import SpanKind

    j: _Job = job
    transfer: _Transfer = j.transfer
    attributes: dict[str, Any] = {names.BLOCKS: len(transfer.block_ids), names.PARTS: parts}
    if _combined is not None and _combined[0] is transfer:
        ids = _combined[1]
        attributes[names.REQUEST_IDS] = list(ids)
        if len(ids) == 1:
            attributes[names.REQUEST_ID] = ids[0]
        _combined = None
    else:
        attributes[names.REQUEST_ID] = transfer.req_id
    if j.load:
        attributes[names.ASYNC] = is_async
    name = "ucm.connector.load" if j.load else "ucm.connector.save"
    span = tracer.start_span(name, context=_root(), kind=SpanKind.CLIENT, attributes=attributes)
    _jobs[id(job)] = (span, attributes.get(names.REQUEST_ID))
    while len(_jobs) > _MAX_OPEN_JOBS:
        _jobs.popitem(last=False)


def _root() -> Any:
    """A context with no span: a transfer's span starts a trace of its own (the worker does not
    see the request's trace), named by its request id."""
    from opentelemetry.context import Context

    return Context()


def job_context(job: Any) -> contextlib.AbstractContextManager[Any]:
    """The job's span current while its parts are handed to the daemon (their tasks join it)."""
    if _tracer is None or (open_span := _jobs.get(id(job))) is None:
        return _NULL
    return _current(*open_span)


def job_ended(job: Any, *, good: int, count: int, nbytes: int) -> None:
    """The job ended (every part answered): ``good`` of ``count`` blocks moved, ``nbytes`` bytes."""
    if _tracer is None or (open_span := _jobs.pop(id(job), None)) is None:
        return
    span, j = open_span[0], job
    span.set_attributes({names.HITS: good, names.FAILED: count - good, names.BYTES: nbytes})
    if j.load:
        span.set_attribute(names.HIT, good == count)
    span.end()
