"""The server interceptor of a tracing daemon: a span per call, a child of the caller's span.

It sits outermost (before the error-mapping interceptor), so its span covers authentication and
the status code a domain error became. The caller's W3C context (``traceparent``, ``tracestate``,
``baggage`` metadata) is extracted once per call, made the span's parent and kept in
:data:`caller_context` for a task the call starts. Polls and streams an
untraced client makes all the time (``Attach``, ``Check``, ``Wait``, a monitor's ``Admin`` calls)
are traced only when their caller sends a context; the health and reflection services never.

What a call's answer says goes onto its span: a Lookup's blocks, hits, misses and hit prefix, the
task id a Load, Dump or Prefetch started, the blocks a Delete removed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from grpc import aio
from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from ucm_protocol import tracing as names
from ucm_protocol.otel import extract_context

__all__ = ["TracingInterceptor", "caller_context"]

caller_context: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "ucm_caller_context", default=None
)
"""The context the caller sent with this call (W3C ``traceparent``), for spans that hang off it: a
task the call submits (:mod:`ucm_server.tracing.daemon`)."""

_SERVICES = ("/ucm.v1.KVStore/", "/ucm.v1.Admin/")
_QUIET = ("/ucm.v1.KVStore/Attach", "/ucm.v1.KVStore/Check", "/ucm.v1.KVStore/Wait", "/ucm.v1.Admin/")
"""Traced only when the caller sends its context (session streams, polls, monitoring)."""


class TracingInterceptor(aio.ServerInterceptor):
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or not full.startswith(_SERVICES):
            return handler
        caller = extract_context(handler_call_details.invocation_metadata)
        if caller is None and full.startswith(_QUIET):
            return handler
        service, _, method = full.strip("/").partition("/")
        attributes: dict[str, Any] = {names.SYSTEM: "grpc", names.SERVICE: service, names.METHOD: method}
        if caller is not None and (request_id := baggage.get_baggage(names.REQUEST_ID, caller)) is not None:
            attributes[names.REQUEST_ID] = str(request_id)
        tracer = self._tracer
        name = full.strip("/")

        @contextlib.contextmanager
        def call_span(context: aio.ServicerContext) -> Iterator[Span]:
            """The call's span, current while the handler runs; the caller's context kept for tasks."""
            span = tracer.start_span(name, context=caller, kind=SpanKind.SERVER, attributes=attributes)
            token = caller_context.set(caller)
            try:
                with trace.use_span(
                    span, end_on_exit=True, record_exception=False, set_status_on_exception=False
                ):
                    try:
                        yield span
                    except BaseException:
                        _failed(span, context)
                        raise
            finally:
                caller_context.reset(token)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: aio.ServicerContext) -> Any:
                with call_span(context) as span:
                    response = await inner_uu(request, context)
                    if span.is_recording():
                        _describe(method, span, response)
                    return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
                with call_span(context) as span:
                    sent = 0
                    async for item in inner_us(request, context):
                        sent += 1
                        yield item
                    span.set_attribute("rpc.grpc.messages_sent", sent)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: aio.ServicerContext) -> Any:
                with call_span(context):
                    return await inner_su(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        return handler


def _failed(span: Span, context: aio.ServicerContext) -> None:
    """The status the call ended with (the error-mapping interceptor's precise code and reason)."""
    try:
        code, details = context.code(), context.details()
    except Exception:  # an older grpc without code(): say only that it failed
        code, details = None, ""
    if isinstance(code, grpc.StatusCode):
        span.set_attribute(names.STATUS_CODE, code.value[0])
        if code is grpc.StatusCode.OK:
            return
    span.set_status(Status(StatusCode.ERROR, str(details or (code.name if code is not None else "failed"))))


def _describe(method: str, span: Span, response: Any) -> None:
    span.set_attribute(names.STATUS_CODE, 0)
    if method == "Lookup":
        present = response.present_bytes
        hits = present.count(1) if present else sum(response.present)
        blocks = len(present) if present else len(response.present)
        span.set_attributes(
            {
                names.BLOCKS: blocks,
                names.HITS: hits,
                names.MISSES: blocks - hits,
                names.HIT_PREFIX: response.hit_prefix,
                names.HIT: hits == blocks,
            }
        )
    elif method in ("Load", "Dump", "Prefetch"):
        span.set_attribute(names.TASK_ID, response.task_id)
    elif method == "Delete":
        span.set_attribute(names.HITS, response.deleted)
