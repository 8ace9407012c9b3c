"""What a tier's in-memory index tells a watcher: which blocks it now holds and which it lost.

KV events (:mod:`ucm_server.kv_events`) must report every removal, whatever caused it: LRU or capacity
eviction, quota eviction, an operator's ``evict``/``delete``, the Delete RPC, a quarantined corrupt
block, a shared tier's entry found gone. All of those end in the one place a tier records what it
holds, its index, so the hook sits there (:class:`~ucm_server.store.base.SizeIndex` for the Cache,
:class:`~ucm_server.store.posix.block_index.BlockIndex` for file tiers) and no removal path can forget it.
A watcher is optional; without one an index pays one ``is None`` test per change.

Calls are idempotent statements of fact ("holds key", "does not hold key"): an index may say
``stored`` for a key it already held (a replaced block) and the watcher must not double count.
They are made on the event loop thread, where indexes change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

__all__ = ["IndexWatch", "Watchable"]


class IndexWatch(Protocol):
    """Told of every change of one tier's index; keys are 48-byte ``namespace + digest`` strings."""

    def stored(self, key: bytes) -> None:
        """The tier now holds ``key`` (new, replaced or re-adopted after a restart)."""

    def stored_many(self, keys: Iterable[bytes]) -> None:
        """The tier holds each of ``keys`` (an index installed at once from a snapshot)."""

    def removed(self, key: bytes) -> None:
        """The tier no longer holds ``key``."""

    def cleared(self) -> None:
        """The tier holds nothing any more."""


@runtime_checkable
class Watchable(Protocol):
    """A tier whose index can be watched (a capability: a tier without one publishes through an
    :class:`~ucm_server.store.observed.ObservedTier` wrapping it)."""

    def watch_index(self, watch: IndexWatch) -> None:
        """Report every later change of the index to ``watch``, after reporting what it holds now."""
