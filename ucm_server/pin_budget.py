"""What pins may hold of the tiers: each principal its share, all of them together less than all.

A tier whose eviction holds pins never evicts a pinned block it must hold, so those pins are bytes
taken from everyone else. Two bounds keep them from locking others out of a tier, for every
principal (tenants, the default tenant of tokens without one, the local clients of a daemon without
tokens):

* **a principal's own budget**: a tenant with a quota pins within its quota (pinned bytes count
  against it like any stored bytes); any other principal pins at most ``pin_share`` of each bounded
  tier;
* **the tier's reserve**: pins of all principals together take at most ``1 - pin_reserve`` of each
  bounded tier, so a full tier always answers other principals' writes by evicting unpinned blocks.

Both bounds count, in each *bounded* tier (a capacity, and an eviction that holds pins: the Cache, a
Posix tier with ``posix_capacity``), the pinned blocks that tier must hold, for their
:meth:`~ucm_server.store.base.Tier.footprint` (whole pages in the Cache):

* a tier below the Cache, or a Cache with no tier below that holds pins (a Cache-only pipeline,
  Cache|DS3FS), holds every pinned block, whether or not it has a copy now (a write-down or a
  promotion may bring it there at any time);
* a Cache above a tier that holds pins (Cache|Posix) holds only the pinned blocks it has in a version
  not safe below (write-down failed, or the block left the tier below while unpinned): the others
  live below, and the Cache evicts them after every unpinned block
  (:mod:`ucm_server.store.pin_home`).

So in Cache|Posix pins are bounded by the Posix tier, not by the smaller Cache, and an unbounded
Posix tier (no ``posix_capacity``: it never evicts) bounds them by nothing but tenants' quotas.

The book keeps each pinned block's owner, size and the tiers it counts in, decided when the block
is pinned (or rewritten larger); it is rebuilt at start-up from the retention rules and the tiers.
Until a refusal makes it look again (:meth:`PinBook.refresh`) it may count a block whose pin went
another way (a rule forgotten when its block left every tier), or count in the Cache a block
written down since; and it does not yet count in the Cache a pinned block whose new version could
not be written down (rare: the tier below refused it), which the Cache keeps meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ucm_protocol.errors import ResourceExhausted
from ucm_protocol.text import printable
from ucm_server.store.base import Tier


def _always(key: bytes) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Bounded:
    """One tier pins are counted against: its footprint of a size, its capacity, and which pinned
    blocks it must hold (``holds(key)``)."""

    name: str
    capacity: int
    footprint: Callable[[int], int]
    holds: Callable[[bytes], bool] = _always


def bounded_tiers(tiers: Sequence[Tier], cache_keeps: Callable[[bytes], bool] | None = None) -> list[Bounded]:
    """The tiers with a capacity whose eviction holds pins. ``cache_keeps``: the top tier is a
    Cache above a tier that holds pins, and this says which pinned blocks it must hold itself."""
    out = []
    for depth, tier in enumerate(tiers):
        capacity = tier.stats().capacity_bytes
        if capacity > 0 and not tier.pin_gap:
            holds = cache_keeps if depth == 0 and cache_keeps is not None else _always
            out.append(Bounded(tier.name, capacity, tier.footprint, holds))
    return out


def who(tenant: str) -> str:
    return f"tenant {printable(tenant, 64)}" if tenant else "the default tenant"


class PinBook:
    """Pinned blocks by key (owner, size, the bounded tiers they count in) with their sums per
    tenant and per bounded tier."""

    def __init__(self, tiers: Sequence[Bounded], *, reserve: float, share: float) -> None:
        self.tiers = list(tiers)
        self.reserve = reserve
        self.share = share
        self._pins: dict[bytes, tuple[str, int, tuple[bool, ...]]] = {}
        self._bytes: dict[str, int] = {}
        self._held: dict[str, list[int]] = {}  # tenant -> footprint in each bounded tier
        self._total = [0] * len(self.tiers)

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, key: bytes) -> bool:
        return bytes(key) in self._pins

    def bytes_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s pinned blocks."""
        return self._bytes.get(tenant, 0)

    def size(self, key: bytes) -> int:
        return self._pins.get(bytes(key), ("", 0, ()))[1]

    def check(self, tenant: str, quota: int, items: Sequence[tuple[bytes, int]]) -> None:
        """Refuse (RESOURCE_EXHAUSTED, naming the bound and the way out) pinning ``items`` (key,
        size; a block pinned already counts for what it grows by) for ``tenant``, whose quota is
        ``quota`` (0: none, its share applies)."""
        grown = [(k, s, self._pins.get(bytes(k))) for k, s in items]
        extra = sum(s - (old[1] if old else 0) for _, s, old in grown)
        if not any(s > (old[1] if old else 0) for _, s, old in grown):
            return
        if quota:
            pinned = self.bytes_of(tenant)
            if pinned + extra > quota:
                raise ResourceExhausted(
                    f"pinning {extra} more bytes would pin {pinned + extra} bytes of {who(tenant)}, "
                    f"above its quota of {quota} bytes ({pinned} pinned now): unpin some blocks or pin fewer"
                )
        held = self._held.get(tenant)
        for i, tier in enumerate(self.tiers):
            more = 0
            for key, size, old in grown:
                if tier.holds(key):
                    more += tier.footprint(size) - (tier.footprint(old[1]) if old and old[2][i] else 0)
            if more <= 0:
                continue
            if not quota:
                mine = (held[i] if held else 0) + more
                limit = int(self.share * tier.capacity)
                if mine > limit:
                    raise ResourceExhausted(
                        f"pinning {extra} more bytes would pin {mine} bytes of the {tier.name} tier for "
                        f"{who(tenant)}, more than its share of {limit} (pin_share {self.share:g} of "
                        f"{tier.capacity} bytes, for a principal without a quota): unpin some blocks or "
                        "pin fewer"
                    )
            limit = int((1 - self.reserve) * tier.capacity)
            if self._total[i] + more > limit:
                raise ResourceExhausted(
                    f"pinning {extra} more bytes would leave pins holding {self._total[i] + more} bytes "
                    f"of the {tier.name} tier, more than the {limit} bytes pins may take (pin_reserve "
                    f"{self.reserve:g} of its {tier.capacity} bytes stays for unpinned blocks): unpin "
                    "some blocks or pin fewer"
                )

    def add(self, tenant: str, items: Iterable[tuple[bytes, int]]) -> None:
        """Record pinned blocks of ``tenant`` (a block pinned already is resized), each counted in
        the bounded tiers that must hold it now."""
        for key, size in items:
            self.drop([key])
            held = tuple(tier.holds(key) for tier in self.tiers)
            self._pins[bytes(key)] = (tenant, size, held)
            self._count(tenant, size, held, +1)

    def drop(self, keys: Iterable[bytes]) -> None:
        """Forget pins (unpinned, or their blocks deleted)."""
        for key in keys:
            gone = self._pins.pop(bytes(key), None)
            if gone is not None:
                self._count(*gone, -1)

    def refresh(self, still_pinned: Callable[[bytes], bool]) -> None:
        """Look again: forget the pins the rules no longer hold (forgotten another way), and count
        each other pin in the tiers that must hold it now (a Cache may have written it down)."""
        self.drop([key for key in self._pins if not still_pinned(key)])
        for key, (tenant, size, held) in list(self._pins.items()):
            now = tuple(tier.holds(key) for tier in self.tiers)
            if now != held:
                self.add(tenant, [(key, size)])

    def _count(self, tenant: str, size: int, held: tuple[bool, ...], sign: int) -> None:
        self._bytes[tenant] = self._bytes.get(tenant, 0) + sign * size
        mine = self._held.setdefault(tenant, [0] * len(self.tiers))
        for i, tier in enumerate(self.tiers):
            if held[i]:
                fp = sign * tier.footprint(size)
                mine[i] += fp
                self._total[i] += fp
