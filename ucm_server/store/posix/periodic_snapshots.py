"""Periodic index snapshots of a file tier: the base a start after ``kill -9`` loads at once.

Without them only a clean shutdown leaves a snapshot, and a crash costs a read of every block
file's header before Lookup sees the whole store again (minutes at millions of blocks). Every
``interval_s`` seconds, if the index changed since the last snapshot, the tier's keys and stamps are
copied on the event loop (two C-level copies of the dict's arrays, in store order rather than
exact LRU order: the only part that holds the loop, measured and shown as
``index_snapshot_stall_s``) and written in a worker thread as a new periodic generation
(:func:`ucm_server.store.posix.index_snapshot.write_periodic`). A failure (disk full, ...) is logged and
counted; the daemon keeps serving and the previous generation stays the crash base.

The figures (:meth:`PeriodicSnapshots.figures`) go to the tier's stats, so ``ucm-admin stats`` and
the metrics endpoint show when the last snapshot was written, its age, blocks, duration, the loop
stall of collecting it, and failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from ucm_server.store.posix.block_index import BlockIndex, Stamp

log = logging.getLogger(__name__)

Write = Callable[[list[bytes], list[Stamp]], Awaitable[None]]


class PeriodicSnapshots:
    """The timer, change check and figures of one tier's periodic snapshots (the writing is the
    tier's ``write``, run off the event loop)."""

    def __init__(
        self, name: str, interval_s: float, index: BlockIndex, ready: Callable[[], bool], write: Write
    ) -> None:
        """``ready()``: whether the index is complete (a snapshot of a half-adopted index would
        replace a fuller one); ``write(keys, stamps)``: write them as the next generation."""
        self.name = name
        self.interval_s = interval_s
        self._index = index
        self._ready = ready
        self._write = write
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._changes = -1
        """The index's change count the newest snapshot on disk matches (-1: none known)."""
        self.written = 0
        self.failures = 0
        self.at = 0.0
        self.blocks = 0
        self.duration_s = 0.0
        self.stall_s = 0.0

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"{self.name} periodic snapshots")

    async def stop(self) -> None:
        """End the timer; a snapshot being written is finished first (its thread cannot be cut)."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
            self._task = None

    def written_at_changes(self, changes: int) -> None:
        """Note that a snapshot on disk (one just loaded) matches the index at ``changes``."""
        self._changes = changes

    @property
    def due(self) -> bool:
        return self._ready() and self._index.changes != self._changes

    async def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return
            if self.due:
                try:
                    await self.write_now()
                except Exception:  # a bug must not end the timer (and with it every later snapshot)
                    self.failures += 1
                    log.exception("posix tier %s: periodic index snapshot failed", self.name)

    async def write_now(self) -> bool:
        """Write a snapshot of the index as it is now; False (logged, counted) if it failed."""
        changes = self._index.changes
        started = time.perf_counter()
        keys, stamps = self._index.columns_by_store()
        self.stall_s = time.perf_counter() - started
        try:
            await self._write(keys, stamps)
        except OSError as exc:  # disk full, ...: the previous generation stays the crash base
            self.failures += 1
            log.error(
                "posix tier %s: periodic index snapshot not written (the previous one stays): %s",
                self.name,
                exc.strerror or exc,
            )
            return False
        self._changes = changes
        self.written += 1
        self.at = time.time()
        self.blocks = len(keys)
        self.duration_s = time.perf_counter() - started
        return True

    def figures(self) -> dict[str, float]:
        """The stats the tier shows (only once periodic snapshots are on or one was attempted)."""
        if not (self.interval_s or self.written or self.failures):
            return {}
        out = {
            "index_snapshot_failures": float(self.failures),
            "index_snapshots_written": float(self.written),
        }
        if self.written:
            out |= {
                "index_snapshot_at": self.at,
                "index_snapshot_age_s": max(0.0, time.time() - self.at),
                "index_snapshot_blocks": float(self.blocks),
                "index_snapshot_duration_s": self.duration_s,
                "index_snapshot_stall_s": self.stall_s,
            }
        return out
