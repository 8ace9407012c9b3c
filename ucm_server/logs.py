"""Structured logging for the daemon: ``text`` for people, ``json`` (one object per line) for collectors.

The level comes from the config (itself fed by ``UNIFIED_CACHE_LOG_LEVEL`` / ``UCM_LOG_LEVEL``). Log
records carry keys, sizes and reasons, never block payloads or credentials.

Every string a client supplies (client names, labels, tenant names, paths) is passed through
:func:`printable` where it is logged: control characters escaped, length capped. Both formatters
then apply the same rule to the whole message (capped at :data:`MAX_MESSAGE_CHARS`) as a second
line of defence, and the text format indents traceback lines, so no log line a client can influence
starts where a real one does: one record is one line.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from ucm_protocol.text import DEFAULT_LIMIT, printable

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_MESSAGE_CHARS",
    "JsonFormatter",
    "TextFormatter",
    "printable",
    "setup_logging",
]

MAX_MESSAGE_CHARS = 8192
"""Longest message a record keeps; the rest is dropped with a note of how much."""


def safe_message(record: logging.LogRecord) -> str:
    """The record's message on one line: control characters escaped, capped."""
    return printable(record.getMessage(), MAX_MESSAGE_CHARS, backslashes=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = safe_message(record)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # type: ignore[no-untyped-def]
        """Tracebacks indented: an exception message holding a newline cannot start a line."""
        return "\n".join("    " + line for line in super().formatException(ei).splitlines())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": safe_message(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)[-4 * MAX_MESSAGE_CHARS :]
        return json.dumps(out)


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))
