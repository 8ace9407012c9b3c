"""A tier that is another tier: the base of every wrapper that changes one thing about a backend.

Cross-cutting concerns wrap a backend rather than live in it: the fault and latency injectors of
:mod:`ucm_server.testing.faults`, and the KV events of a tier without a watchable index
(:mod:`ucm_server.store.observed`). A wrapper delegates every primitive and every batch or derived
method the inner tier may override, so wrapping costs a tier none of its speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.base import BlockInfo, BlockResult, EvictionRules, IoVec, Tier, TierStats

__all__ = ["TierWrapper"]


class TierWrapper(Tier):
    """A tier that is another tier: every primitive and every batch or derived method the inner
    tier may override is delegated, and the capability flags are the inner tier's. Subclasses change
    one behaviour (and say which derived methods must then go through their primitives)."""

    kind: ClassVar[str] = "Wrapper"

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.name)
        self.inner = inner
        for flag in ("persistent", "shared", "max_concurrency", "pin_gap"):  # a wrapper is what it wraps
            setattr(self, flag, getattr(inner, flag))

    def use_rules(self, rules: EvictionRules) -> None:
        super().use_rules(rules)
        self.inner.use_rules(rules)

    @property
    def indexing(self) -> bool:
        return self.inner.indexing

    async def indexed(self) -> None:
        await self.inner.indexed()

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        return await self.inner.lookup(keys)

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        return await self.inner.lookup_digests(namespace, digests)

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return await self.inner.read_into(key, dest)

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return await self.inner.write_from(key, src)

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        return await self.inner.delete(keys)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        async for info in self.inner.list_blocks(namespace):
            yield info

    def stats(self) -> TierStats:
        return dataclasses.replace(self.inner.stats(), kind=self.kind)

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        return await self.inner.read_many(items)

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        return await self.inner.write_many(items)

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        return await self.inner.read_checked(key, dest)

    async def info(self, key: BlockKey) -> BlockInfo | None:
        return await self.inner.info(key)

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        return await self.inner.verify(key, quarantine=quarantine)

    def footprint(self, size: int) -> int:
        return self.inner.footprint(size)

    async def evict(self, nbytes: int) -> int:
        return await self.inner.evict(nbytes)
