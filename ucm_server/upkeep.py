"""Operator upkeep: list, inspect, evict and verify (with repair) the blocks the tiers hold.

One job, apart from the data path: what ``ucm-admin ls/inspect/evict/verify`` asks of the daemon. It
reads the tiers directly (an operator looks at each tier, not at the pipeline's merged view) and names
blocks as they are stored (:func:`ucm_server.authz.store_namespace`: an operator's names are the
ones ``ucm-admin ls`` shows); it takes the engine's key check as a callable, so the batch limit stays
where the data path defines it. It answers names, sizes and figures, never a block's bytes.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import AsyncIterator, Callable, Sequence

from ucm_protocol.errors import InvalidArgument, NotFound
from ucm_protocol.keys import BlockKey, Namespace, check_namespace, make_keys
from ucm_server.retention import RetentionTable, Rule
from ucm_server.store.base import BlockInfo, Tier
from ucm_server.store.pipeline import Pipeline

KeyCheck = Callable[[bytes, Sequence[bytes]], list[BlockKey]]
"""``(namespace, digests) -> keys``: the engine's batch limit and checks, namespaces as stored."""


Listed = tuple[BlockInfo, list[str], Rule]
"""A block as an operator sees it: what a tier knows of it, the tiers holding it, its retention."""


class Upkeep:
    def __init__(self, pipeline: Pipeline, keys: KeyCheck, rules: RetentionTable) -> None:
        self.pipeline = pipeline
        self._keys = keys
        self.rules = rules

    async def inspect(self, namespace: bytes, digest: bytes) -> Listed:
        (key,) = make_keys(namespace, [digest])
        best: BlockInfo | None = None
        where: list[str] = []
        for tier in self.pipeline.tiers:
            info = await tier.info(key)
            if info is not None:
                where.append(tier.name)
                if best is None or (best.checksum is None and info.checksum is not None):
                    best = info
        if best is None:
            raise NotFound(f"block {key.hex()} is in no tier")
        return best, where, self.rules.get(key)

    async def list_blocks(
        self, namespace: bytes, tier: str, page_size: int, page_token: str
    ) -> tuple[list[Listed], str, int]:
        ns = Namespace(check_namespace(namespace)) if namespace else None
        if tier:
            self.tier_named(tier)
        if page_size > 10000:
            raise InvalidArgument(f"page_size {page_size} is above the limit 10000")
        page_size = page_size or 100
        after: bytes = b""
        if page_token:
            try:
                after = BlockKey.from_hex(page_token)
            except InvalidArgument:
                raise InvalidArgument(f"bad page_token {page_token!r}") from None
        merged: dict[BlockKey, tuple[BlockInfo, list[str]]] = {}
        async for info in self.pipeline.list_blocks(ns, tier):
            if info.key in merged:
                merged[info.key][1].append(info.tier)
            else:
                merged[info.key] = (info, [info.tier])
        # The token is the last key returned (keys sort as namespace then digest): pages stay stable
        # while blocks come and go, and each page costs O(n log page) rather than a full sort.
        later = [k for k in merged if k > after] if after else list(merged)
        page_keys = heapq.nsmallest(page_size + 1, later)
        more = len(page_keys) > page_size
        page = [(*merged[k], self.rules.get(k)) for k in page_keys[:page_size]]
        next_token = page_keys[page_size - 1].hex() if more else ""
        return page, next_token, len(merged)

    def tier_named(self, name: str) -> Tier:
        """The tier an operator named (by name or kind), or INVALID_ARGUMENT listing this daemon's."""
        try:
            return self.pipeline.tier(name)
        except KeyError:
            known = ", ".join(t.name for t in self.pipeline.tiers)
            raise InvalidArgument(f"unknown tier {name!r}; this daemon has: {known}") from None

    async def evict(
        self, tier_name: str, nbytes: int, namespace: bytes, digests: Sequence[bytes], everything: bool
    ) -> tuple[int, int]:
        if not tier_name:
            raise InvalidArgument("evict needs a tier name")
        tier = self.tier_named(tier_name)
        # One target, as ucm-admin asks: a request naming several used to run one and ignore the rest
        # (keys + all evicted only the keys), and a namespace of the wrong size with all matched nothing.
        targets = (("keys", bool(digests)), ("min_bytes", nbytes > 0), ("all", everything))
        chosen = [name for name, on in targets if on]
        if len(chosen) > 1:
            raise InvalidArgument(f"evict takes one target: keys, min_bytes or all (got {', '.join(chosen)})")
        if namespace and not digests:
            if not everything:
                raise InvalidArgument("namespace narrows keys or all, not min_bytes")
            check_namespace(namespace)
        if digests:
            keys = self._keys(namespace, digests)
            sizes = await tier.lookup(keys)
            n = await tier.delete(keys)
            return n, sum(s or 0 for s in sizes)
        if everything:
            keys = [info.key async for info in tier.list_blocks(Namespace(namespace) if namespace else None)]
            sizes = await tier.lookup(keys)
            n = await tier.delete(keys)
            return n, sum(s or 0 for s in sizes)
        if nbytes <= 0:
            raise InvalidArgument("evict needs bytes > 0, keys, or all")
        before = tier.stats().blocks
        freed = await tier.evict(nbytes)
        return before - tier.stats().blocks, freed

    async def verify(
        self, tier_name: str, namespace: bytes, quarantine: bool = True
    ) -> AsyncIterator[tuple[int, int, list[str]]]:
        """Re-check every block of the persistent tiers; yields (checked, total, new corrupt) now and then.

        A corrupt copy is moved aside (``quarantine``) and, when another tier still holds a good copy,
        rewritten from it, so a block stays as durable as it was."""
        if tier_name:
            tiers = [self.tier_named(tier_name)]
        else:
            tiers = [t for t in self.pipeline.tiers if t.persistent]
        ns = Namespace(check_namespace(namespace)) if namespace else None
        work: list[tuple[Tier, BlockKey]] = []
        for tier in tiers:
            work += [(tier, info.key) async for info in tier.list_blocks(ns)]
        total = len(work)
        bad: list[str] = []
        last = time.monotonic()
        yield 0, total, []
        for checked, (tier, key) in enumerate(work, start=1):
            r = await tier.verify(key, quarantine=quarantine)
            if not r.ok and r.reason:
                repaired = await self._repair(tier, key) if quarantine else False
                note = " (repaired from another tier)" if repaired else ""
                bad.append(f"{tier.name}:{key.hex()}: {r.reason}{note}")
            if bad or time.monotonic() - last > 0.2 or checked == total:
                yield checked, total, bad
                bad, last = [], time.monotonic()

    async def _repair(self, broken: Tier, key: BlockKey) -> bool:
        for tier in self.pipeline.tiers:
            if tier is broken:
                continue
            (size,) = await tier.lookup([key])
            if size is None:
                continue
            scratch = [memoryview(bytearray(size))]
            if (await tier.read_into(key, scratch)).ok:
                return (await broken.write_from(key, scratch)).ok
        return False
