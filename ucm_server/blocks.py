"""The calls that name blocks but hold no client memory: Lookup, Delete, SetRetention, and the slow
path's GetBlocks and PutBlocks (bytes inside messages).

Every namespace a call names is resolved here, through the one authorization rule
(:meth:`ucm_server.authz.Authorizer.namespace`: checked, mapped into the caller's tenant, never
another tenant's), and every batch is held to ``max_batch_blocks``; the submit path takes its keys
from here too. An expired block is never answered present. PutBlocks counts against the tenant's
quota exactly as a Dump does; a GetBlocks reply holds its block's bytes from one daemon-wide budget
(``reply_bytes``) until gRPC has sent it.
"""

from __future__ import annotations

import operator
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from itertools import repeat

from ucm_protocol.errors import FailedPrecondition, InvalidArgument
from ucm_protocol.keys import BlockKey, check_digests, make_keys
from ucm_server.authz import Authorizer, store_namespace
from ucm_server.expiry import Expiry
from ucm_server.metrics import Metrics
from ucm_server.quota import Quota
from ucm_server.reply_budget import ReplyBudget
from ucm_server.retention import Change, RetentionTable
from ucm_server.store.base import BlockResult, BlockState
from ucm_server.store.pin_home import hold_pins
from ucm_server.store.pipeline import Pipeline
from ucm_server.tasks import TaskKind


@dataclass(frozen=True, slots=True)
class RetentionAnswer:
    applied: int
    missing: int
    not_enforced: list[str]


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    present: bytes  # one byte per key: 1 stored, 0 not (the wire's ``present_bytes`` as it is)
    hit_prefix: int


@dataclass(frozen=True, slots=True)
class BlockLimits:
    max_batch_blocks: int
    max_block_bytes: int


class Blocks:
    def __init__(
        self,
        limits: BlockLimits,
        authz: Authorizer,
        pipeline: Pipeline,
        retention: RetentionTable,
        quota: Quota,
        expiry: Expiry,
        metrics: Metrics,
        reply_budget: ReplyBudget,
    ) -> None:
        self.limits = limits
        self.authz = authz
        self.pipeline = pipeline
        self.retention = retention
        self.quota = quota
        self.expiry = expiry
        self.metrics = metrics
        self.reply_budget = reply_budget
        self.lookups = self.lookup_keys = self.lookup_hits = 0

    # -- names ------------------------------------------------------------------------------------------
    def check_batch(self, digests: Sequence[bytes]) -> None:
        if len(digests) > self.limits.max_batch_blocks:
            raise InvalidArgument(
                f"{len(digests)} keys in one request; the limit is {self.limits.max_batch_blocks}"
            )

    def keys(self, namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
        """The keys a data call names, in the caller's tenant."""
        self.check_batch(digests)
        return make_keys(self.authz.namespace(namespace), digests)

    def store_keys(self, namespace: bytes, digests: Sequence[bytes]) -> list[BlockKey]:
        """Keys as an Admin call names them: as stored (the batch limit still holds)."""
        self.check_batch(digests)
        return make_keys(store_namespace(namespace), digests)

    # -- the calls --------------------------------------------------------------------------------------
    async def lookup(
        self, namespace: bytes, digests: Sequence[bytes], *, checked: bool = False
    ) -> LookupAnswer:
        """Presence of each key and the hit prefix; ``checked`` = digests are known to be 32 bytes."""
        self.check_batch(digests)
        ns = self.authz.namespace(namespace)
        if not checked:
            check_digests(digests)
        await self.expiry.due()  # an expired block is never answered present
        sizes, complete = await self.pipeline.lookup_presence(ns, digests)  # no per-key objects
        if complete or None not in sizes:  # all found (a repeated prompt): no per-key pass at all
            present, prefix, hits = b"\x01" * len(sizes), len(sizes), len(sizes)
        else:
            present = bytes(map(operator.is_not, sizes, repeat(None)))  # C-level: a byte per key, 0 or 1
            prefix = present.find(0)
            hits = present.count(1)
        self.lookups += 1
        self.lookup_keys += len(digests)
        self.lookup_hits += hits
        self.metrics.observe_lookup(len(digests), hits)
        return LookupAnswer(present, prefix)

    async def delete(self, namespace: bytes, digests: Sequence[bytes]) -> int:
        keys = self.keys(namespace, digests)
        self.quota.forgot(keys)
        deleted = await self.pipeline.delete(keys)
        await self.retention.forget(keys)
        return deleted

    async def set_retention(
        self, namespace: bytes, digests: Sequence[bytes], change: Change, *, require_all_tiers: bool = False
    ) -> RetentionAnswer:
        """Pin/unpin, expire or prioritise the stored blocks among ``digests`` (of the caller's
        tenant). A pin where some tier cannot hold it is refused with ``require_all_tiers``, else
        reported; a pin past the caller's pin budget is refused whole (RESOURCE_EXHAUSTED)."""
        keys = self.keys(namespace, digests)
        if not keys:
            raise InvalidArgument("empty batch: no keys given")
        gaps = self.pipeline.pin_gaps() if change.pin else []
        if gaps and require_all_tiers:
            raise FailedPrecondition("cannot pin in every tier: " + "; ".join(gaps))
        await self.expiry.due()
        sizes = await self.pipeline.lookup(keys)
        stored = [k for k, size in zip(keys, sizes, strict=True) if size is not None]
        counted: list[BlockKey] = []
        if change.pin:  # each block's write-back first: the budget counts it where it lives
            await hold_pins(self.pipeline, stored)
            counted = self.quota.check_pins(keys, sizes)
        try:
            await self.retention.change(stored, change, time.time())
        except BaseException:
            self.quota.unpinned(counted)
            raise
        if change.pin:  # the rule in force: a tier below keeps them now; a copy it lost stays cached
            await hold_pins(self.pipeline, stored)
            self.quota.pinned(keys, sizes)
        elif change.pin is False:
            self.quota.unpinned(stored)
        return RetentionAnswer(len(stored), len(keys) - len(stored), gaps)

    async def get_bytes(
        self, namespace: bytes, digests: Sequence[bytes]
    ) -> AsyncIterator[tuple[int, BlockResult, bytes]]:
        keys = self.keys(namespace, digests)
        sizes = await self.pipeline.lookup(keys)
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if size is None:
                yield i, BlockResult(BlockState.MISSING), b""
                continue
            async with self.reply_budget.hold(size):  # until the reply is sent: see ReplyBudget
                buf = bytearray(size)
                (r,) = await self.pipeline.read_many([(key, [memoryview(buf)])], owned=True)
                data = bytes(buf) if r.ok else b""
                del buf
                yield i, r, data

    async def put_bytes(self, namespace: bytes, digest: bytes, data: bytes) -> BlockResult:
        (key,) = self.keys(namespace, [digest])
        if not data:
            raise InvalidArgument("block data is empty")
        if len(data) > self.limits.max_block_bytes:
            raise InvalidArgument(
                f"block is {len(data)} bytes, more than max_block_bytes {self.limits.max_block_bytes}"
            )
        self.quota.admit_write([key], [len(data)])
        await self.quota.claim([key])
        (r,) = await self.pipeline.write_many([(key, [memoryview(data)])], owned=True)
        await self.quota.settle(TaskKind.DUMP, [key], [len(data)], [r])
        return r
