"""Where a pin is held: in the tier where the block durably lives, not in every tier it passes.

A tier whose eviction holds pins (the Cache, Posix) never evicts a pinned block it must hold. In a
pipeline whose Cache sits above such a tier (Cache|Posix), that lower tier is where a pinned block
lives: the Cache is a cache of it, for pinned blocks too. It evicts unpinned blocks first (by the
retention rules' order), and only then pinned blocks whose copy is safe below — their write-down
succeeded, or they were promoted from there — least recently used first. A block the Cache alone
holds is never evicted while pinned: its write-back still under way (leased), a write-down that
failed, or a copy the tier below evicted while it was unpinned. The Cache knows which of its
versions are safe below (the write-back, write-through and promotion paths tell it), a saturated
node's ``cache-only`` overflow writes a pinned block through instead of leaving it in the Cache
alone, and :func:`hold_pins` settles the rest when a block is pinned.

In a Cache-only pipeline, or above tiers that do not hold pins (Cache|DS3FS), the Cache holds every
pinned block itself, as the Posix tier does in a Posix-only one. The pin budget
(:mod:`ucm_server.pin_budget`) counts in each tier the pinned blocks it must hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ucm_protocol.keys import BlockKey

if TYPE_CHECKING:
    from ucm_server.store.pipeline import Pipeline


async def hold_pins(pipeline: Pipeline, keys: Sequence[BlockKey]) -> None:
    """Around a pin of ``keys`` (before its budget is checked, and again once the rule is in force):
    the blocks' write-backs under way end first, so the pin finds each block where it lives; and a
    cached copy that no tier below holding pins has any more (evicted there while unpinned) becomes
    the Cache's to keep, never evicted while pinned."""
    top = pipeline.leasing
    if top is None or not top.pins_below:
        return
    for key in keys:
        await pipeline.queue.settle(key)
    cached = [k for k in keys if top.holds(k) and not top.keeps(k)]
    if not cached:
        return
    found = [False] * len(cached)
    for tier in pipeline.tiers[1:]:
        if not tier.pin_gap:
            for i, size in enumerate(await tier.lookup(cached)):
                found[i] = found[i] or size is not None
    for key, below in zip(cached, found, strict=True):
        if not below:
            top.set_below(key, False)
