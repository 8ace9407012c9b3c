"""The in-memory index of a file tier: what is stored, its size, when, and in which LRU order.

Built to stay small at millions of blocks (issue #13, item 5: at most 256 B per block). One
``OrderedDict`` maps each 48-byte key (:class:`~ucm_server.keys.BlockKey`, a ``bytes``) to a
:class:`Stamp`: an ``int`` (the block's size) that also carries when the block was stored. Stamps
are shared: every block of one size stored within one second points at the same object, so a
block costs its key, one dict slot and one ordered-dict link (about 190 B, measured by
``benchmarks.scale_bench``), not a dataclass, a second size dict and a float per block as before.

Because a stamp *is* the size, a Lookup answers with one C-level ``map`` over the request's keys
(``namespace + digest`` strings find the same entries as ``BlockKey`` objects).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey, PackedDigests
from ucm_server.store.watch import IndexWatch

STAMP_TABLE_MAX = 4096
"""Distinct (size, second) stamps remembered for sharing before the table starts afresh (blocks
keep the stamps they hold; only sharing with new blocks is lost)."""


class Stamp(int):
    """A block's size (the ``int`` value) and ``stored_at`` (seconds, whole), shared between blocks."""

    stored_at: float

    @property
    def size(self) -> int:
        return int(self)


class BlockIndex:
    """Keys in LRU order (least recently used first) with their :class:`Stamp`; the byte total."""

    __slots__ = ("_od", "_stamps", "bytes", "changes", "touched", "watch")

    def __init__(self) -> None:
        self._od: OrderedDict[bytes, Stamp] = OrderedDict()
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
        if key in self._od:
            return False
        self._od[key] = stamp
        self._od.move_to_end(key, last=False)
        self.bytes += stamp
        self.changes += 1
        if self.watch is not None:
            self.watch.stored(key)
        return True

    def correct(self, key: bytes, size: int, stored_at: float) -> None:
        """Set a present key's size where it stands in the LRU order (a wrong snapshot entry)."""
        old = self._od.get(key)
        if old is not None:
            self._od[key] = self.stamp(size, stored_at)
            self.bytes += size - old
            self.changes += 1

    def forget(self, key: bytes) -> Stamp | None:
        """:meth:`pop` of a block removed now (deleted, evicted, found gone or bad): adoption, if it
        runs, must not bring it back."""
        if self.touched is not None:
            self.touched.add(key)
        return self.pop(key)

    def pop(self, key: bytes) -> Stamp | None:
        stamp = self._od.pop(key, None)
        if stamp is not None:
            self.bytes -= stamp
            self.changes += 1
            if self.watch is not None:
                self.watch.removed(key)
        return stamp

    def move_to_end(self, key: bytes) -> None:
        """Mark ``key`` most recently used, if it is still indexed.

        A Delete or Evict may remove the key while its read runs in a worker thread. The read stands
        (its bytes were whole and checked); the key only has no place left to move to. This used to
        raise KeyError, which failed every unfinished block of the reading task as "internal error"
        (two clients loading and deleting the same keys at once hit it within seconds)."""
        try:
            self._od.move_to_end(key)
        except KeyError:
            pass

    def clear(self) -> None:
        self._od.clear()
        self._stamps.clear()
        self.bytes = 0
        self.changes += 1
        if self.watch is not None:
            self.watch.cleared()

    # -- questions --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> Stamp | None:
        return self._od.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def items(self) -> Iterator[tuple[BlockKey, Stamp]]:
        """``(key, stamp)`` least recently used first (a snapshot: safe while the index changes)."""
        for key, stamp in list(self._od.items()):
            yield _as_key(key), stamp

    def oldest(self) -> Iterator[tuple[BlockKey, Stamp]]:
        """``(key, stamp)`` least recently used first, lazily: stop before changing the index."""
        for key, stamp in self._od.items():
            yield _as_key(key), stamp

    def columns(self) -> tuple[list[bytes], list[Stamp]]:
        """Every key and its stamp, least recently used first (for a snapshot: C-level copies)."""
        return list(self._od.keys()), list(self._od.values())

    def columns_by_store(self) -> tuple[list[bytes], list[Stamp]]:
        """Every key and its stamp in the order blocks were last stored or adopted (reads since are
        not reflected): the dict's own array, copied ten times faster than the LRU list
        (:meth:`columns` looks every key up again; 1M blocks: ~15 ms against ~150 ms), so a
        periodic snapshot holds the event loop briefly. Not exact LRU: a crash base only."""
        return list(dict.keys(self._od)), list(dict.values(self._od))

    # -- bulk loading (a snapshot) ------------------------------------------------------------------------
    def stamps_for(self, sizes: Sequence[int], times: Sequence[float]) -> list[Stamp]:
        """The stamps of many blocks at once (loops in C; one new stamp per distinct size and second)."""
        table = self._stamps
        for size, second in set(zip(sizes, map(int, times), strict=True)).difference(table):
            stamp = Stamp(size)
            stamp.stored_at = float(second)
            table[(size, second)] = stamp
        # A second pass rather than a list of pairs: nothing per block outlives this call but the
        # stamp references (a million short-lived tuples would stay as heap fragmentation).
        stamps = list(map(table.__getitem__, zip(sizes, map(int, times), strict=True)))
        if len(table) > STAMP_TABLE_MAX:
            self._stamps = {}
        return stamps

    @staticmethod
    def build(keys: Sequence[bytes], stamps: Sequence[Stamp]) -> OrderedDict[bytes, Stamp]:
        """An ordered map of ``keys`` to ``stamps`` (any thread: a slice at a time, so the event loop
        gets the interpreter between slices)."""
        built: OrderedDict[bytes, Stamp] = OrderedDict()
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

    def install(self, loaded: OrderedDict[bytes, Stamp], loaded_bytes: int) -> int:
        """Take ``loaded`` (blocks from before this start, least recently used first) as the base of
        the index; what was stored or deleted since (:attr:`touched`), or found meanwhile, stays as
        it is now and more recent. Event loop only; costs the entries added since start. Returns how
        many blocks ``loaded`` added."""
        before, total = len(self._od), loaded_bytes
        for key in self.touched or ():
            total -= loaded.pop(key, 0)
        for key, stamp in self._od.items():
            total += stamp - loaded.pop(key, 0)
            loaded[key] = stamp
        self._od, self.bytes = loaded, total
        self.changes += 1
        if self.watch is not None:
            self.watch.stored_many(loaded.keys())
        return len(loaded) - before

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(map(self._od.get, keys))

    def lookup_digests(self, namespace: bytes, digests: Sequence[bytes]) -> list[int | None]:
        if isinstance(digests, PackedDigests):  # the Lookup RPC: index keys built in one pass
            return list(map(self._od.get, digests.scoped(namespace)))
        return list(map(self._od.get, map(namespace.__add__, digests)))


def _as_key(key: bytes) -> BlockKey:
    if isinstance(key, BlockKey):
        return key
    return BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])
