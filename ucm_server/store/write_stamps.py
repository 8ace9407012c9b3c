"""Write stamps: whether anybody wrote (or deleted) a key since a read began.

A read that found a block in a lower tier may promote it into the top tier only if nobody wrote or
deleted that key since the read began; otherwise the promotion would hide the newer version. Every
write or delete stamps its keys with a new sequence number; a read notes the number it began at and
asks :meth:`WriteStamps.unwritten_since` before promoting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ucm_protocol.keys import BlockKey

__all__ = ["WriteStamps"]

FORGET_ABOVE = 4096
"""Stamps kept before those no running read can be older than are forgotten."""


class WriteStamps:
    def __init__(self) -> None:
        self._seq = 0
        self._written: dict[BlockKey, int] = {}
        self._reading: Counter[int] = Counter()

    def stamp(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` were just written or deleted."""
        self._seq += 1
        self._written.update(dict.fromkeys(keys, self._seq))  # C-level: a dump stamps every block
        if len(self._written) > FORGET_ABOVE:  # forget stamps no running read can be older than
            oldest = min(self._reading) if self._reading else self._seq
            self._written = {k: v for k, v in self._written.items() if v > oldest}

    def begin_read(self) -> int:
        """Mark a read that may promote as begun; returns its stamp (see :meth:`unwritten_since`)."""
        started = self._seq
        self._reading[started] += 1
        return started

    def end_read(self, started: int) -> None:
        self._reading[started] -= 1
        if not self._reading[started]:
            del self._reading[started]

    def unwritten_since(self, key: BlockKey, started: int) -> bool:
        """Nobody wrote or deleted ``key`` since the read stamped ``started`` began: its copy may be
        promoted without hiding a newer version."""
        return self._written.get(key, 0) <= started
