"""Server interceptor: domain errors become precise gRPC status codes, never a crash or INTERNAL.

Servicers raise :mod:`ucm_server.api.errors` exceptions; this wraps every handler so each becomes
``context.abort(code, message)``. Anything else is a bug: it is logged with its traceback and answered
``INTERNAL`` with a short message, and the daemon keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from ucm_server.api.errors import UcmError
from ucm_server.metrics import Metrics

log = logging.getLogger(__name__)


class ErrorMappingInterceptor(aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        metrics = self._metrics

        async def fail(context: aio.ServicerContext, exc: BaseException) -> None:
            if isinstance(exc, UcmError):
                metrics.rpc_errors.labels(method, exc.code.name).inc()
                await context.abort(exc.code, exc.message)
            log.exception("internal error in %s", method)
            metrics.rpc_errors.labels(method, "INTERNAL").inc()
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"
            )

        def is_abort(exc: BaseException) -> bool:
            # context.abort raises an exception of grpc's own; let it through untouched.
            return type(exc).__module__.startswith("grpc")

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in inner_us(request, context):
                        yield item
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator: Any, context: aio.ServicerContext) -> Any:
                try:
                    return await inner_su(request_iterator, context)
                except Exception as exc:
                    if is_abort(exc):
                        raise
                    await fail(context, exc)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        return handler
