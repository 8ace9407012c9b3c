"""Back-pressure a serving engine can act on: whether the daemon can take more dumps now.

A saturated daemon used to answer only by being slow: a dump waited for room in the write-back
backlog (``writeback_wait_s``), then was written through to the disk, and the engine learned of it
from timeouts, if at all. Now the daemon says so: :class:`StorePressure` watches the write-back
backlog and flips ``saturated`` on when dumps wait for room or the backlog (the Cache bytes still
being written down) nears its bound, and off once it has drained to half of it (hysteresis, so the
flag does not flap with every flush). The flag rides on what the client reads anyway — every
``SessionEvent`` of the ``Attach`` stream (one is sent as soon as the flag changes) and every
``TaskHandle`` a Load or Dump returns — so knowing it costs no call. The vLLM connector skips the
saves of a step while it is set (``vllm:ucm_save_skipped_blocks``) and loads as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from ucm_server.store.writeback import WriteBackFigures

log = logging.getLogger(__name__)

__all__ = ["StorePressure"]

ON_FRACTION = 0.9
"""Saturated from this share of the backlog's bound (or any dump waiting for room)."""
OFF_FRACTION = 0.5
"""Clear again at this share, with no dump waiting."""
POLL_S = 0.05


class Backlogged(Protocol):
    def writeback_figures(self) -> WriteBackFigures: ...


class StorePressure:
    """The daemon's ``store_saturated`` flag (see the module); ``on_change`` hears each flip."""

    def __init__(self, pipeline: Backlogged, on_change: Callable[[bool], None] | None = None) -> None:
        self._pipeline = pipeline
        self._on_change = on_change
        self.saturated = False
        self.flips = 0
        """Times the flag turned on since start (a figure for operators)."""
        self._task: asyncio.Task[None] | None = None

    def poll(self) -> bool:
        """Re-read the backlog; the flag now (calls ``on_change`` when it flipped)."""
        wb = self._pipeline.writeback_figures()
        if not wb.max_bytes:  # write-back off: a dump is as slow as the disk, and says so by itself
            now = False
        elif self.saturated:
            now = wb.waiting > 0 or wb.bytes_pending > OFF_FRACTION * wb.max_bytes
        else:
            now = wb.waiting > 0 or wb.bytes_pending >= ON_FRACTION * wb.max_bytes
        if now != self.saturated:
            self.saturated = now
            self.flips += now
            log.info(
                "store %s: write-back backlog %d of %d bytes, %d dumps waiting for room",
                "saturated" if now else "keeping up again",
                wb.bytes_pending,
                wb.max_bytes,
                wb.waiting,
            )
            if self._on_change is not None:
                self._on_change(now)
        return now

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ucm-store-pressure")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # a figure that cannot be read must not end the watch
                log.exception("reading the write-back backlog")
            await asyncio.sleep(POLL_S)
