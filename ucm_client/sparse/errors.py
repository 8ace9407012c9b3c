"""Errors raised by the sparse-attention framework.

Each subclasses the builtin a caller would naturally catch (``ValueError`` for bad input, ``RuntimeError``
for misuse of the lifecycle), so generic handlers keep working while tests and logs can be precise.
"""

from __future__ import annotations

from ucm_protocol.errors import ConfigError

__all__ = [
    "SparseConfigError",
    "SparseError",
    "SparseInputError",
    "SparseRoleError",
    "SparseSessionError",
    "UnknownSparseMethodError",
]


class SparseError(Exception):
    """Base of every sparse-attention error."""


class SparseConfigError(SparseError, ConfigError):
    """``ucm_sparse_config`` is malformed: unknown key, bad value, or missing method section.

    A :class:`~ucm_protocol.errors.ConfigError` (hence a ``ValueError``) like every settings error,
    so one ``except ConfigError`` catches a bad connector and a bad sparse config alike."""


class UnknownSparseMethodError(SparseConfigError, KeyError):
    """A method name that neither the registry, a module path nor an entry point provides."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class SparseSessionError(SparseError, RuntimeError):
    """A worker hook was called outside ``execute_begin … execute_finished`` or out of order."""


class SparseRoleError(SparseError, RuntimeError):
    """A scheduler hook was called on a worker instance or the other way round."""


class SparseInputError(SparseError, ValueError):
    """A tensor handed to a hook has the wrong shape, dtype or device."""
