"""Per-tenant quota accounting, once for every path that stores or reads blocks.

The host data path (per chunk), the GPU data path (when its task ends) and ``PutBlocks`` all go
through these few calls, at the same points as before they shared them:

* :meth:`Quota.claim` before a write's regions are found and pinned — the namespace is recorded as
  the tenant's (durably, off the event loop) before any block of it is written;
* :meth:`Quota.refuse_oversized` once the request is validated and before anything is copied — a block
  larger than the whole quota could never be kept (the block just written is never the one evicted);
* :meth:`Quota.account` after blocks are moved — a load refreshes them, a dump counts them and evicts
  the tenant's least-recently-used blocks over its quota (never another tenant's).

A daemon without tenants has no ledger: every call is then a no-op, and :attr:`Quota.enabled` lets
the hot paths skip building their arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ucm_protocol.errors import ResourceExhausted
from ucm_protocol.keys import BlockKey
from ucm_protocol.text import printable
from ucm_server.auth import current_principal
from ucm_server.retention import RetentionTable
from ucm_server.store.base import BlockInfo
from ucm_server.store.pipeline import Pipeline
from ucm_server.tasks import TaskKind
from ucm_server.tenants import TenantLedger

log = logging.getLogger(__name__)


class Quota:
    def __init__(
        self, ledger: TenantLedger | None, pipeline: Pipeline, retention: RetentionTable | None = None
    ) -> None:
        self.ledger = ledger
        self.pipeline = pipeline
        self.retention = retention
        if ledger is not None and retention is not None:
            ledger.pinned = retention.pinned

    @property
    def enabled(self) -> bool:
        return self.ledger is not None

    async def open(self) -> None:
        """Rebuild each tenant's usage from what survived a restart (oldest block first)."""
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

    async def claim(self, keys: Sequence[BlockKey]) -> None:
        """Before a tenant writes: record the namespace as the tenant's (durably, off the event loop,
        once per namespace) so what is written is accounted. Only writes do this; lookups and loads
        change no state on disk."""
        tenant = current_principal.get().tenant
        if self.ledger is not None and tenant:
            for ns in {key.namespace for key in keys}:
                await self.ledger.claim(tenant, ns)

    def refuse_oversized(self, sizes: Iterable[int]) -> None:
        """Refuse a block the tenant's quota could never hold: it would stay over the quota, as the
        block just written is never the one evicted."""
        tenant = current_principal.get().tenant
        quota = self.ledger.quota(tenant) if self.ledger is not None else 0
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
        if self.ledger is None or self.retention is None or not tenant:
            return 0
        return self.ledger.pinned_bytes(tenant, self.retention.pinned_keys())

    def check_pins(self, keys: Sequence[BlockKey], sizes: Sequence[int | None]) -> None:
        """Refuse pinning ``keys`` (stored, of ``sizes``) when their tenant's pinned bytes would pass
        its quota (RESOURCE_EXHAUSTED naming tenant, figures and the way out)."""
        if self.ledger is None or self.retention is None:
            return
        adding: dict[str, int] = {}
        for key, size in zip(keys, sizes, strict=True):
            tenant = self.ledger.owner(key)
            if size is not None and tenant and not self.retention.pinned(key):
                adding[tenant] = adding.get(tenant, 0) + size
        for tenant, extra in adding.items():
            quota, pinned = self.ledger.quota(tenant), self.pinned_bytes(tenant)
            if quota and pinned + extra > quota:
                raise ResourceExhausted(
                    f"pinning {extra} more bytes would pin {pinned + extra} bytes of tenant "
                    f"{printable(tenant, 64)}, above its quota of {quota} bytes ({pinned} pinned now): "
                    f"unpin some blocks or pin fewer"
                )

    def forgot(self, keys: list[BlockKey]) -> None:
        """Blocks deleted by their owner no longer count."""
        if self.ledger is not None:
            self.ledger.forgot(keys)

    async def account(self, kind: TaskKind, done: Sequence[tuple[BlockKey, int]]) -> None:
        """``done``: (key, bytes) of the blocks a task moved. A load refreshes them; a dump counts them
        and evicts the tenant's oldest blocks beyond its quota."""
        if self.ledger is None:
            return
        if kind is TaskKind.LOAD:
            self.ledger.touched([key for key, _ in done])
            return
        victims = [v for key, size in done for v in self.ledger.stored(key, size)]
        if victims:
            await self.pipeline.delete(victims)
            owner = self.ledger.owner(victims[0]) or ""
            log.info("quota: evicted %d blocks of tenant %s", len(victims), printable(owner, 64))
