"""Who may read which events: one stream per audience, each fed only the namespaces it may see.

A block's key names its namespace, and a tenant's namespaces are private to it (the tenant ledger
knows whose each is). A router of tenant B must not learn which blocks tenant A holds, so the
daemon never publishes one stream to everybody: each **audience** has a :class:`Stream` of its own —
its own holder counts, sequence numbers, replay ring and topic — and :class:`AudienceRouter` feeds a
key's transition only to the streams allowed to see its namespace:

* :data:`ALL`: every namespace (the operator's router: a subscriber on the daemon's uid, or a CURVE
  key listed with ``all: true``);
* ``Audience(tenant="team-a")``: team-a's namespaces only;
* :data:`NO_TENANT`: the namespaces no tenant owns (local clients without tokens, tokens without a
  tenant) — what an unauthenticated TCP subscriber sees. Without tenants that is every namespace.

Which connection belongs to which audience is decided by :mod:`.access`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

from ucm_protocol.keys import NAMESPACE_BYTES
from ucm_server.kv_events.ledger import Ledger, MediumNames
from ucm_server.kv_events.wire import Event, HashFormat, encode_batch

__all__ = ["ALL", "NO_TENANT", "Audience", "AudienceRouter", "Stream"]


@dataclass(frozen=True, slots=True)
class Audience:
    """Whose namespaces a stream carries: ``tenant`` None = everybody's, "" = no tenant's."""

    tenant: str | None

    @property
    def label(self) -> str:
        """A name for logs and the topic: ``all``, ``no-tenant`` or ``tenant/<name, %-quoted>``."""
        if self.tenant is None:
            return "all"
        return f"tenant/{quote(self.tenant, safe='')}" if self.tenant else "no-tenant"

    def sees(self, owner: str) -> bool:
        """Whether a namespace owned by ``owner`` ("" = none) is this audience's to see."""
        return self.tenant is None or self.tenant == owner


ALL = Audience(None)
NO_TENANT = Audience("")


class Stream:
    """One audience's events: holder counts, the last number sent, the ring of past batches."""

    def __init__(
        self,
        audience: Audience,
        topic: bytes,
        *,
        on_change: Callable[[], None],
        hash_format: HashFormat,
        media: MediumNames,
        buffer_batches: int,
    ) -> None:
        self.audience = audience
        self.topic = topic
        self.ledger = Ledger(on_change, hash_format, media)
        # Numbers start at the start time in microseconds, so they keep growing across restarts: a
        # subscriber that outlived a daemon sees a gap (and replays), never numbers it has seen.
        self.seq = time.time_ns() // 1000 - 1
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_batches))
        self.last_sent = time.monotonic()
        self._snapshot: tuple[int, bytes] | None = None

    def next_batch(self, events: Sequence[Event]) -> tuple[int, bytes]:
        """Number and encode ``events`` as the next batch, kept in the ring for replay."""
        self.seq += 1
        payload = encode_batch(time.time(), events)
        self.ring.append((self.seq, payload))
        self.last_sent = time.monotonic()
        return self.seq, payload

    def heartbeat(self) -> bytes:
        """An empty batch, sent under the last number (:meth:`last_sent` restarts its interval)."""
        self.last_sent = time.monotonic()
        return encode_batch(time.time(), [])

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """What a subscriber asking for batches from ``start`` on gets: the ring's batches from
        there, or — when ``start`` is no longer in the ring, or ahead of it (it counted with a
        daemon of a later start) — one snapshot numbered as the last batch sent. Flush first."""
        oldest = self.ring[0][0] if self.ring else self.seq + 1
        if oldest <= start <= self.seq + 1:
            return [(seq, payload) for seq, payload in self.ring if seq >= start]
        if self._snapshot is None or self._snapshot[0] != self.seq:  # one encoding per number
            self._snapshot = (self.seq, encode_batch(time.time(), self.ledger.snapshot()))
        return [self._snapshot]


class AudienceRouter:
    """The watchers' sink: a key's transition goes to every stream whose audience sees its namespace.

    ``owner_of(namespace)`` is the tenant owning it (None: no tenant). A tenant records a namespace
    before its first block is written, so the owner is known when the index first reports a key; the
    answer is kept per namespace, so a key's removal reaches exactly the streams its store reached.
    """

    def __init__(self, streams: Sequence[Stream], owner_of: Callable[[bytes], str | None]) -> None:
        self.streams = list(streams)
        self._owner_of = owner_of
        self._by_namespace: dict[bytes, list[Ledger]] = {}

    def __call__(self, stored: bool, medium: str, key: bytes) -> None:
        namespace, digest = key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:]
        ledgers = self._by_namespace.get(namespace)
        if ledgers is None:
            owner = self._owner_of(namespace) or ""
            ledgers = [s.ledger for s in self.streams if s.audience.sees(owner)]
            self._by_namespace[namespace] = ledgers
        for ledger in ledgers:
            if stored:
                ledger.up(medium, digest)
            else:
                ledger.down(medium, digest)
