"""The in-memory index of a file tier: what is stored, its size, when, and in which LRU order.

Built to stay small at millions of blocks (at most 256 B per block). One
``OrderedDict`` maps each 48-byte key (:class:`~ucm_protocol.keys.BlockKey`, a ``bytes``) to a
:class:`Stamp`: an ``int`` (the block's size) that also carries when the block was stored. Stamps
are shared: every block of one size stored within one second points at the same object, so a
block costs its key, one dict slot and one ordered-dict link (about 190 B, measured by
``benchmarks.scale_bench``), not a dataclass, a second size dict and a float per block as before.

Because a stamp *is* the size, a Lookup answers with one C-level ``map`` over the request's keys
(``namespace + digest`` strings find the same entries as ``BlockKey`` objects).

A start from a snapshot does not build that ordered dict: inserting a million keys into an
``OrderedDict`` costs about twice a plain ``dict`` (its links), and was most of a restart. The
snapshot's blocks become a *cold base* instead, a plain ``dict`` built in C-level slices whose own
order is the snapshot's LRU order; everything stored, read or adopted since lives in the ordered
dict, newer than any cold block. A read of a cold block moves it to the ordered dict, eviction
takes the cold base's oldest first, and a block the background sweep adopts after the base was
installed goes in front of both (an ordered dict of its own), as adoption always did.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

import numpy as np

from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey, PackedDigests
from ucm_protocol.native import native
from ucm_server.store.watch import IndexWatch

BUILD_STEP = 32768
"""Keys :meth:`BlockIndex.build` puts in its map per compiled call (a few ms holding the interpreter)."""
STAMP_TABLE_MAX = 4096
"""Distinct (size, second) stamps remembered for sharing before the table starts afresh (blocks
keep the stamps they hold; only sharing with new blocks is lost)."""


class Stamp(int):
    """A block's size (the ``int`` value) and ``stored_at`` (seconds, whole), shared between blocks."""

    stored_at: float
    pack_id: int = 0
    """The pack holding the block (:class:`~ucm_server.store.posix.packs.PackedStamp`); 0: a file."""

    @property
    def size(self) -> int:
        return int(self)


