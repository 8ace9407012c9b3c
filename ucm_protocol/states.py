"""Block states: the outcome of one block in a read, write or task, as both sides name it.

The values are ``ucm.v1.BlockStatus``'s, so a state crosses the wire as its integer unchanged. It lives
here rather than in the daemon's tier interface so a client can name a state without loading the
daemon's storage code.
"""

from __future__ import annotations

import enum


class BlockState(enum.IntEnum):
    """Outcome of one block in a read, write or task; values match ``ucm.v1.BlockStatus``."""

    PENDING = 1
    OK = 2
    MISSING = 3
    FAILED = 4
    CANCELLED = 5
