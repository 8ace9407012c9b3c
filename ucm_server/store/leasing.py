"""The leasing capability: a top tier whose blocks can be held in place, reserved and filled from outside.

The pipeline's write-back (flush a block from where it sits, safe from eviction), its promotion (read a
lower tier's block straight into reserved pages, publish it once verified) and the GPU path (DMA into
and out of pinned arena pages by address) need more of the top tier than the eight primitives of
:class:`~ucm_server.store.base.Tier`. They ask for this protocol — a capability, not a class — once,
when they are built (:func:`leasing_of`), never per block: a ``runtime_checkable`` ``isinstance`` is
slow. :class:`~ucm_server.store.cache.CacheTier` is the one built-in tier that implements it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ucm_protocol.keys import BlockKey
from ucm_server.store.arena import Arena
from ucm_server.store.base import BlockResult, Tier
from ucm_server.store.copying import IoVec

if TYPE_CHECKING:
    from ucm_server.store.cache import Lease, Reservation


@runtime_checkable
class Leasing(Protocol):
    arena: Arena
    """The host memory the blocks live in (the GPU path page-locks it once: ``pin``/``pinned``)."""
    pins_below: bool
    """A tier below holds pins (the pipeline sets it): a pinned block safe there may be evicted."""

    def lease(self, key: BlockKey) -> Lease | None:
        """Hold a block in place (no eviction, no page reuse) until ``Lease.release``; ``None``: absent."""
        ...

    def lease_for_read(self, key: BlockKey) -> Lease | None:
        """:meth:`lease`, counted as a read hit."""
        ...

    def reserve(self, key: BlockKey, size: int) -> Reservation | None:
        """Pages for a block someone else fills, invisible until :meth:`commit`; ``None``: full."""
        ...

    def make_room(self, sizes: Sequence[int]) -> None:
        """Evict at once what reserving blocks of ``sizes`` will need (one walk of the eviction order)."""
        ...

    def host_runs(self, held: Lease | Reservation) -> list[tuple[int, int]]:
        """A held block's bytes as (address, length) runs, for device copies."""
        ...

    def views(self, reservation: Reservation) -> list[memoryview]:
        """A reservation's pages as memoryviews, for a tier to read a block into."""
        ...

    def holds(self, key: BlockKey) -> bool:
        """Whether the block is held now (no recency touch)."""
        ...

    def commit(self, reservation: Reservation, *, below: bool = False) -> None:
        """Publish a filled reservation (replacing any older version); ``below``: read from a tier
        below that holds pins, so safe there."""
        ...

    def keeps(self, key: bytes) -> bool:
        """Whether the block is held in a version not safe below (never evicted while pinned)."""
        ...

    def set_below(self, key: BlockKey, below: bool) -> None:
        """Whether the held version is safe in a tier below that holds pins (promoted from one, or
        lost there: then kept while pinned)."""
        ...

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation's pages back."""
        ...

    async def read_in_order(
        self, items: Sequence[tuple[BlockKey, IoVec]], report: Callable[[int], None]
    ) -> list[BlockResult] | None:
        """Read a batch segment by segment, ``report(k)`` once the first ``k`` segments of every block
        are copied; ``None`` (nothing copied) unless every block is held (a Load's progress word)."""
        ...


def leasing_of(tier: Tier) -> Leasing | None:
    """``tier`` as a :class:`Leasing` store, or ``None`` when it cannot lease (ask once, keep the answer)."""
    return tier if isinstance(tier, Leasing) else None
