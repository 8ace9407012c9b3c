"""Which digests each medium holds, from the tiers' index changes; the events that changed it.

A router asks "does node N hold block H in medium M?". Several things can hold the same digest in
one medium: two tiers of one medium, and every namespace (each TP rank's shard is a namespace of its
own). So the ledger counts holders per ``(medium, digest)`` and reports only the transitions a
router can see: the first holder (``BlockStored``) and the last one leaving (``BlockRemoved``).
Each tier's watcher keeps the set of keys that tier holds, which makes the index's statements
idempotent (a replaced block is not counted twice) and lets a cleared tier report what it lost; it
hands each transition of a key to a sink (one ledger, or :class:`~ucm_server.kv_events.audience.
AudienceRouter`, which feeds the ledgers of the audiences allowed to see the key's namespace).

Everything runs on the event loop thread (where indexes change); :meth:`Ledger.take` drains the
transitions in the order they happened, :meth:`Ledger.snapshot` describes the present.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ucm_protocol.keys import NAMESPACE_BYTES
from ucm_server.kv_events.wire import Cleared, Event, HashFormat, Removed, Stored, external_hashes
from ucm_server.store.base import Tier

__all__ = ["HASHES_PER_EVENT", "Ledger", "MediumNames", "Sink", "TierWatch", "medium_of"]

HASHES_PER_EVENT = 4096
"""Most hashes one ``BlockStored``/``BlockRemoved`` carries (a million-block snapshot is many events)."""

Sink = Callable[[bool, str, bytes], None]
"""Where a watcher sends a key's transition: ``(stored, medium, namespace + digest)``."""


@dataclass(frozen=True, slots=True)
class MediumNames:
    """What the events call each kind of tier: vLLM's names (``vllm.distributed.kv_events``:
    ``GPU``, ``CPU``, ``STORAGE``) where vLLM has one; it has none for a tier other nodes write."""

    memory: str = "CPU"
    persistent: str = "STORAGE"
    shared: str = "SHARED"


def medium_of(tier: Tier, names: MediumNames = MediumNames()) -> str:
    """``names.shared`` for a tier other nodes write too, ``names.persistent`` for a persistent one,
    else ``names.memory``."""
    if tier.shared:
        return names.shared
    return names.persistent if tier.persistent else names.memory


class TierWatch:
    """One tier's :class:`~ucm_server.store.watch.IndexWatch`: its held keys, feeding the sink."""

    __slots__ = ("_held", "_sink", "medium", "name")

    def __init__(self, sink: Sink, name: str, medium: str) -> None:
        self._sink = sink
        self.name = name
        self.medium = medium
        self._held: set[bytes] = set()

    def stored(self, key: bytes) -> None:
        if key not in self._held:
            self._held.add(key)
            self._sink(True, self.medium, key)

    def stored_many(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.stored(key)

    def removed(self, key: bytes) -> None:
        if key in self._held:
            self._held.remove(key)
            self._sink(False, self.medium, key)

    def removed_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.removed(key)

    def cleared(self) -> None:
        held, self._held = self._held, set()
        for key in held:
            self._sink(False, self.medium, key)

    def __len__(self) -> int:
        return len(self._held)


class Ledger:
    """Holders per ``(medium, digest)`` and the pending visible transitions, oldest first."""

    def __init__(
        self,
        on_change: Callable[[], None] = lambda: None,
        hash_format: HashFormat = "int64",
        media: MediumNames = MediumNames(),
    ) -> None:
        self.hash_format: HashFormat = hash_format
        self.media = media
        self._counts: dict[str, dict[bytes, int]] = {}
        self._pending: list[tuple[bool, str, bytes]] = []
        self._on_change = on_change
        self.watches: list[TierWatch] = []

    def watch(self, tier: Tier) -> TierWatch:
        """A watcher for ``tier`` feeding this ledger alone (attach it with the tier's ``watch_index``)."""
        w = TierWatch(self.apply, tier.name, medium_of(tier, self.media))
        self.watches.append(w)
        return w

    def apply(self, stored: bool, medium: str, key: bytes) -> None:
        """A watcher's transition of ``key`` (namespace + digest): the digest gained or lost a holder."""
        if stored:
            self.up(medium, key[NAMESPACE_BYTES:])
        else:
            self.down(medium, key[NAMESPACE_BYTES:])

    def up(self, medium: str, digest: bytes) -> None:
        counts = self._counts.setdefault(medium, {})
        n = counts.get(digest, 0)
        counts[digest] = n + 1
        if n == 0:
            self._note(True, medium, digest)

    def down(self, medium: str, digest: bytes) -> None:
        counts = self._counts.get(medium, {})
        n = counts.get(digest, 0)
        if n <= 1:
            counts.pop(digest, None)
            if n == 1:
                self._note(False, medium, digest)
        else:
            counts[digest] = n - 1

    def _note(self, stored: bool, medium: str, digest: bytes) -> None:
        if not self._pending:
            self._on_change()
        self._pending.append((stored, medium, digest))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self) -> list[Event]:
        """The transitions since the last call as events: runs of one kind and medium, in order."""
        pending, self._pending = self._pending, []
        events: list[Event] = []
        run: list[bytes] = []
        kind: tuple[bool, str] | None = None
        for stored, medium, digest in pending:
            if (stored, medium) != kind or len(run) >= HASHES_PER_EVENT:
                if kind is not None:
                    events.append(self._event(kind, run))
                kind, run = (stored, medium), []
            run.append(digest)
        if kind is not None:
            events.append(self._event(kind, run))
        return events

    def snapshot(self) -> list[Event]:
        """Everything held now: ``AllBlocksCleared`` then the held digests of each medium."""
        events: list[Event] = [Cleared()]
        for medium, counts in sorted(self._counts.items()):
            digests = list(counts)
            for i in range(0, len(digests), HASHES_PER_EVENT):
                events.append(self._event((True, medium), digests[i : i + HASHES_PER_EVENT]))
        return events

    def held(self) -> dict[str, set[bytes]]:
        """The digests each medium holds (tests, ``ucm-admin``-style comparisons)."""
        return {m: set(c) for m, c in self._counts.items() if c}

    def _event(self, kind: tuple[bool, str], digests: list[bytes]) -> Event:
        stored, medium = kind
        hashes = external_hashes(digests, self.hash_format)
        return Stored(hashes, medium) if stored else Removed(hashes, medium)
