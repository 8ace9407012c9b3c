"""The client's exceptions: the same hierarchy the daemon raises, rebuilt from gRPC status codes."""

from ucm_server.api.errors import (
    AlreadyExists,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    UcmError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AlreadyExists",
    "Cancelled",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "UcmError",
    "Unauthenticated",
    "Unavailable",
]
