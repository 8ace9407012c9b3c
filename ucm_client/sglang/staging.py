"""Shared-memory slots that SGLang pages pass through when the daemon cannot reach the pool itself.

Used by the generic ``batch_set`` / ``batch_get`` path (SGLang hands flat page tensors, copies of its
pool), and by ``batch_set_v1`` / ``batch_get_v1`` when the host pool could not be shared
(``host_pool.share_in_place`` says why). A slot holds one page exactly as the zero-copy path stores
it (the page's byte ranges in address order, which is SGLang's flat page), so pages written by one
path are read by the other.

One ``Slots`` serves one direction; SGLang reads (its prefetch thread) and writes (its backup thread)
at the same time, so the backend keeps one for each, and a lock per ``Slots`` orders its users.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ucm_client import Segment, SharedBuffer

__all__ = ["Slots"]


class Slots:
    """``count`` page-sized slots of one ``SharedBuffer`` (registered with the daemon as ``region``)."""

    def __init__(self, page_bytes: int, buffer_bytes: int, label: str) -> None:
        self.page_bytes = page_bytes
        self.count = max(1, buffer_bytes // page_bytes)
        self.buffer = SharedBuffer(self.count * page_bytes, label=label)
        self.bytes = self.buffer.array()
        self.lock = threading.Lock()
        self.region: int | None = None

    def segments(self, slot: int) -> tuple[Segment, ...]:
        assert self.region is not None
        return (Segment(self.region, slot * self.page_bytes, self.page_bytes),)

    def slot(self, slot: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.bytes[slot * self.page_bytes : (slot + 1) * self.page_bytes]

    def gather(
        self, pool: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any], lengths: Sequence[int]
    ) -> None:
        """Copy pages (``offsets``: pages x ranges into ``pool``) into slots 0, 1, ..."""
        for slot, row in enumerate(offsets.tolist()):
            at = slot * self.page_bytes
            for start, length in zip(row, lengths, strict=True):
                self.bytes[at : at + length] = pool[start : start + length]
                at += length

    def scatter(
        self, pool: np.ndarray[Any, Any], offsets: np.ndarray[Any, Any], lengths: Sequence[int]
    ) -> None:
        """Copy slots 0, 1, ... back into the pages ``offsets`` name."""
        for slot, row in enumerate(offsets.tolist()):
            at = slot * self.page_bytes
            for start, length in zip(row, lengths, strict=True):
                pool[start : start + length] = self.bytes[at : at + length]
                at += length

    def close(self) -> None:
        del self.bytes
        self.buffer.close()
