"""Fair shares of a bounded table among local peers: who gives way when it is full.

The fd socket holds two bounded tables that any local process can fill (its open connections and
the memory handed over but not yet registered). A first-come limit lets whoever fills the table
first lock everyone else out until its entries expire. Instead, each entry is counted against its
peer, the uid and pid ``SO_PEERCRED`` gave, and a newcomer to a full table takes the place of the
oldest entry of the peer holding the most: first by uid (a uid holding more than the newcomer's
uid gives way), then by process within the uid. A peer holding no more than the newcomer keeps
its entries, and the newcomer is refused. So a well-behaved process, which holds one entry for a
moment, always gets in, however many processes of however many uids flood the table.
"""

from __future__ import annotations

from collections import Counter
from typing import Generic, TypeVar

T = TypeVar("T")


class PeerShares(Generic[T]):
    """Entries by peer, oldest first. Event-loop confined."""

    def __init__(self) -> None:
        self._entries: dict[T, tuple[int, int]] = {}  # insertion order: oldest first
        self._by_uid: Counter[int] = Counter()
        self._by_process: Counter[tuple[int, int]] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: object) -> bool:
        return item in self._entries

    def add(self, item: T, uid: int, pid: int) -> None:
        self._entries[item] = (uid, pid)
        self._by_uid[uid] += 1
        self._by_process[(uid, pid)] += 1

    def remove(self, item: T) -> bool:
        """Forget ``item``; whether it was there."""
        peer = self._entries.pop(item, None)
        if peer is None:
            return False
        uid = peer[0]
        self._by_uid[uid] -= 1
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]
        self._by_process[peer] -= 1
        if self._by_process[peer] <= 0:
            del self._by_process[peer]
        return True

    def entries(self) -> list[T]:
        """Every entry, oldest first."""
        return list(self._entries)

    def of_process(self, uid: int, pid: int) -> int:
        return self._by_process.get((uid, pid), 0)

    def oldest_of(self, uid: int, pid: int) -> T | None:
        """The process's oldest entry, if it has any."""
        return next((item for item, peer in self._entries.items() if peer == (uid, pid)), None)

    def victim(self, uid: int, pid: int) -> T | None:
        """The entry that gives way to a newcomer from ``uid``/``pid``: the oldest of the peer
        holding the most (uid first, then process), if that peer holds more than the newcomer's."""
        best: T | None = None
        best_key = (self._by_uid.get(uid, 0), self._by_process.get((uid, pid), 0))
        for item, (u, p) in self._entries.items():
            key = (self._by_uid[u], self._by_process[(u, p)])
            if key > best_key:
                best, best_key = item, key
        return best
