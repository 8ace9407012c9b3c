"""A tier that wraps another and changes only its bytes: the base of the at-rest transforms.

(Unlike :class:`ucm_server.store.wrapper.TierWrapper`, which changes one behaviour and passes the
bytes through, a transform owns ``read_many``/``write_many`` and translates sizes.)

Encryption (:mod:`ucm_server.store.encrypted`) and compression (:mod:`ucm_server.store.compressed`)
store each block transformed inside the wrapped tier's payload. Everything but the bytes — life
cycle, figures, deletion, eviction, integrity checks of the stored object — is the wrapped tier's,
and the wrapper keeps its name, kind and flags, so operators and the pipeline see the same tier.
Sizes are the one thing both translate: a lookup reports what a reader gets back, not what is
stored, through :meth:`TransformTier.reader_size`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

from ucm_protocol.keys import BlockKey, Namespace
from ucm_server.store.base import BlockInfo, BlockResult, Tier
from ucm_server.store.copying import IoVec
from ucm_server.store.wrapper import TierWrapper

T = TypeVar("T")


class TransformTier(TierWrapper):
    """``inner`` seen through a transform of its blocks' bytes (subclasses: ``read_many``,
    ``write_many`` and :meth:`reader_size`). Life cycle, figures, deletion, eviction and integrity
    checks are :class:`TierWrapper`'s delegation; what touches bytes or sizes is overridden here."""

    def __init__(self, inner: Tier, executor: Executor | None = None) -> None:
        super().__init__(inner)
        self._executor = executor
        self.kind = inner.kind  # type: ignore[misc]

    def reader_size(self, namespace: bytes, stored: int | None) -> int | None:
        """The size a reader of a block stored in ``stored`` bytes gets; ``None``: absent."""
        return stored

    # -- sizes: what a reader gets --------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        sizes = await self.inner.lookup(keys)
        return [self.reader_size(k.namespace, s) for k, s in zip(keys, sizes, strict=True)]

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        sizes = await self.inner.lookup_digests(namespace, digests)
        return [self.reader_size(namespace, s) for s in sizes]

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        async for info in self.inner.list_blocks(namespace):
            size = self.reader_size(info.key.namespace, info.size)
            if size is not None:
                yield BlockInfo(info.key, size, info.tier, info.stored_at, info.checksum)

    async def info(self, key: BlockKey) -> BlockInfo | None:
        info = await self.inner.info(key)
        size = self.reader_size(key.namespace, info.size) if info is not None else None
        if info is None or size is None:
            return None
        return BlockInfo(info.key, size, info.tier, info.stored_at, info.checksum)

    # -- bytes: one block is a batch of one; nothing reaches a reader untransformed ------------------
    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return (await self.write_many([(key, src)]))[0]

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        return (await self.read_many([(key, dest)]))[0]

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        """Never the inner tier's read into client memory: it would hand over stored, untransformed
        bytes. ``None``: the pipeline reads through daemon memory (``read_many``)."""
        return None

    async def _run(self, fn: Callable[[], T]) -> T:
        """``fn`` in the daemon's executor, off the event loop (it transforms bytes)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
