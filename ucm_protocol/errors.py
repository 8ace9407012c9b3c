"""Domain errors shared by the daemon and the client, each tied to one gRPC status code.

The daemon raises these; an interceptor turns them into the matching status with the message as
detail. The client turns a status back into the same class, so code on both sides catches one
hierarchy. Each also subclasses the builtin it resembles (``ValueError``, ``KeyError``...), so callers
that do not know UCM still catch them sensibly.
"""

from __future__ import annotations

import grpc


class UcmError(Exception):
    """Base of every UCM error; ``code`` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(UcmError, ValueError):
    """The request itself is wrong: bad sizes, unknown region, out-of-range offsets."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(UcmError, KeyError):
    """A named thing (task, region, session, block) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(UcmError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(UcmError):
    """A capacity or quota would be exceeded, or a batch is larger than allowed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(UcmError):
    """The request is valid but the daemon's state does not allow it (e.g. no session)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(UcmError, PermissionError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(UcmError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(UcmError, ConnectionError):
    """The daemon, or a tier it needs, cannot be reached now; retrying later may work."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(UcmError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(UcmError):
    code = grpc.StatusCode.CANCELLED


class Internal(UcmError):
    code = grpc.StatusCode.INTERNAL


class ConfigError(UcmError, ValueError):
    """Bad configuration: the message names the key and the value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


_BY_CODE: dict[grpc.StatusCode, type[UcmError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        ResourceExhausted,
        FailedPrecondition,
        PermissionDenied,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def error_for_status(code: grpc.StatusCode, detail: str) -> UcmError:
    """The domain error a client raises for a gRPC status (unknown codes become ``Internal``)."""
    return _BY_CODE.get(code, Internal)(detail or code.name)


def domain_error(exc: grpc.RpcError) -> UcmError:
    """The domain error for a failed call: the one place a client turns an ``RpcError`` into UCM's
    hierarchy (errors without a status, e.g. a broken channel, become ``Internal``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for_status(code, detail or "")
