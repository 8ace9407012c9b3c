"""Client-supplied text made safe to log and to print: control characters escaped, length capped.

Client names, region labels, tenant names, shm names and paths reach log lines, error details and
``ucm-admin`` output. Printed verbatim, a newline forges a log line, an ANSI escape rewrites an
operator's terminal, and a 16 MiB name makes a 16 MiB log line. :func:`printable` is the one helper
every such place goes through (the daemon and the ``ucm-admin`` client alike, hence its place in
``ucm_protocol``).
"""

from __future__ import annotations

DEFAULT_LIMIT = 256
"""Characters kept of one client-supplied string (a client name, a label, a path)."""


def printable(text: str | bytes, limit: int = DEFAULT_LIMIT, *, backslashes: bool = True) -> str:
    """``text`` with every control, format, separator (other than a plain space) and unassigned
    character escaped (``\\n``, ``\\x1b``, ``\\u202e``), cut to ``limit`` characters of the original
    with a note of how many were dropped. Backslashes are doubled (``backslashes``) so a client cannot
    fake an escape; a whole message that may already hold escaped parts passes ``backslashes=False``."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    cut = len(text) - limit if limit >= 0 and len(text) > limit else 0
    head = text[:limit] if cut else text
    if not cut and head.isprintable() and (not backslashes or "\\" not in head):
        return head  # the common case, checked in C
    out = []
    for ch in head:
        if ch == "\\" and backslashes:
            out.append("\\\\")
        elif ch.isprintable():  # false for controls, format characters, separators but " ", unassigned
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])  # as Python writes it: \n, \x1b, \u2028
    if cut:
        out.append(f"...[{cut} more characters]")
    return "".join(out)