class BlockIndex:
    """Keys in LRU order (least recently used first) with their :class:`Stamp`; the byte total.

    The order is: blocks adopted after a snapshot was installed (``_front``), the snapshot's blocks
    not touched since (``_cold``, in the snapshot's order), then everything else (``_od``). A key
    is in at most one of the three."""

    __slots__ = (
        "_cold",
        "_cursor",
        "_front",
        "_od",
        "_order",
        "_stamps",
        "bytes",
        "changes",
        "touched",
        "watch",
    )

    def __init__(self) -> None:
        self._od: OrderedDict[bytes, Stamp] = OrderedDict()
        self._cold: dict[bytes, Stamp] = {}
        """The snapshot's blocks no one stored, read or removed since (:meth:`install`)."""
        self._order: list[bytes] = []
        """The cold keys least recently used first (some gone from ``_cold`` since): eviction walks
        it from ``_cursor`` on, as a dict with its oldest entries popped is walked from its start."""
        self._cursor = 0
        self._front: OrderedDict[bytes, Stamp] = OrderedDict()
        """Blocks adopted while ``_cold`` holds any: older than every cold block, as adoption says."""
        self._stamps: dict[tuple[int, int], Stamp] = {}
        self.bytes = 0
        self.changes = 0
        """Bumped by every change of membership or size (not of LRU order): a periodic snapshot is
        written only when it moved since the last one."""
        self.watch: IndexWatch | None = None
        """Told of every change of membership (:mod:`ucm_server.store.watch`): KV events."""
        self.touched: set[bytes] | None = None
        """While the index is adopted from disk (:mod:`ucm_server.store.posix.recovery`; None when
        not): the keys stored or forgotten since, which adoption leaves as they are now (what the
        files said is older)."""

    def stamp(self, size: int, stored_at: float) -> Stamp:
        """The shared stamp for ``size`` stored at ``stored_at`` (rounded down to the second)."""
        second = int(stored_at)
        found = self._stamps.get((size, second))
        if found is None:
            if len(self._stamps) >= STAMP_TABLE_MAX:
                self._stamps = {}
            found = Stamp(size)
            found.stored_at = float(second)
            self._stamps[(size, second)] = found
        return found

    # -- changes ----------------------------------------------------------------------------------------
    def add(self, key: BlockKey, size: int, stored_at: float) -> None:
        """Store or replace ``key`` as the most recently used block."""
        self.put(key, self.stamp(size, stored_at))

    def put(self, key: BlockKey, stamp: Stamp, *, adopted: bool = False) -> None:
        """:meth:`add` with a stamp of the caller's (a packed block's: :mod:`.packs`); ``adopted``:
        a correction adoption makes, not a change to keep it from making."""
        if self.touched is not None and not adopted:
            self.touched.add(key)
        old = self._od.pop(key, None)
        if old is None and (self._cold or self._front):
            old = self._pop_base(key)
        if old is not None:
            self.bytes -= old
        self._od[key] = stamp
        self.bytes += stamp
        self.changes += 1
        if self.watch is not None:
            self.watch.stored(key)

    def adopt(self, key: BlockKey, size: int, stored_at: float) -> bool:
        """Add a block found on disk as the least recently used one, unless the key is known
        (whatever was stored or read since start-up is newer); True if it was added."""
        return self.adopt_stamp(key, self.stamp(size, stored_at))

    def adopt_stamp(self, key: BlockKey, stamp: Stamp) -> bool:
        """:meth:`adopt` with a stamp of the caller's."""
        if key in self:
            return False
        oldest = self._front if self._cold or self._front else self._od
        oldest[key] = stamp
        oldest.move_to_end(key, last=False)
        self.bytes += stamp
        self.changes += 1
        if self.watch is not None:
            self.watch.stored(key)
        return True

    def correct(self, key: bytes, size: int, stored_at: float) -> None:
        """Set a present key's size where it stands in the LRU order (a wrong snapshot entry)."""
        self._set(key, self.stamp(size, stored_at))

    def replace(self, key: bytes, stamp: Stamp) -> None:
        """Give a present key another entry where it stands in the LRU order (adoption found the
        block in another place than a snapshot said): not a change adoption keeps it from making."""
        self._set(key, stamp)

    def _set(self, key: bytes, stamp: Stamp) -> None:
        """Replace a present key's stamp in whichever part holds it (its place stays)."""
        for part in (self._od, self._cold, self._front):
            old = part.get(key)
            if old is not None:
                part[key] = stamp
                self.bytes += stamp - old
                self.changes += 1
                return

    def forget(self, key: bytes) -> Stamp | None:
        """:meth:`pop` of a block removed now (deleted, evicted, found gone or bad): adoption, if it
        runs, must not bring it back."""
        if self.touched is not None:
            self.touched.add(key)
        return self.pop(key)

    def pop(self, key: bytes) -> Stamp | None:
        stamp = self._od.pop(key, None)
        if stamp is None and (self._cold or self._front):
            stamp = self._pop_base(key)
        if stamp is not None:
            self.bytes -= stamp
            self.changes += 1
            if self.watch is not None:
                self.watch.removed(key)
        return stamp

    def _pop_base(self, key: bytes) -> Stamp | None:
        """Take ``key`` out of the cold base or the front, if either holds it (no accounting)."""
        stamp = self._cold.pop(key, None)
        if stamp is None:
            return self._front.pop(key, None)
        cold = self._cold
        if len(cold) * 3 < len(self._order) * 2:  # a third gone: a dict never shrinks as it empties,
            # and its table beside the ordered dict's entries of the blocks read since would pass
            # 256 B a block (282 B with three quarters read, measured)
            self._cold = dict(cold) if cold else {}
            self._order, self._cursor = list(filter(cold.__contains__, self._order[self._cursor :])), 0
        return stamp

    def move_to_end(self, key: bytes) -> None:
        """Mark ``key`` most recently used, if it is still indexed (a cold one joins the ordered dict).

        A Delete or Evict may remove the key while its read runs in a worker thread. The read stands
        (its bytes were whole and checked); the key only has no place left to move to. This used to
        raise KeyError, which failed every unfinished block of the reading task as "internal error"
        (two clients loading and deleting the same keys at once hit it within seconds)."""
        try:
            self._od.move_to_end(key)
        except KeyError:
            if self._cold or self._front:
                stamp = self._pop_base(key)
                if stamp is not None:
                    self._od[key] = stamp

    def touch(self, keys: Sequence[bytes]) -> None:
        """:meth:`move_to_end` of many keys (a load's blocks), in one C-level pass unless one of them
        was removed meanwhile or is still in the cold base."""
        try:
            deque(map(self._od.move_to_end, keys), maxlen=0)
        except KeyError:
            for key in keys:
                self.move_to_end(key)

    def clear(self) -> None:
        self._od.clear()
        self._cold, self._order, self._cursor = {}, [], 0
        self._front.clear()
        self._stamps.clear()
        self.bytes = 0
        self.changes += 1
        if self.watch is not None:
            self.watch.cleared()

    # -- questions --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> Stamp | None:
        stamp = self._od.get(key)
        if stamp is None and self._cold:
            stamp = self._cold.get(key)
        if stamp is None and self._front:
            stamp = self._front.get(key)
        return stamp

    def __contains__(self, key: object) -> bool:
        return key in self._od or key in self._cold or key in self._front

    def __len__(self) -> int:
        return len(self._od) + len(self._cold) + len(self._front)

    def items(self) -> Iterator[tuple[BlockKey, Stamp]]:
        """``(key, stamp)`` least recently used first (a snapshot: safe while the index changes)."""
        every = [*self._front.items(), *self._cold.items(), *self._od.items()]
        for key, stamp in every:
            yield _as_key(key), stamp

    def oldest(self) -> Iterator[tuple[BlockKey, Stamp]]:
        """``(key, stamp)`` least recently used first, lazily: stop before changing the index."""
        for key, stamp in self._front.items():
            yield _as_key(key), stamp
        order, cold = self._order, self._cold
        if cold:
            at = self._cursor
            while at < len(order) and order[at] not in cold:  # popped since: passed once, not again
                at += 1
            self._cursor = at
            for key in itertools.islice(order, at, None):
                cold_stamp = cold.get(key)
                if cold_stamp is not None:
                    yield _as_key(key), cold_stamp
        for key, stamp in self._od.items():
            yield _as_key(key), stamp

    def columns(self) -> tuple[list[bytes], list[Stamp]]:
        """Every key and its stamp, least recently used first (for a snapshot: C-level copies)."""
        return (
            [*self._front.keys(), *self._cold.keys(), *self._od.keys()],
            [*self._front.values(), *self._cold.values(), *self._od.values()],
        )

    def columns_by_store(self) -> tuple[list[bytes], list[Stamp]]:
        """Every key and its stamp in the order blocks were last stored or adopted (reads since are
        not reflected): the dict's own array, copied ten times faster than the LRU list
        (:meth:`columns` looks every key up again; 1M blocks: ~15 ms against ~150 ms), so a
        periodic snapshot holds the event loop briefly. Not exact LRU: a crash base only."""
        return (
            [*self._front.keys(), *self._cold.keys(), *dict.keys(self._od)],
            [*self._front.values(), *self._cold.values(), *dict.values(self._od)],
        )

    # -- bulk loading (a snapshot) ------------------------------------------------------------------------
    def stamps_for(
        self, sizes: np.ndarray, times: np.ndarray
    ) -> tuple[np.ndarray, tuple[np.ndarray, list[tuple[int, int]]]]:
        """The stamps of many blocks at once, as an object array: one per distinct size and second
        (shared with the table as :meth:`stamp`'s), found by array operations, no Python per block.
        Also each block's (size, second) pair index and the pairs (for :mod:`.recovery`'s packs)."""
        size_values, size_of = factorize(sizes.astype(np.int64))
        second_values, second_of = factorize(times.astype(np.int64))  # whole seconds, as stamp()
        wide = len(second_values)
        pair_codes, pair_of = factorize(size_of * wide + second_of)
        pairs = [(size_values[code // wide], second_values[code % wide]) for code in pair_codes]
        made = np.empty(len(pairs), dtype=object)
        for n, (size, second) in enumerate(pairs):
            made[n] = self.stamp(size, second)
        return made[pair_of], (pair_of, pairs)

    @staticmethod
    def build(keys: Sequence[bytes], stamps: Sequence[Stamp]) -> dict[bytes, Stamp]:
        """A plain map of ``keys`` to ``stamps`` whose order is theirs, for :meth:`install` (any
        thread: C-level slices, so the event loop gets the interpreter between them). A key listed
        twice keeps its first place and its last stamp. With the compiled helper, straight from the
        two lists (no tuple made and unpacked per entry): 0.13 s instead of 0.3 s for a million keys
        made by :func:`~ucm_server.store.posix.index_snapshot.read_snapshot` (their hashes made there)."""
        if len(keys) != len(stamps):
            raise ValueError(f"{len(keys)} keys and {len(stamps)} stamps")
        if native is not None and type(keys) is list and type(stamps) is list:
            filled: dict[bytes, Stamp] = {}
            for start in range(0, len(keys), BUILD_STEP):
                native.index_fill(filled, keys, stamps, start, min(len(keys), start + BUILD_STEP))
            return filled
        built: dict[bytes, Stamp] = {}
        step = 8192
        for start in range(0, len(keys), step):
            built.update(zip(keys[start : start + step], stamps[start : start + step], strict=True))
        return built

    # -- adoption -------------------------------------------------------------------------------------------
    @property
    def adopting(self) -> bool:
        """Blocks on disk may be missing here: a key not found may be looked for on disk."""
        return self.touched is not None

    def start_adopting(self) -> None:
        self.touched = set()

    def end_adopting(self) -> None:
        self.touched = None

    def install(self, loaded: dict[bytes, Stamp], loaded_bytes: int, order: list[bytes] | None = None) -> int:
        """Take ``loaded`` (blocks from before this start, least recently used first, as
        :meth:`build` makes it; ``order``: its keys in that order, if the caller has them) as the
        cold base of the index, kept as it is: no per-block work. What was stored or deleted since
        (:attr:`touched`), or found meanwhile, stays as it is now and more recent. Event loop only;
        costs the entries added since start. Returns how many blocks ``loaded`` added."""
        if self._cold or self._front:
            raise ValueError("a snapshot base is installed once, into an index that has none")
        total, dropped = loaded_bytes, 0
        for key in (*(self.touched or ()), *self._od.keys()):
            old = loaded.pop(key, None)
            if old is not None:
                total -= old
                dropped += 1
        if order is None or len(order) != len(loaded) + dropped:  # a key listed twice: the dict's order
            order = list(loaded)
        self._cold, self._order, self._cursor = loaded, order, 0
        self.bytes += total
        self.changes += 1
        if self.watch is not None:  # the order list itself when it is exactly the base (no copy)
            self.watch.stored_many(order if not dropped else list(loaded))
        return len(loaded)

    def get_many(self, keys: Sequence[bytes]) -> list[Stamp | None]:
        """:meth:`get` of many keys, in C-level ``map`` passes (one per part of the index)."""
        return self._get_all(keys)

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(self._get_all(keys))

    def lookup_digests(self, namespace: bytes, digests: Sequence[bytes]) -> list[int | None]:
        if isinstance(digests, PackedDigests):  # the Lookup RPC: index keys built in one pass
            return list(self._get_all(digests.scoped(namespace)))
        return list(self._get_all(list(map(namespace.__add__, digests))))

    def _get_all(self, keys: Sequence[bytes]) -> list[Stamp | None]:
        """Each key's stamp: the ordered dict's, else (``dict.get`` with that as the default) the
        cold base's, else the front's."""
        found: list[Stamp | None] = list(map(self._od.get, keys))
        if self._cold:
            found = list(map(self._cold.get, keys, found))
        if self._front:
            found = list(map(self._front.get, keys, found))
        return found


def factorize(values: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The distinct ``values`` (int64), ascending, and each value's index among them. Over a span
    not much wider than the values are many (sizes, seconds of a day's stores), a table instead of
    a sort: two passes over the values."""
    if not values.size:
        return [], np.zeros(0, dtype=np.int64)
    low, high = int(values.min()), int(values.max())
    if high - low > 2 * values.size + 4096:
        distinct, index = np.unique(values, return_inverse=True)
        return distinct.tolist(), index.astype(np.int64)
    offsets = values - low
    present = np.zeros(high - low + 1, dtype=bool)
    present[offsets] = True
    rank = np.cumsum(present, dtype=np.int64) - 1
    return (np.flatnonzero(present) + low).tolist(), rank[offsets]


def _as_key(key: bytes) -> BlockKey:
    if isinstance(key, BlockKey):
        return key
    return BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])
