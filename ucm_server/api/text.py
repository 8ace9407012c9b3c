"""Moved to :mod:`ucm_protocol.text`; this path re-exports the same names and is kept until 0.2."""

from __future__ import annotations

from ucm_protocol.text import DEFAULT_LIMIT, printable

__all__ = ["DEFAULT_LIMIT", "printable"]
