"""Eviction policies: a small interface a tier feeds with what happens to its blocks, and asks
for the order in which to evict (as vLLM's ``CachePolicy``).

A tier calls :meth:`EvictionPolicy.inserted` when it stores a block, :meth:`~EvictionPolicy.touched`
when a block is read, :meth:`~EvictionPolicy.removed` when one goes (``evicted=True`` when the tier
evicted it for room, not when it was deleted), and walks :meth:`~EvictionPolicy.order` when it needs
room, skipping what it cannot evict (leased blocks); the daemon's retention rules reorder and filter
that walk (:meth:`ucm_server.store.base.Tier.eviction_order`). Policies keep keys and sizes only.

Two policies are built in (:data:`POLICIES`):

* ``lru`` — least recently used first (the default).
* ``arc`` — Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), in bytes: blocks seen once
  (T1) and blocks seen again (T2) are kept apart, with ghost lists of what each recently lost (B1,
  B2) steering the share of T1. A burst of one-off long prompts then only churns T1, while shared
  prefixes that were hit again stay in T2. ``benchmarks/eviction_bench.py`` measures both on a
  trace of Zipf-distributed shared prefixes mixed with one-off prompts.
"""

from __future__ import annotations

import abc
import collections
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from ucm_protocol.errors import ConfigError


class EvictionPolicy(abc.ABC):
    """What a tier tells its policy, and the order the policy answers."""

    name: str = ""

    def __init__(self, capacity: int) -> None:  # noqa: B027 - optional hook
        """``capacity``: the tier's bytes (a policy that sizes lists by it keeps it)."""

    @abc.abstractmethod
    def inserted(self, key: bytes, size: int) -> None:
        """A block was stored (or stored again: a new version counts as a use)."""

    @abc.abstractmethod
    def touched(self, key: bytes) -> None:
        """A stored block was read."""

    def inserted_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """:meth:`inserted` for each key of a batch, in order."""
        for key, size in zip(keys, sizes, strict=True):
            self.inserted(key, size)

    def touched_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`touched` for each key of a batch, in order."""
        for key in keys:
            self.touched(key)

    @abc.abstractmethod
    def removed(self, key: bytes, *, evicted: bool) -> None:
        """A block left the tier: ``evicted`` for room (a policy may remember it), else deleted."""

    @abc.abstractmethod
    def order(self) -> Iterator[bytes]:
        """Keys in the order to evict them, first first; valid while the caller evicts as it goes
        (a snapshot of the lists, re-deciding between them as evictions change the balance)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[bytes, int] = OrderedDict()

    def inserted(self, key: bytes, size: int) -> None:
        self._od.pop(key, None)
        self._od[key] = size

    def touched(self, key: bytes) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def inserted_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Two C-level passes for the batch (a stored 64 KiB block paid a method call here per key):
        every size set (a new key goes to the end), then every key moved to the end in order, so
        a key stored twice ends where its last store puts it, as one call per key would leave it."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys for {len(sizes)} sizes")
        od = self._od
        od.update(zip(keys, sizes, strict=True))
        collections.deque(map(od.move_to_end, keys), maxlen=0)

    def touched_many(self, keys: Sequence[bytes]) -> None:
        """Every key held (the usual read): one C-level pass; else key by key."""
        try:
            collections.deque(map(self._od.move_to_end, keys), maxlen=0)
        except KeyError:  # one not held: the keys before it moved already, moving them again is harmless
            super().touched_many(keys)

    def removed(self, key: bytes, *, evicted: bool) -> None:
        self._od.pop(key, None)

    def order(self) -> Iterator[bytes]:
        return iter(list(self._od))

    def __len__(self) -> int:
        return len(self._od)


class _SizedList:
    """An LRU list of (key, size) with its byte total."""

    __slots__ = ("bytes", "od")

    def __init__(self) -> None:
        self.od: OrderedDict[bytes, int] = OrderedDict()
        self.bytes = 0

    def push(self, key: bytes, size: int) -> None:
        self.od[key] = size
        self.bytes += size

    def pop(self, key: bytes) -> int | None:
        size = self.od.pop(key, None)
        if size is not None:
            self.bytes -= size
        return size

    def pop_oldest(self) -> None:
        _, size = self.od.popitem(last=False)
        self.bytes -= size


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over bytes (``capacity``: the tier's). T1/T2 hold the tier's
    blocks (seen once / seen more than once); B1/B2 remember keys recently evicted from each, and
    a store of a remembered key moves the target size ``p`` of T1 toward the list that lost it."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.capacity = max(int(capacity), 1)
        self.p = 0.0
        self.t1, self.t2, self.b1, self.b2 = _SizedList(), _SizedList(), _SizedList(), _SizedList()

    def inserted(self, key: bytes, size: int) -> None:
        if self.t1.pop(key) is not None or self.t2.pop(key) is not None:
            self.t2.push(key, size)  # stored again while held: a second use
            return
        if self.b1.pop(key) is not None:  # T1 lost it too early: give T1 more room
            self.p = min(self.capacity, self.p + max(size, size * self.b2.bytes / max(self.b1.bytes, 1)))
            self.t2.push(key, size)
        elif self.b2.pop(key) is not None:  # T2 lost it too early: give T2 more room
            self.p = max(0.0, self.p - max(size, size * self.b1.bytes / max(self.b2.bytes, 1)))
            self.t2.push(key, size)
        else:
            self.t1.push(key, size)
        self._trim_ghosts()

    def touched(self, key: bytes) -> None:
        size = self.t1.pop(key)
        if size is not None:
            self.t2.push(key, size)
        elif key in self.t2.od:
            self.t2.od.move_to_end(key)

    def removed(self, key: bytes, *, evicted: bool) -> None:
        size = self.t1.pop(key)
        ghost = self.b1
        if size is None:
            size, ghost = self.t2.pop(key), self.b2
        if size is not None and evicted:
            ghost.push(key, size)
            self._trim_ghosts()

    def order(self) -> Iterator[bytes]:
        """ARC's REPLACE as a walk: from T1 while it is above its target ``p`` (or T2 is
        exhausted), else from T2; each list least recently used first."""
        it1, it2 = iter(list(self.t1.od)), iter(list(self.t2.od))
        n1, n2 = next(it1, None), next(it2, None)
        while n1 is not None or n2 is not None:
            if n2 is None or (n1 is not None and self.t1.bytes > self.p):
                assert n1 is not None
                yield n1
                n1 = next(it1, None)
            else:
                yield n2
                n2 = next(it2, None)

    def _trim_ghosts(self) -> None:
        """|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (in bytes), as ARC keeps them."""
        c = self.capacity
        while self.b1.od and self.t1.bytes + self.b1.bytes > c:
            self.b1.pop_oldest()
        while self.b2.od and self.t1.bytes + self.t2.bytes + self.b1.bytes + self.b2.bytes > 2 * c:
            self.b2.pop_oldest()

    def __len__(self) -> int:
        return len(self.t1.od) + len(self.t2.od)


POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType({"lru": LRUPolicy, "arc": ARCPolicy})
"""The built-in policies by name (the ``cache_eviction`` setting's choices)."""


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` for a tier of ``capacity`` bytes; unknown names are refused with
    the known ones listed."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(capacity)
