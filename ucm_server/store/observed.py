"""KV events for a tier without a watchable index: what this daemon learns of it, as it learns it.

The Cache, Posix and DS3FS tiers report every change of their in-memory index
(:mod:`ucm_server.store.watch`). Mooncake, S3 and any third-party tier keep no such index: the
cluster or the bucket is the truth, and other nodes change it. :class:`ObservedTier` wraps such a
tier and reads the facts off the results of the calls the daemon makes anyway, the way the DS3FS
tier's index learns of other nodes' entries:

========================================  =================================================
a write that succeeded                    stored
a lookup, read, ``info`` or listing that  stored (another daemon's block, or a block that
finds the block                           came back)
a lookup, read or ``info`` that finds it  removed, if it had been announced: another node
missing                                   deleted it, or it expired ("when the daemon learns")
a delete                                  removed (when the tier reports fewer deleted than
                                          asked, one lookup of those keys says which stayed)
========================================  =================================================

A failed call (FAILED, a timeout) changes nothing, except where the tier itself reports a failed
lookup as a miss (S3, Mooncake): the daemon then answers "absent" to its clients too, and the
stream says the same until a later lookup finds the block again. What a tier evicts by its own
policy (:meth:`~ucm_server.store.base.Tier.evict`) is learned by the next lookup or load.

The store assembly wraps every tier that is not :class:`~ucm_server.store.watch.Watchable` when KV
events are on (its ``observation`` layer, :mod:`ucm_server.store.assembly`); without them nothing is
wrapped.
Attributes the wrapper does not define are the inner tier's (``object_name``, ``bucket``...).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.base import BlockInfo, BlockResult, BlockState, IoVec, Tier, TierStats
from ucm_server.store.watch import IndexWatch
from ucm_server.store.wrapper import TierWrapper

__all__ = ["ObservedTier"]


class ObservedTier(TierWrapper):
    """``inner`` made :class:`~ucm_server.store.watch.Watchable` from what its calls return."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        setattr(self, "kind", inner.kind)  # noqa: B010 - it is the inner tier to every reader
        self._watch: IndexWatch | None = None

    def __getattr__(self, name: str) -> Any:
        """The inner tier's own attributes (``object_name``, ``bucket``, ``io_path``...)."""
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def watch_index(self, watch: IndexWatch) -> None:
        """Attach before the tier is used; nothing is known of the tier until its first call."""
        self._watch = watch

    def stats(self) -> TierStats:
        return self.inner.stats()

    @property
    def indexing(self) -> bool:
        return self.inner.indexing

    async def indexed(self) -> None:
        await self.inner.indexed()

    # -- the facts, read off results ---------------------------------------------------------------------
    def _sizes(self, keys: Sequence[BlockKey], sizes: Sequence[int | None]) -> None:
        if (w := self._watch) is not None:
            for key, size in zip(keys, sizes, strict=True):
                if size is None:
                    w.removed(key)
                else:
                    w.stored(key)

    def _results(self, keys: Sequence[BlockKey], results: Sequence[BlockResult | None]) -> None:
        if (w := self._watch) is not None:
            for key, r in zip(keys, results, strict=True):
                if r is None:
                    continue
                if r.state is BlockState.OK:
                    w.stored(key)
                elif r.state is BlockState.MISSING:
                    w.removed(key)

    # -- observed calls -----------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        sizes = await self.inner.lookup(keys)
        self._sizes(keys, sizes)
        return sizes

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        sizes = await self.inner.lookup_digests(namespace, digests)
        if self._watch is not None:
            self._sizes([BlockKey(namespace, d) for d in digests], sizes)
        return sizes

    async def info(self, key: BlockKey) -> BlockInfo | None:
        found = await self.inner.info(key)
        self._sizes([key], [None if found is None else found.size])
        return found

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        """Every block listed is announced; one not listed is not removed (a listing that failed
        part way looks the same as a short one)."""
        async for info in self.inner.list_blocks(namespace):
            if self._watch is not None:
                self._watch.stored(info.key)
            yield info

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        r = await self.inner.read_into(key, dest)
        self._results([key], [r])
        return r

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        results = await self.inner.read_many(items)
        self._results([k for k, _ in items], results)
        return results

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        r = await self.inner.read_checked(key, dest)
        self._results([key], [r])
        return r

    async def read_checked_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult | None]:
        results = await self.inner.read_checked_many(items)
        self._results([k for k, _ in items], results)
        return results

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        r = await self.inner.verify(key, quarantine=quarantine)
        self._results([key], [r])
        return r

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        r = await self.inner.write_from(key, src)
        self._results([key], [r] if r.ok else [None])
        return r

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        results = await self.inner.write_many(items)
        self._results([k for k, _ in items], [r if r.ok else None for r in results])
        return results

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        n = await self.inner.delete(keys)
        if self._watch is not None and keys:
            if n >= len(set(keys)):
                self._sizes(keys, [None] * len(keys))
            else:  # some were absent, or stayed (a Mooncake block another node reads): ask which
                await self.lookup(keys)
        return n
