"""The client's exceptions: the same hierarchy the daemon raises, rebuilt from gRPC status codes.

Every exception the client raises is a :class:`UcmError` subclass (never a raw ``grpc`` error), so
callers catch one hierarchy. :class:`RegionLost` is the client's own: a region handle whose memory the
daemon no longer maps (after a daemon restart its re-registration failed).
"""

from ucm_protocol.errors import (
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


class ArgumentTypeError(InvalidArgument, TypeError):
    """An argument of the wrong type (a ``str`` key, a tuple in place of a ``BlockIO``): refused by the
    client before anything is sent, naming the argument. Also a ``TypeError``, as Python's own is."""


class RegionLost(FailedPrecondition):
    """A region handle that can no longer be used: the daemon restarted and registering the handle's
    memory again failed (its memory is gone, or the new daemon refused it). The handle stays dead for
    the rest of the client's life, so it can never name memory the new daemon gave to another buffer;
    register the memory again to get a new handle."""

    def __init__(self, handle: int, reason: str) -> None:
        super().__init__(f"region handle {handle} is lost: {reason}; register the memory again")
        self.handle = handle
        self.reason = reason


__all__ = [
    "AlreadyExists",
    "ArgumentTypeError",
    "Cancelled",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "RegionLost",
    "ResourceExhausted",
    "UcmError",
    "Unauthenticated",
    "Unavailable",
]
