"""Per-tenant quota accounting, once for every path that stores or reads blocks.

The host and GPU movers (chunk by chunk) and ``PutBlocks`` all go through these few calls, at the same
points:

* :meth:`Quota.claim` before a write's regions are found and pinned — the namespace is recorded as
  the tenant's (durably, off the event loop) before any block of it is written;
* :meth:`Quota.admit_write` once the request is validated and before anything is copied — a block
  larger than the whole quota could never be kept (the block just written is never the one evicted),
  and a pinned block rewritten larger takes more of its owner's pin budget;
* :meth:`Quota.settle` after blocks are moved (every mover tells it each chunk) — a load refreshes
  them, a dump counts them and evicts the tenant's least-recently-used blocks over its quota (never
  another tenant's);
* :meth:`Quota.check_pins` / :meth:`Quota.pinned` / :meth:`Quota.forgot` for pins, which count
  against their owner's budget for every principal, tenants or not, in the tiers that must hold
  them (:mod:`ucm_server.pin_budget`).

A daemon without tenants has no ledger: the byte quotas are then no-ops, and :attr:`Quota.enabled`
lets the hot paths skip building their arguments; the pin budget holds with or without one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ucm_protocol.errors import ResourceExhausted
from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey
from ucm_protocol.text import printable
from ucm_server.auth import current_principal
from ucm_server.pin_budget import PinBook, bounded_tiers
from ucm_server.retention import RetentionTable
from ucm_server.store.base import BlockInfo, BlockResult
from ucm_server.store.pipeline import Pipeline
from ucm_server.tasks import TaskKind
from ucm_server.tenants import TenantLedger

log = logging.getLogger(__name__)


class Quota:
    def __init__(
        self,
        ledger: TenantLedger | None,
        pipeline: Pipeline,
        retention: RetentionTable | None = None,
        *,
        pin_reserve: float = 0.25,
        pin_share: float = 0.5,
    ) -> None:
        self.ledger = ledger
        self.pipeline = pipeline
        self.retention = retention
        self._pin_bounds = (pin_reserve, pin_share)
        self._pins: PinBook | None = None
        self._pinning: set[bytes] = set()
        """Keys counted by :meth:`check_pins` whose rule is still being recorded."""
        if ledger is not None and retention is not None:
            ledger.pinned = retention.pinned

    @property
    def enabled(self) -> bool:
        return self.ledger is not None

    @property
    def pins(self) -> PinBook:
        """The pinned blocks' book, over the pipeline's tiers as they are when first asked (built)."""
        if self._pins is None:
            reserve, share = self._pin_bounds
            top = self.pipeline.leasing
            keeps = top.keeps if top is not None and top.pins_below else None
            self._pins = PinBook(bounded_tiers(self.pipeline.tiers, keeps), reserve=reserve, share=share)
        return self._pins

    async def open(self) -> None:
        """Rebuild each tenant's usage and the pins' book from what survived a restart."""
        await self._open_pins()
        if self.ledger is None:
            return
        seen: dict[BlockKey, BlockInfo] = {}
        for tier in self.pipeline.tiers:
            async for info in tier.list_blocks():
                seen.setdefault(info.key, info)
        for info in sorted(seen.values(), key=lambda i: i.stored_at):
            self.ledger.stored(info.key, info.size)
        # One snapshot of the namespaces that still hold blocks: the journal stays bounded.
        await self.ledger.compact({key.namespace for key in seen})

    async def _open_pins(self) -> None:
        if self.retention is None or not self.retention.pinned_count:
            return
        keys = [_as_key(k) for k in self.retention.pinned_keys()]
        sizes = await self.pipeline.lookup(keys)
        for key, size in zip(keys, sizes, strict=True):
            if size is not None:
                self.pins.add(self._owner(key), [(key, size)])

    def _owner(self, key: BlockKey) -> str:
        """The tenant a stored block belongs to ("" = the default tenant: the ledger names the rest)."""
        return (self.ledger.owner(key) if self.ledger is not None else None) or ""

    def _quota_of(self, tenant: str) -> int:
        return self.ledger.quota(tenant) if self.ledger is not None else 0

    async def claim(self, keys: Sequence[BlockKey]) -> None:
        """Before a tenant writes: record the namespace as the tenant's (durably, off the event loop,
        once per namespace) so what is written is accounted. Only writes do this; lookups and loads
        change no state on disk."""
        tenant = current_principal.get().tenant
        if self.ledger is not None and tenant:
            for ns in {key.namespace for key in keys}:
                await self.ledger.claim(tenant, ns)

    def admit_write(self, keys: Sequence[BlockKey], sizes: Iterable[int]) -> None:
        """Before a write copies anything: refuse a block the caller's quota could never hold, and
        a pinned block rewritten larger than its owner's pin budget allows."""
        sizes = list(sizes)
        self.refuse_oversized(sizes)
        pins = self._pins
        if not pins:
            return
        grown = [(k, s) for k, s in zip(keys, sizes, strict=True) if k in pins and s > pins.size(k)]
        if grown:
            tenant = current_principal.get().tenant
            pins.check(tenant, self._quota_of(tenant), grown)
            pins.add(tenant, grown)

    def refuse_oversized(self, sizes: Iterable[int]) -> None:
        """Refuse a block the tenant's quota could never hold: it would stay over the quota, as the
        block just written is never the one evicted."""
        tenant = current_principal.get().tenant
        quota = self._quota_of(tenant)
        biggest = max(sizes, default=0) if quota else 0
        if biggest > quota:
            raise ResourceExhausted(
                f"a block of {biggest} bytes is larger than the quota of tenant {printable(tenant, 64)} "
                f"({quota} bytes)"
            )
        pinned = self.pinned_bytes(tenant) if biggest else 0
        if biggest > quota - pinned:
            raise ResourceExhausted(
                f"tenant {printable(tenant, 64)} has {pinned} of its {quota} quota bytes pinned: a block of "
                f"{biggest} bytes does not fit (unpin some blocks first)"
            )

    def pinned_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s pinned blocks (they count against its quota)."""
        return self._pins.bytes_of(tenant) if self._pins is not None else 0

    def check_pins(self, keys: Sequence[BlockKey], sizes: Sequence[int | None]) -> list[BlockKey]:
        """Refuse pinning ``keys`` (stored, of ``sizes``) for the caller when its pinned bytes would
        pass its budget (its quota, or ``pin_share`` of a tier without one) or pins would take a
        tier's reserve (RESOURCE_EXHAUSTED naming the bound, the figures and the way out); else
        count them at once, before the rule is recorded, so a concurrent pin sees them. Returns the
        keys it counted (to :meth:`unpinned` if recording the rule fails)."""
        tenant = current_principal.get().tenant
        adding = [(k, s) for k, s in zip(keys, sizes, strict=True) if s is not None and k not in self.pins]
        try:
            self.pins.check(tenant, self._quota_of(tenant), adding)
        except ResourceExhausted:
            # Pins forgotten another way no longer count; blocks written down since no longer in the Cache.
            self.pins.refresh(self._still_pinned)
            self.pins.check(tenant, self._quota_of(tenant), adding)
        self.pins.add(tenant, adding)
        counted = [k for k, _ in adding]
        self._pinning.update(counted)
        return counted

    def _still_pinned(self, key: bytes) -> bool:
        return key in self._pinning or self.retention is None or self.retention.pinned(key)

    def pinned(self, keys: Sequence[BlockKey], sizes: Sequence[int | None]) -> None:
        """Blocks the caller pinned (once the rule is recorded): they count against its budget, in
        the tiers that must hold them now."""
        tenant = current_principal.get().tenant
        self.pins.add(tenant, [(k, s) for k, s in zip(keys, sizes, strict=True) if s is not None])
        self._pinning.difference_update(keys)

    def unpinned(self, keys: Sequence[BlockKey]) -> None:
        self._pinning.difference_update(keys)
        if self._pins is not None:
            self._pins.drop(keys)

    def forgot(self, keys: list[BlockKey]) -> None:
        """Blocks deleted (by their owner, or expired) no longer count, pinned or not."""
        self.unpinned(keys)
        if self.ledger is not None:
            self.ledger.forgot(keys)

    async def settle(
        self,
        kind: TaskKind,
        keys: Sequence[BlockKey],
        sizes: Sequence[int],
        results: Sequence[BlockResult],
    ) -> None:
        """What a chunk of a task (or a PutBlocks block) moved, told by every mover alike: a load
        refreshes its blocks; a dump counts them and evicts the tenant's oldest blocks beyond its
        quota (never another tenant's, never a pinned one)."""
        if self.ledger is None:
            return
        done = [key for key, r in zip(keys, results, strict=True) if r.ok]
        if kind is TaskKind.LOAD:
            self.ledger.touched(done)
            return
        stored = (
            v for k, n, r in zip(keys, sizes, results, strict=True) if r.ok for v in self.ledger.stored(k, n)
        )
        victims = list(stored)
        if victims:
            await self.pipeline.delete(victims)
            owner = self.ledger.owner(victims[0]) or ""
            log.info("quota: evicted %d blocks of tenant %s", len(victims), printable(owner, 64))


def _as_key(key: bytes) -> BlockKey:
    return key if isinstance(key, BlockKey) else BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])
