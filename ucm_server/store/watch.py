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

import weakref
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["IndexWatch", "Watchable", "add_watch", "remove_watch", "removed_many"]


class IndexWatch(Protocol):
    """Told of every change of one tier's index; keys are 48-byte ``namespace + digest`` strings."""

    def stored(self, key: bytes) -> None:
        """The tier now holds ``key`` (new, replaced or re-adopted after a restart)."""

    def stored_many(self, keys: Iterable[bytes]) -> None:
        """The tier holds each of ``keys`` (an index installed at once from a snapshot)."""

    def removed(self, key: bytes) -> None:
        """The tier no longer holds ``key``."""

    def removed_many(self, keys: Sequence[bytes]) -> None:
        """The tier holds none of ``keys`` (a batch of replaced blocks, before their new versions'
        ``stored_many``); a watcher without this method hears :meth:`removed` per key."""

    def cleared(self) -> None:
        """The tier holds nothing any more."""


@runtime_checkable
class Watchable(Protocol):
    """A tier whose index can be watched (a capability: a tier without one publishes through an
    :class:`~ucm_server.store.observed.ObservedTier` wrapping it)."""

    def watch_index(self, watch: IndexWatch) -> None:
        """Report every later change of the index to ``watch``, after reporting what it holds now."""


class _Tee:
    """Several watchers of one tier (KV events and the data plane's presence table, say): a tier holds
    one watch, this one, which tells each of them. ``only``: while a later watcher is added, the
    tier's report of what it holds goes to that watcher alone."""

    __slots__ = ("only", "watches")

    def __init__(self) -> None:
        self.watches: list[IndexWatch] = []
        self.only: IndexWatch | None = None

    def stored(self, key: bytes) -> None:
        for w in self.watches:
            w.stored(key)

    def stored_many(self, keys: Iterable[bytes]) -> None:
        if self.only is not None:
            self.only.stored_many(keys)
            return
        keys = keys if isinstance(keys, list) else list(keys)
        for w in self.watches:
            w.stored_many(keys)

    def removed(self, key: bytes) -> None:
        for w in self.watches:
            w.removed(key)

    def removed_many(self, keys: Sequence[bytes]) -> None:
        for w in self.watches:
            removed_many(w, keys)

    def cleared(self) -> None:
        for w in self.watches:
            w.cleared()


def removed_many(watch: IndexWatch, keys: Sequence[bytes]) -> None:
    """Tell ``watch`` none of ``keys`` is held: in one call where it takes a batch, else key by key."""
    many = getattr(watch, "removed_many", None)
    if many is not None:
        many(keys)
        return
    for key in keys:
        watch.removed(key)


_tees: weakref.WeakKeyDictionary[Watchable, _Tee] = weakref.WeakKeyDictionary()


def add_watch(tier: Watchable, watch: IndexWatch) -> None:
    """Attach ``watch`` to ``tier`` beside any watcher attached this way before (``watch_index``
    alone keeps one): ``watch`` hears what the tier holds now, then every change."""
    tee = _tees.get(tier)
    if tee is None:
        tee = _tees[tier] = _Tee()
        tee.watches.append(watch)
        tier.watch_index(tee)
        return
    tee.watches.append(watch)
    tee.only = watch
    try:
        tier.watch_index(tee)  # reports what it holds, to ``watch`` alone
    finally:
        tee.only = None


def remove_watch(tier: Watchable, watch: IndexWatch) -> None:
    """Stop telling ``watch`` (the tier keeps its tee; an empty one costs a loop over nothing)."""
    tee = _tees.get(tier)
    if tee is not None and watch in tee.watches:
        tee.watches.remove(watch)
