"""Server interceptor: authorization, then domain errors as precise gRPC status codes.

Every UCM handler is wrapped so that, in the handler's own task,
:meth:`ucm_server.authz.Authorizer.admit` decides whether the call may run and as whom (the one spot
every RPC goes through), and the resulting grant is put in context variables the engine reads.
Servicers raise :mod:`ucm_server.api.errors` exceptions; each becomes ``context.abort(code,
message)``. Anything else is a bug: it is logged with its traceback and answered ``INTERNAL`` with a
short message, and the daemon keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from ucm_protocol.errors import InvalidArgument, UcmError
from ucm_protocol.text import printable
from ucm_server.authz import Authorizer, enter
from ucm_server.metrics import Metrics

log = logging.getLogger(__name__)


def decode(deserializer: Any, raw: bytes) -> Any:
    """Parse a request inside the wrapped handler, so bytes that are not the message a method takes
    are answered INVALID_ARGUMENT rather than grpc's own UNKNOWN."""
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except DecodeError as exc:
        raise InvalidArgument(f"request is not a valid protobuf message: {exc}") from None


MAX_DETAIL_CHARS = 4096


def detail(message: str) -> str:
    """A status detail as sent: one line, capped, as error messages may echo client input (names,
    paths, labels) that ends up in logs and on terminals on the client's side."""
    return printable(message, MAX_DETAIL_CHARS, backslashes=False)


def is_local(context: aio.ServicerContext) -> bool:
    """The peer came in over the Unix socket (whose 0600 mode is its access control), not TCP."""
    return str(context.peer() or "").startswith("unix:")


class ErrorMappingInterceptor(aio.ServerInterceptor):
    def __init__(self, metrics: Metrics, authorizer: Authorizer | None = None) -> None:
        """``authorizer``: who may call what (``None``: a daemon without tokens or TCP, every
        caller local)."""
        self._metrics = metrics
        self._authz = authorizer or Authorizer(None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        full_method = handler_call_details.method
        method = full_method.rsplit("/", 1)[-1]
        metrics = self._metrics
        authz = self._authz

        def admit(context: aio.ServicerContext) -> None:
            """Authorize the call; the grant is visible to this task only."""
            enter(authz.admit(full_method, context.invocation_metadata(), local=is_local(context)))

        async def fail(context: aio.ServicerContext, exc: BaseException) -> None:
            if isinstance(exc, UcmError):
                metrics.rpc_errors.labels(method, exc.code.name).inc()
                await context.abort(exc.code, detail(exc.message))
            log.exception("internal error in %s", method)
            metrics.rpc_errors.labels(method, "INTERNAL").inc()
            await context.abort(
                grpc.StatusCode.INTERNAL, detail(f"internal error in {method}: {type(exc).__name__}: {exc}")
            )

        def is_abort(exc: BaseException) -> bool:
            # context.abort raises an exception of grpc's own; let it through untouched.
            return type(exc).__module__.startswith("grpc")

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            decode_uu = handler.request_deserializer

            async def unary_unary(raw: bytes, context: aio.ServicerContext) -> Any:
                try:
                    admit(context)
                    return await inner_uu(decode(decode_uu, raw), context)
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            decode_us = handler.request_deserializer

            async def unary_stream(raw: bytes, context: aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    admit(context)
                    async for item in inner_us(decode(decode_us, raw), context):
                        yield item
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            decode_su = handler.request_deserializer

            async def stream_unary(raw_iterator: Any, context: aio.ServicerContext) -> Any:
                async def decoded() -> AsyncIterator[Any]:
                    async for raw in raw_iterator:
                        yield decode(decode_su, raw)

                try:
                    admit(context)
                    return await inner_su(decoded(), context)
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.stream_unary_rpc_method_handler(stream_unary, None, handler.response_serializer)
        return handler
