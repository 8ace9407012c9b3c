"""A tier whose reads, writes, lookups and deletes are OpenTelemetry spans: which tier served a request.

:class:`TracedTier` wraps every tier of the pipeline when the daemon traces (``tracing_exporter:
otlp``); when it does not, nothing is wrapped and this module is never imported. Each call becomes
one span, ``ucm.tier.read`` / ``ucm.tier.write`` / ``ucm.tier.lookup`` / ``ucm.tier.delete``, named
by the tier and carrying the blocks asked for, the bytes moved and how many blocks were found
(``ucm.hits``), missing (``ucm.misses``) or failed (``ucm.failed``): a load served from the Cache
shows one ``ucm.tier.read`` of ``Cache``; one that had to go to disk shows a second of ``Posix``
(the promotion into the Cache is that read, straight into the Cache's reserved pages).

Spans are made only inside a recording span (a traced RPC or task, :mod:`ucm_server.tracing`):
the write-back flushers, expiry and index upkeep run outside any request and are not traced, so a
busy daemon does not open a new trace per background write. Every read that returns blocks also
counts them per tier into the running task's tally (:data:`served`), which the task span reports as
``ucm.tier.served``.

The top tier's leasing capability (:mod:`ucm_server.store.leasing`) is this wrapper's too: the
pipeline's in-order read for a Load's progress word (``read_in_order``) is traced like any read,
and the other leasing calls go straight to the Cache, untouched.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Tracer

from ucm_protocol import tracing as names
from ucm_protocol.keys import BlockKey, Namespace
from ucm_protocol.states import BlockState
from ucm_server.store.base import BlockInfo, BlockResult, Tier, TierStats
from ucm_server.store.copying import IoVec, iov_len
from ucm_server.store.leasing import leasing_of
from ucm_server.store.wrapper import TierWrapper

__all__ = ["TracedTier", "served"]

served: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "ucm_tier_served", default=None
)
"""The running task's blocks returned per tier (set by the task's span, filled by the tier spans)."""

_LEASING_CALLS = (
    "lease",
    "lease_for_read",
    "reserve",
    "make_room",
    "host_runs",
    "views",
    "holds",
    "commit",
    "abort",
)


class TracedTier(TierWrapper):
    """``inner``, with a span per call made inside a traced request."""

    def __init__(self, inner: Tier, tracer: Tracer) -> None:
        super().__init__(inner)
        setattr(self, "kind", inner.kind)  # noqa: B010 - it is the inner tier to every reader
        self._tracer = tracer
        self._attributes = {names.TIER: inner.name, names.TIER_KIND: inner.kind}
        self._read_in_order: Callable[..., Any] | None = None
        leasing = leasing_of(inner)
        if leasing is not None:  # the pipeline leases through this wrapper: the same calls, unwrapped
            self.arena = leasing.arena
            for call in _LEASING_CALLS:
                setattr(self, call, getattr(leasing, call))
            self._read_in_order = leasing.read_in_order

    def __getattr__(self, name: str) -> Any:
        """The inner tier's own attributes (``watch_index``, ``object_name``, ``bucket``...)."""
        if name.startswith("__") or name in ("inner", "_tracer", "_attributes", "_read_in_order"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def stats(self) -> TierStats:
        return self.inner.stats()

    def _span(self, operation: str, blocks: int) -> Span | None:
        """A span for this call, or None outside a traced request (background work, unsampled)."""
        if not trace.get_current_span().is_recording():
            return None
        span = self._tracer.start_span(f"ucm.tier.{operation}", attributes=self._attributes)
        span.set_attribute(names.BLOCKS, blocks)
        return span

    # -- reads ------------------------------------------------------------------------------------------
    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        span = self._span("read", len(items))
        if span is None:
            return await self.inner.read_many(items)
        with trace.use_span(span, end_on_exit=True):
            results = await self.inner.read_many(items)
            self._read_outcome(span, items, results)
            return results

    async def read_checked_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult | None]:
        span = self._span("read", len(items))
        if span is None:
            return await self.inner.read_checked_many(items)
        with trace.use_span(span, end_on_exit=True):
            span.set_attribute("ucm.tier.checked_in_place", True)
            results = await self.inner.read_checked_many(items)
            self._read_outcome(span, items, results)
            return results

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        (r,) = await self.read_many([(key, dest)])
        return r

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        (r,) = await self.read_checked_many([(key, dest)])
        return r

    async def read_in_order(
        self, items: Sequence[tuple[BlockKey, IoVec]], report: Callable[[int], None]
    ) -> list[BlockResult] | None:
        """The Cache's in-order copy for a Load's progress word (``Leasing.read_in_order``)."""
        assert self._read_in_order is not None, "read_in_order of a tier that cannot lease"
        span = self._span("read", len(items))
        if span is None:
            result: list[BlockResult] | None = await self._read_in_order(items, report)
            return result
        with trace.use_span(span, end_on_exit=True):
            span.set_attribute("ucm.tier.in_order", True)
            got: list[BlockResult] | None = await self._read_in_order(items, report)
            if got is None:  # not every block held: nothing copied, the pipeline reads them otherwise
                span.set_attribute(names.HITS, 0)
            else:
                self._read_outcome(span, items, got)
            return got

    def _read_outcome(
        self, span: Span, items: Sequence[tuple[BlockKey, IoVec]], results: Sequence[BlockResult | None]
    ) -> None:
        hits = moved = misses = failed = 0
        for (_, iov), r in zip(items, results, strict=True):
            if r is None:  # read in place but not matching there: the pipeline reads it again
                continue
            if r.state is BlockState.OK:
                hits += 1
                moved += iov_len(iov)
            elif r.state is BlockState.MISSING:
                misses += 1
            else:
                failed += 1
        span.set_attributes(
            {names.HITS: hits, names.MISSES: misses, names.FAILED: failed, names.BYTES: moved}
        )
        tally = served.get()
        if tally is not None and hits:
            tally[self.name] = tally.get(self.name, 0) + hits

    # -- writes -----------------------------------------------------------------------------------------
    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        span = self._span("write", len(items))
        if span is None:
            return await self.inner.write_many(items)
        with trace.use_span(span, end_on_exit=True):
            results = await self.inner.write_many(items)
            ok = [r.ok for r in results]
            moved = sum(iov_len(iov) for (_, iov), good in zip(items, ok, strict=True) if good)
            span.set_attributes({names.BYTES: moved, names.FAILED: ok.count(False)})
            return results

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        (r,) = await self.write_many([(key, src)])
        return r

    # -- lookups and deletes ----------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        span = self._span("lookup", len(keys))
        if span is None:
            return await self.inner.lookup(keys)
        with trace.use_span(span, end_on_exit=True):
            sizes = await self.inner.lookup(keys)
            self._lookup_outcome(span, sizes)
            return sizes

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        span = self._span("lookup", len(digests))
        if span is None:
            return await self.inner.lookup_digests(namespace, digests)
        with trace.use_span(span, end_on_exit=True):
            sizes = await self.inner.lookup_digests(namespace, digests)
            self._lookup_outcome(span, sizes)
            return sizes

    @staticmethod
    def _lookup_outcome(span: Span, sizes: Sequence[int | None]) -> None:
        misses = sizes.count(None)
        span.set_attributes({names.HITS: len(sizes) - misses, names.MISSES: misses})

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        span = self._span("delete", len(keys))
        if span is None:
            return await self.inner.delete(keys)
        with trace.use_span(span, end_on_exit=True):
            deleted = await self.inner.delete(keys)
            span.set_attribute(names.HITS, deleted)
            return deleted

    # -- the rest, as the wrapper base delegates it, and listing unchanged --------------------------------
    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        async for info in self.inner.list_blocks(namespace):
            yield info
