"""TTL expiry: a block whose retention rule has expired is deleted from every tier.

Two ways in, one job. A background sweep runs every :data:`SWEEP_S` (blocks expire even when nobody
asks for them), and the data path calls :meth:`Expiry.due` before it answers a Lookup or a retention
change: when some rule has expired it deletes those blocks first, so an expired block is never
answered present. Deleting goes through the pipeline (every tier, shared ones included, the Cache's
queued write-backs superseded) and the tenant's quota forgets the bytes.

While a tier still indexes what survived a restart, nothing expires (a block it has not indexed yet
could not be deleted there and would come back without its rule); the sweep starts once every tier
is indexed, and catches up at once. Rules of blocks that no tier holds any more (evicted everywhere)
are dropped now and then, so the table stays the size of what is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ucm_protocol.keys import BlockKey
from ucm_server.quota import Quota
from ucm_server.retention import RetentionTable
from ucm_server.store.pipeline import Pipeline

log = logging.getLogger(__name__)

SWEEP_S = 1.0
"""How often the background sweep looks for expired rules (a heap peek when none is due)."""
PRUNE_S = 300.0
"""How often rules of blocks stored nowhere are dropped."""


class Expiry:
    def __init__(self, pipeline: Pipeline, table: RetentionTable, quota: Quota) -> None:
        self.pipeline = pipeline
        self.table = table
        self.quota = quota
        self.expired = 0
        """Blocks removed by expiry since start (a figure for operators and tests)."""
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def ready(self) -> bool:
        return not any(t.indexing for t in self.pipeline.tiers)

    async def due(self) -> None:
        """Delete expired blocks now if some rule has expired (a cheap check otherwise)."""
        if self.table.due(time.time()) and self.ready:
            await self.sweep()

    async def sweep(self) -> int:
        """Delete every block whose rule has expired, from every tier; returns how many."""
        async with self._lock:  # a second caller waits until the first one's deletes are done
            keys: list[BlockKey] = self.table.expired(time.time())
            if not keys:
                return 0
            try:
                await self.pipeline.delete(keys)
            except BaseException:
                self.table.requeue(keys)  # the next sweep tries again
                raise
            self.quota.forgot(keys)
            await self.table.forget(keys)
            self.expired += len(keys)
            log.info("expiry: removed %d expired blocks from every tier", len(keys))
            return len(keys)

    async def prune(self) -> int:
        """Drop the rules of blocks that no tier holds (evicted everywhere); returns how many."""
        keys = self.table.keys()
        if not keys:
            return 0
        sizes = await self.pipeline.lookup(keys)
        gone = [k for k, size in zip(keys, sizes, strict=True) if size is None]
        await self.table.forget(gone)
        return len(gone)

    async def _run(self) -> None:
        for tier in self.pipeline.tiers:
            await tier.indexed()
        try:
            await self.prune()
            await self.table.compact()  # the journal as one snapshot of what is still stored
        except Exception:
            log.exception("retention rules: start-up prune failed")
        last_prune = time.monotonic()
        while True:
            try:
                await self.sweep()
                if time.monotonic() - last_prune > PRUNE_S:
                    await self.prune()
                    last_prune = time.monotonic()
            except Exception:  # a tier error must not end expiry for good
                log.exception("expiry sweep failed; retrying")
            await asyncio.sleep(SWEEP_S)
