"""The daemon's tracer, once tracing is on: task spans, and the tier wrappers put on the pipeline.

Only :func:`ucm_server.tracing.start` builds a :class:`DaemonTracing` (and so imports OpenTelemetry).
The RPC spans are the interceptor's (:mod:`ucm_server.tracing.rpc`); the caller's context it
extracted is in its ``caller_context`` for the handler's task, which is where a task is submitted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from opentelemetry import baggage, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from ucm_protocol import tracing as names
from ucm_protocol.states import BlockState
from ucm_server import __version__
from ucm_server.store.traced import TracedTier, served
from ucm_server.tracing.rpc import TracingInterceptor, caller_context

if TYPE_CHECKING:
    from grpc import aio

    from ucm_server.store.base import Tier

__all__ = ["DaemonTracing"]


T = TypeVar("T")


class _TaskLike(Protocol):
    """What a task span reads of :class:`ucm_server.tasks.Task` (no import of the task module here)."""

    task_id: int
    nblocks: int
    states: bytearray
    bytes_done: int
    cancel_requested: bool


class DaemonTracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("ucm_server", __version__)

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what the batch processor still holds

    def interceptor(self) -> aio.ServerInterceptor:
        return TracingInterceptor(self.tracer)

    def wrap_tier(self, tier: Tier) -> Tier:
        """``tier`` in a :class:`TracedTier` (a leasing top tier leases through it unchanged)."""
        return TracedTier(tier, self.tracer)

    def task_body(self, kind: str, body: Callable[[T], Awaitable[None]]) -> Callable[[T], Awaitable[None]]:
        """``body`` run inside a ``ucm.task.<kind>`` span, a child of the caller's span (else of the
        call's), from submission (its queueing included) to the body's end."""
        tracer = self.tracer
        here = trace.get_current_span()
        caller = caller_context.get()
        links = [Link(here.get_span_context())] if caller is not None and here.is_recording() else None
        request_id = baggage.get_baggage(names.REQUEST_ID, caller) if caller is not None else None
        submitted_ns, submitted = time.time_ns(), time.monotonic()

        async def traced(task: T) -> None:
            attributes: dict[str, Any] = {names.TASK_KIND: kind, names.QUEUED_S: time.monotonic() - submitted}
            if request_id is not None:
                attributes[names.REQUEST_ID] = str(request_id)
            tally: dict[str, int] = {}
            token = served.set(tally)
            try:
                with tracer.start_as_current_span(
                    f"ucm.task.{kind}",
                    context=caller,  # None: the call's span (current) is the parent
                    kind=SpanKind.SERVER,
                    attributes=attributes,
                    links=links,
                    start_time=submitted_ns,
                    record_exception=True,
                    set_status_on_exception=True,
                ) as span:
                    try:
                        await body(task)
                    finally:
                        if span.is_recording():
                            _describe_task(span, kind, task, tally)
            finally:
                served.reset(token)

        return traced


def _describe_task(span: trace.Span, kind: str, task: Any, tally: dict[str, int]) -> None:
    """The task's outcome as attributes: blocks, bytes, hits/misses/failures, the tiers that served."""
    t: _TaskLike = task
    states = bytes(t.states)
    ok, missing = states.count(BlockState.OK), states.count(BlockState.MISSING)
    failed = states.count(BlockState.FAILED)
    span.set_attributes(
        {
            names.TASK_ID: t.task_id,
            names.BLOCKS: t.nblocks,
            names.BYTES: t.bytes_done,
            names.HITS: ok,
            names.MISSES: missing,
            names.FAILED: failed,
            names.STATE: "cancelled" if t.cancel_requested else "done",
        }
    )
    if kind != "dump":
        span.set_attribute(names.HIT, ok == t.nblocks)
    if tally:
        span.set_attribute(names.TIER_SERVED, list(tally))
        span.set_attribute(names.TIER_SERVED_BLOCKS, list(tally.values()))
    if failed:
        span.set_status(Status(StatusCode.ERROR, f"{failed} of {t.nblocks} blocks failed"))
