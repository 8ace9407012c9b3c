"""Moved to :mod:`ucm_protocol.errors`; this path re-exports the same classes and is kept until 0.2.

The classes are the very same objects, so ``except``, ``isinstance`` and ``pytest.raises`` work with
either import path.
"""

from __future__ import annotations

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
    domain_error,
    error_for_status,
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
    "domain_error",
    "error_for_status",
]
