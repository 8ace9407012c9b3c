"""The worker's bookkeeping of transfers in flight: a job per ``BlockTransfer``, a daemon task per part.

A job moves the blocks of one ``BlockTransfer`` (a request's hits, or a step's completed blocks).
Stored whole, it is one daemon task (one *part*) holding every block's bytes. Stored per layer
(``use_layerwise``), it is one task per attention layer, each holding that layer's page of every
block, so the forward can wait for layer L alone while the daemon still copies layer L+1. Results
are data: each part ends with one success flag per block, and a block is good only if every part
moved it. Nothing here talks to the daemon; the worker submits, waits and polls, and records what
came back with ``PartTask.end``. Loads and dumps are sent without waiting for the daemon's answer
(``PartTask.submitted``), so the forward starts while the Load and Dump calls are still on their way.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ucm_client import BlockState
from ucm_client.vllm.metadata import BlockTransfer

__all__ = ["PartTask", "TransferJob", "per_block"]


def per_block(states: list[BlockState], count: int) -> list[bool] | None:
    """OK per block; None (all failed) if the daemon did not answer for every block."""
    if len(states) != count:
        return None
    return [state == BlockState.OK for state in states]


@dataclass(slots=True, eq=False)
class PartTask:
    """One daemon task of a job: every block whole, or one layer's page of every block."""

    task_id: int | None
    """None: it could not be submitted, and its blocks count as failed."""
    block_bytes: int
    """Bytes this part moves per block (a whole block, or one layer's page)."""
    slots: list[int] | None = None
    """Staging slots holding this part's bytes (staging path only), released when it ends."""
    ok: list[bool] | None = None
    """Success per block once the task has ended; None while it runs."""
    submitted: Future[int] | None = None
    """A load or dump sent without waiting for the daemon's answer: the task id arrives here, and
    ``task_id`` is set from it when the part is first waited for or polled."""
    word: int | None = None
    """A whole-block load's progress word (``SharedMemoryKV.progress``): the daemon counts there
    the segments of every block copied so far, so a layer can start once its own are in."""

    @property
    def ended(self) -> bool:
        return self.ok is not None

    def end(self, ok: list[bool] | None, count: int) -> list[bool]:
        """Record the outcome (None: the task failed as a whole) and return it per block."""
        self.ok = ok if ok is not None else [False] * count
        return self.ok

    @classmethod
    def failed(cls, block_bytes: int, count: int) -> PartTask:
        """A part that was never submitted (daemon down, refused, no staging room)."""
        return cls(None, block_bytes, ok=[False] * count)


@dataclass(slots=True, eq=False)  # identity: one dump may be pending for several requests
class TransferJob:
    """A load or dump of one ``BlockTransfer``, as one part (whole blocks) or one part per layer."""

    transfer: BlockTransfer
    load: bool
    started: float
    deadline: float
    parts: list[PartTask | None] = field(default_factory=list)
    """By layer index (layerwise) or a single entry; None until that layer's dump is submitted."""
    accounted: bool = False
    """Its outcome went into the stats (exactly once)."""

    @property
    def count(self) -> int:
        return len(self.transfer.block_ids)

    @property
    def ended(self) -> bool:
        return all(part is not None and part.ended for part in self.parts)

    def block_ok(self) -> list[bool]:
        """Per block: moved by every part (a block with one layer missing is not loaded)."""
        ok = [True] * self.count
        for part in self.parts:
            flags = part.ok if part is not None and part.ok is not None else [False] * self.count
            ok = [a and b for a, b in zip(ok, flags, strict=True)]
        return ok

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all parts."""
        return sum(part.block_bytes for part in self.parts if part is not None)
