"""Progress words for Loads: see how far the daemon's copy got without asking it.

A Load may name 8 bytes of registered memory (``LoadRequest.progress``); the daemon stores there
how many leading segments of every block it has copied, and ``LOAD_PROGRESS_DONE`` once the task
ended. Reading the word is a load from this process's own memory: no call, no event, no thread
hand-off, so a caller can start on the first segments of every block (vLLM's first attention layers)
while the daemon still copies the rest.

``ProgressWords`` is a small registered buffer of such words handed out one per Load. A word is
zeroed when taken; the client writes ``LOAD_PROGRESS_DONE`` itself when the daemon did not take the
word (an older daemon) or the call failed, so a waiter never waits on a word nobody writes.
A word is given back only once its task has ended (the daemon no longer writes it).

The count says nothing about success: a block may still fail (and must then be recomputed), which
only the task's result tells. x86's store order makes the bytes of the counted segments visible
with the count; see ``ucm_server.load_progress``.
"""

from __future__ import annotations

import time

import numpy as np

from ucm_client.buffers import SharedBuffer
from ucm_client.types import Segment
from ucm_protocol.wire import LOAD_PROGRESS_DONE

__all__ = ["LOAD_PROGRESS_DONE", "ProgressWords"]

WORD_BYTES = 8


class ProgressWords:
    """``count`` progress words in one shared buffer (register it, then ``take`` one per Load)."""

    def __init__(self, count: int = 512, *, label: str = "ucm-load-progress") -> None:
        self.buffer = SharedBuffer(count * WORD_BYTES, label=label)
        self._words = self.buffer.array(np.uint64)
        self._free = list(range(count - 1, -1, -1))
        self.region: int | None = None
        """The client's handle of the registered buffer (set by the caller after ``register``)."""

    def take(self) -> int | None:
        """A zeroed word's index, or None when every word is in use (then load without one)."""
        if not self._free or self.region is None:
            return None
        index = self._free.pop()
        self._words[index] = 0
        return index

    def give_back(self, index: int) -> None:
        """The word's task has ended: it may be handed out again."""
        self._free.append(index)

    def segment(self, index: int) -> Segment:
        """Where word ``index`` lies, for ``load(..., progress=)``."""
        assert self.region is not None
        return Segment(self.region, index * WORD_BYTES, WORD_BYTES)

    def read(self, index: int) -> int:
        """The word now: segments copied in every block, or ``LOAD_PROGRESS_DONE``."""
        return int(self._words[index])

    def wait(self, index: int, segments: int, deadline: float) -> bool:
        """Wait until the first ``segments`` segments of every block are copied: True then; False
        once the task ended first (word ``LOAD_PROGRESS_DONE``: a refused call too) or ``deadline``
        (monotonic) passed. Polls every ~50 us: a sleeping waiter leaves the core to the threads
        that are still working."""
        while True:
            word = int(self._words[index])
            if word == LOAD_PROGRESS_DONE:
                return False
            if word >= segments:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(50e-6)

    def close(self) -> None:
        del self._words
        self.buffer.close()
