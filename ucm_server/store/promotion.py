"""Prefetch: bring blocks from lower tiers into the Cache ahead of the load that will want them.

The connector's scheduler asks for a prefetch as soon as its lookup finds a hit (issue #17, item
3); the worker's load follows within milliseconds, usually while the promotion is still reading. So
two things matter: the promotion must be as fast as a load (one batched read per tier straight into
the Cache pages reserved for the blocks: no scratch copy, the tier's own batching), and a load that
arrives meanwhile must not read the same blocks from disk a second time; it waits for the promotion
(:meth:`Promotions.wait_for`) and then reads memory.

A promoted block is published only if nobody wrote or deleted its key since the promotion began
(the pipeline's write stamps), exactly as a read's own promotion is (:meth:`Promotions.copy_up`).
A block promoted into the Cache from a tier that holds pins is safe there: pinned, the Cache may let
it go again (:mod:`ucm_server.store.pin_home`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import MISSING, OK, BlockResult, IoVec, Tier, failed

if TYPE_CHECKING:
    from ucm_server.store.cache import Reservation
    from ucm_server.store.leasing import Leasing


class PromotionHost(Protocol):
    """What a promotion needs of the pipeline (``ucm_server.store.pipeline.Pipeline``)."""

    tiers: list[Tier]
    top: Tier
    leasing: Leasing | None

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]: ...
    def begin_read(self) -> int: ...
    def end_read(self, started: int) -> None: ...
    def unwritten_since(self, key: BlockKey, started: int) -> bool: ...


__all__ = ["PromotionHost", "Promotions"]


class Promotions:
    """Prefetches in flight, by key, so a concurrent load waits for them instead of reading twice."""

    def __init__(self, pipeline: PromotionHost) -> None:
        self._pipeline = pipeline
        self._inflight: dict[BlockKey, asyncio.Future[None]] = {}

    @property
    def inflight(self) -> bool:
        """Some prefetch is promoting blocks now (a read that finds none skips :meth:`wait_for`'s
        list of its keys)."""
        return bool(self._inflight)

    async def wait_for(self, keys: Sequence[BlockKey]) -> None:
        """Return once no prefetch of any of ``keys`` is in flight (at once when none is)."""
        if not self._inflight:
            return
        pending = [f for f in map(self._inflight.get, keys) if f is not None]
        if pending:
            await asyncio.gather(*(asyncio.shield(f) for f in pending))

    async def copy_up(
        self, depth: int, items: list[tuple[BlockKey, IoVec]], started: int, *, first: int = 0
    ) -> None:
        """Copy blocks a read found at ``depth`` into the memory tiers above (from ``first``) —
        only blocks nobody wrote or deleted since the read began, and only where the tier has no
        copy (a failure is harmless). ``items`` must be daemon memory."""
        p = self._pipeline
        fresh = [(k, iov) for k, iov in items if p.unwritten_since(k, started)]
        below = not p.tiers[depth].pin_gap
        for tier in p.tiers[first:depth]:
            if tier.persistent or not fresh:
                continue
            sizes = await tier.lookup([k for k, _ in fresh])
            absent = [item for item, size in zip(fresh, sizes, strict=True) if size is None]
            if not absent:
                continue
            got = await tier.write_many(absent)
            if tier is p.top and p.leasing is not None and below:  # no await since: these versions
                for (key, _), r in zip(absent, got, strict=True):
                    if r.ok:
                        p.leasing.set_below(key, True)

    async def prefetch(self, keys: Sequence[BlockKey]) -> list[BlockResult]:
        """Promote ``keys`` into the top tier; OK for blocks there already or promoted, MISSING for
        blocks no tier holds, the lower tier's result for a failed read."""
        p = self._pipeline
        top = p.leasing
        sizes = await p.top.lookup(keys)
        # OK: in the top tier already, or being promoted by an earlier prefetch
        results: list[BlockResult] = [
            OK if s is not None or k in self._inflight else MISSING for k, s in zip(keys, sizes, strict=True)
        ]
        need = [i for i, s in enumerate(sizes) if s is None and keys[i] not in self._inflight]
        if top is None or not need or len(p.tiers) == 1:
            return results
        loop = asyncio.get_running_loop()
        mine = {keys[i]: loop.create_future() for i in need}
        self._inflight.update(mine)
        started = p.begin_read()
        try:
            lower = await p.lookup([keys[i] for i in need])
            todo = [(i, size) for i, size in zip(need, lower, strict=True) if size is not None]
            for tier in p.tiers[1:]:
                if not todo:
                    break
                reservations: list[tuple[int, int, Reservation]] = []
                for i, size in todo:
                    if top.holds(keys[i]):
                        results[i] = OK
                    elif (held := top.reserve(keys[i], size)) is not None:
                        reservations.append((i, size, held))
                    else:
                        results[i] = failed(f"no room in {p.top.name} to promote into")
                try:
                    got = await tier.read_many([(keys[i], top.views(res)) for i, _, res in reservations])
                except BaseException:
                    for _, _, reservation in reservations:
                        top.abort(reservation)
                    raise
                retry: list[tuple[int, int]] = []
                for (i, size, reservation), r in zip(reservations, got, strict=True):
                    results[i] = r
                    if r.ok and p.unwritten_since(keys[i], started) and not top.holds(keys[i]):
                        top.commit(reservation, below=not tier.pin_gap)
                    else:
                        top.abort(reservation)
                        if not r.ok:
                            retry.append((i, size))  # corrupt or unreadable here: try the next tier
                todo = retry
        finally:
            p.end_read(started)
            for key, fut in mine.items():
                self._inflight.pop(key, None)
                if not fut.done():
                    fut.set_result(None)
        return results
