"""What pins may hold of the tiers: each principal its share, all of them together less than all.

A pinned block is never evicted, so pins are bytes taken from everyone else. Two bounds keep them
from locking others out of a tier, for every principal (tenants, the default tenant of tokens
without one, the local clients of a daemon without tokens):

* **a principal's own budget**: a tenant with a quota pins within its quota (pinned bytes count
  against it like any stored bytes); any other principal pins at most ``pin_share`` of each bounded
  tier;
* **the tier's reserve**: pins of all principals together take at most ``1 - pin_reserve`` of each
  bounded tier, so a full tier always answers other principals' writes by evicting unpinned blocks.

A *bounded* tier is one with a capacity whose eviction holds pins (the Cache, a Posix tier with
``posix_capacity``); a block counts there for its :meth:`~ucm_server.store.base.Tier.footprint`
(whole pages in the Cache), whether or not that tier holds a copy now: a read may promote it there
at any time. The book keeps each pinned block's owner and size; it is rebuilt at start-up from the
retention rules and the tiers, and it may count a block whose pin went another way (a rule
forgotten when its block left every tier) until a refusal makes it look again (:meth:`PinBook.purge`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ucm_protocol.errors import ResourceExhausted
from ucm_protocol.text import printable
from ucm_server.store.base import Tier


@dataclass(frozen=True, slots=True)
class Bounded:
    """One tier pins are counted against: its footprint of a size, and its capacity."""

    name: str
    capacity: int
    footprint: Callable[[int], int]


def bounded_tiers(tiers: Iterable[Tier]) -> list[Bounded]:
    """The tiers with a capacity whose eviction holds pins."""
    out = []
    for tier in tiers:
        capacity = tier.stats().capacity_bytes
        if capacity > 0 and not tier.pin_gap:
            out.append(Bounded(tier.name, capacity, tier.footprint))
    return out


def who(tenant: str) -> str:
    return f"tenant {printable(tenant, 64)}" if tenant else "the default tenant"


class PinBook:
    """Pinned blocks by key (owner, size) with their sums per tenant and per bounded tier."""

    def __init__(self, tiers: Sequence[Bounded], *, reserve: float, share: float) -> None:
        self.tiers = list(tiers)
        self.reserve = reserve
        self.share = share
        self._pins: dict[bytes, tuple[str, int]] = {}
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
        return self._pins.get(bytes(key), ("", 0))[1]

    def check(self, tenant: str, quota: int, sizes: Sequence[int]) -> None:
        """Refuse (RESOURCE_EXHAUSTED, naming the bound and the way out) pinning ``sizes`` more
        bytes for ``tenant``, whose quota is ``quota`` (0: none, its share applies)."""
        extra = sum(sizes)
        if not extra:
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
            more = sum(map(tier.footprint, sizes))
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
        """Record pinned blocks of ``tenant`` (a block pinned already is resized)."""
        for key, size in items:
            self.drop([key])
            self._pins[bytes(key)] = (tenant, size)
            self._count(tenant, size, +1)

    def drop(self, keys: Iterable[bytes]) -> None:
        """Forget pins (unpinned, or their blocks deleted)."""
        for key in keys:
            gone = self._pins.pop(bytes(key), None)
            if gone is not None:
                self._count(*gone, -1)

    def purge(self, still_pinned: Callable[[bytes], bool]) -> None:
        """Forget the pins the rules no longer hold (forgotten another way)."""
        self.drop([key for key in self._pins if not still_pinned(key)])

    def _count(self, tenant: str, size: int, sign: int) -> None:
        self._bytes[tenant] = self._bytes.get(tenant, 0) + sign * size
        held = self._held.setdefault(tenant, [0] * len(self.tiers))
        for i, tier in enumerate(self.tiers):
            fp = sign * tier.footprint(size)
            held[i] += fp
            self._total[i] += fp
