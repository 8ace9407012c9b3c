"""The one small interface every storage tier implements.

A tier stores opaque blocks under :class:`~ucm_server.keys.BlockKey`. It offers eight async
primitives — ``open``, ``close``, ``lookup``, ``read_into``, ``write_from``, ``delete``,
``list_blocks``, ``stats`` — and everything else (batches, verification) is derived here in the base
class, where a backend overrides it only to go faster. Capabilities are class flags, never optional
methods that raise at run time.

Bytes move through *iovecs*: a sequence of writable (or readable) memoryviews whose concatenation is
the block. A block whose layers sit apart in the client's memory is thus copied straight to and from
those places, with no staging buffer, and POSIX tiers hand the iovec to ``preadv``/``pwritev``.

Missing is a value and failures are data: reads and writes return a :class:`BlockResult`, they do not
raise for a missing or corrupt block. Exceptions are for programming errors and for a tier that cannot
start at all.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self, TypeVar

import numpy as np

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import NAMESPACE_BYTES as _NS
from ucm_protocol.keys import BlockKey, Namespace
from ucm_protocol.native import native
from ucm_protocol.settings import load_fields
from ucm_protocol.states import BlockState as BlockState  # noqa: PLC0414 (re-export until 0.2)
from ucm_server.store.watch import IndexWatch

T = TypeVar("T")
V = TypeVar("V")

IoVec = Sequence[memoryview]
"""A block's bytes as an ordered list of memory segments (scatter/gather)."""


def iov_len(iov: IoVec) -> int:
    if len(iov) == 1:  # the usual block: one segment (a third of the generator's cost)
        return iov[0].nbytes
    return sum(m.nbytes for m in iov)


def copy_iov(dst: IoVec, src: IoVec) -> None:
    """Copy ``src`` into ``dst`` (equal total length) segment by segment, splitting where they differ."""
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        n = min(d.nbytes - doff, s.nbytes - soff)
        d[doff : doff + n] = s[soff : soff + n]
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0


RUN_COPY_MIN = 256 << 10
"""Blocks at least this large are copied as address runs (:func:`copy_all`); smaller ones as slices."""


def copy_all(pairs: Sequence[tuple[IoVec, IoVec]]) -> None:
    """Copy each ``(dst, src)`` pair of a batch, large blocks as few, long ``memmove`` runs.

    Where consecutive blocks continue each other on both sides (a client's KV blocks side by side,
    the arena's pages allocated in order), their copies merge into one: one long copy runs at memcpy
    speed (the C library switches to non-temporal stores for long copies), while a slice assignment
    per 64 KiB page costs a Python step each and keeps the cache busy. ``ctypes.memmove`` also
    releases the GIL, so the event loop answers calls meanwhile; so does the compiled helper's
    ``copy_pairs``, which takes the blocks below :data:`RUN_COPY_MIN` in one call where it is built
    (a slice assignment per block held the GIL for every byte). Addresses come from the very
    memoryviews (:func:`_address`), within their bounds. A block of one segment on each side (the
    usual case) skips the segment walk.
    """
    runs: list[list[int]] = []
    if native is not None:  # small blocks in one compiled call, the GIL released while it copies
        small = [p for p in pairs if iov_len(p[0]) < RUN_COPY_MIN]
        if small:
            native.copy_pairs(small)
            if len(small) == len(pairs):
                return
            pairs = [p for p in pairs if iov_len(p[0]) >= RUN_COPY_MIN]
    for dst, src in pairs:
        if len(dst) == 1 and len(src) == 1 and (n := dst[0].nbytes) == src[0].nbytes:
            if n < RUN_COPY_MIN:  # one segment on each side (the usual block): no walk
                dst[0][:] = src[0]
                continue
            pieces = [(_address(dst[0]), _address(src[0]), n, 0)]
        elif iov_len(dst) < RUN_COPY_MIN:
            copy_iov(dst, src)
            continue
        else:
            pieces = _pieces(dst, src)
        for d, s, n, _ in pieces:
            last = runs[-1] if runs else None
            if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
                last[2] += n
            else:
                runs.append([d, s, n])
    _memmove_runs(runs)


def copy_in_order(pairs: Sequence[tuple[IoVec, IoVec]], report: Callable[[int], None]) -> None:
    """Copy each ``(dst, src)`` pair of a batch segment by segment of the destinations: segment 0 of
    every block, ``report(1)``, then segment 1 of every block, ``report(2)``, and so on (a block with
    fewer segments is complete from its last one on). A Load's client can so read the first
    segments of every block (vLLM's first layers) while later ones are still copied
    (:mod:`ucm_server.load_progress`). The first round is split over two threads like any large
    copy (the reader waits for it, its core idle); later rounds run on this thread alone, in
    order, while the reader computes on the other core: a split there would take that core.
    """
    walks = [_walk(dst, src) for dst, src in pairs]  # each block's pieces, walked one round at a time
    pending = [next(walk, None) for walk in walks]
    segment = 0
    while any(piece is not None for piece in pending):
        runs: list[list[int]] = []
        for i, walk in enumerate(walks):
            piece = pending[i]
            while piece is not None and piece[3] == segment:
                d, s, n, _ = piece
                last = runs[-1] if runs else None
                if last is not None and last[0] + last[2] == d and last[1] + last[2] == s:
                    last[2] += n
                else:
                    runs.append([d, s, n])
                piece = next(walk, None)
            pending[i] = piece
        if segment == 0:
            _memmove_runs(runs, FIRST_ROUND_SPLIT_BYTES)
        else:
            _memmove_all(runs)
        segment += 1
        report(segment)


SPLIT_COPY_BYTES = 8 << 20
"""A batch at least this large is copied by two threads, each half of the bytes (GIL released)."""
FIRST_ROUND_SPLIT_BYTES = 1 << 20
""":func:`copy_in_order`'s first round is split from this size on: its reader waits for it."""
_helper: ThreadPoolExecutor | None = None


def _memmove_runs(runs: list[list[int]], split_bytes: int = SPLIT_COPY_BYTES) -> None:
    """Copy the runs; a batch of ``split_bytes`` or more in two halves at once, this thread and one
    helper thread (a ``memmove`` releases the GIL: where memory bandwidth allows, two cores copy
    faster than one)."""
    total = sum(n for _, _, n in runs)
    if total < split_bytes:
        for d, s, n in runs:
            ctypes.memmove(d, s, n)
        return
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="ucm-copy")
    half = total // 2
    first: list[list[int]] = []
    second: list[list[int]] = []
    taken = 0
    for d, s, n in runs:
        if taken >= half:
            second.append([d, s, n])
        elif taken + n <= half:
            first.append([d, s, n])
        else:
            k = half - taken
            first.append([d, s, k])
            second.append([d + k, s + k, n - k])
        taken += n
    other = _helper.submit(_memmove_all, second)
    _memmove_all(first)
    other.result()


def _memmove_all(runs: list[list[int]]) -> None:
    for d, s, n in runs:
        ctypes.memmove(d, s, n)


def _address(view: memoryview) -> int:
    """The first byte's address: through ctypes for a writable view (a sixth of numpy's cost, which
    adds up at two views per block), through numpy for a read-only one (ctypes refuses those)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _pieces(dst: IoVec, src: IoVec) -> list[tuple[int, int, int, int]]:
    """``(dst address, src address, length, dst segment index)`` pieces of one copy, split where the
    segments differ (as :func:`copy_iov` walks them)."""
    return list(_walk(dst, src))


def _walk(dst: IoVec, src: IoVec) -> Iterator[tuple[int, int, int, int]]:
    """:func:`_pieces` one at a time, in destination order (an ordered copy starts on the first
    segments before the walk has reached the last ones)."""
    di = si = doff = soff = 0
    daddr = saddr = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        if d.nbytes == 0:
            di += 1
            continue
        if s.nbytes == 0:
            si += 1
            continue
        if doff == 0:
            daddr = _address(d)
        if soff == 0:
            saddr = _address(s)
        n = min(d.nbytes - doff, s.nbytes - soff)
        yield (daddr + doff, saddr + soff, n, di)
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0


@dataclass(frozen=True, slots=True)
class BlockResult:
    state: BlockState
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state is BlockState.OK


OK = BlockResult(BlockState.OK)
MISSING = BlockResult(BlockState.MISSING)


def failed(reason: str) -> BlockResult:
    return BlockResult(BlockState.FAILED, reason)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a tier knows about one stored block, without reading its payload."""

    key: BlockKey
    size: int
    tier: str
    stored_at: float = 0.0
    checksum: int | None = None


@dataclass(slots=True)
class TierStats:
    """Counters a tier keeps; ``ucm-admin stats`` and the Prometheus exporter read these."""

    name: str
    kind: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    errors: int = 0
    corrupt: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SizeIndex:
    """Block sizes by namespace, then digest: what local tiers answer lookups from.

    Two levels so the Lookup RPC (one namespace, thousands of digests) runs as one C-level ``map``
    over the request's digests, with no per-key object built in Python. Keys are cut by slicing
    (``key[:16]``, ``key[16:]``), not through :class:`BlockKey`'s properties: a quarter of the cost,
    which a Load's size check and every stored block pay per key.
    """

    __slots__ = ("_by_ns", "watch")

    def __init__(self) -> None:
        self._by_ns: dict[bytes, dict[bytes, int]] = {}
        self.watch: IndexWatch | None = None
        """Told of every change (:mod:`ucm_server.store.watch`): KV events."""

    def add(self, key: BlockKey, size: int) -> None:
        self._by_ns.setdefault(key[:_NS], {})[key[_NS:]] = size
        if self.watch is not None:
            self.watch.stored(key)

    def discard(self, key: BlockKey) -> None:
        ns = key[:_NS]
        digests = self._by_ns.get(ns)
        if digests is not None:
            digests.pop(key[_NS:], None)
            if not digests:
                del self._by_ns[ns]
        if self.watch is not None:
            self.watch.removed(key)

    def keys(self) -> list[BlockKey]:
        """Every key held (for a watcher attached after blocks were stored)."""
        return [BlockKey(ns, d) for ns, digests in self._by_ns.items() for d in digests]

    def lookup_digests(self, namespace: bytes, digests: Sequence[bytes]) -> list[int | None]:
        found = self._by_ns.get(namespace)
        if found is None:
            return [None] * len(digests)
        return list(map(found.get, digests))

    def get(self, key: BlockKey) -> int | None:
        digests = self._by_ns.get(key[:_NS])
        return None if digests is None else digests.get(key[_NS:])

    def __contains__(self, key: BlockKey) -> bool:
        return self.get(key) is not None

    def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        by_ns = self._by_ns
        return [(by_ns.get(k[:_NS]) or {}).get(k[_NS:]) for k in keys]

    def clear(self) -> None:
        self._by_ns.clear()
        if self.watch is not None:
            self.watch.cleared()


class EvictionRules(Protocol):
    """The daemon's retention rules as a tier's eviction sees them
    (:class:`ucm_server.retention.RetentionTable`): the order to evict in, pinned blocks left out."""

    def victims(
        self, candidates: Iterable[tuple[bytes, V]], find: Callable[[bytes], V | None]
    ) -> Iterator[tuple[bytes, V]]:
        """``candidates`` (the tier's own order, key and value) reordered and filtered by the rules;
        ``find`` gives the tier's value for a key the rules name (``None``: not in this tier)."""
        ...


DEFAULT_MAX_BLOCK_BYTES = 256 << 20
"""The daemon's default ``max_block_bytes``."""


@dataclass(frozen=True, slots=True)
class TierContext:
    """Plain daemon-wide values a tier may need when it is built; never the daemon's whole config.

    ``executor``: the daemon's thread pool for blocking file and copy work (``None``: the event
    loop's default executor). ``max_block_bytes``: the largest block the daemon accepts; a stored
    header claiming more is corrupt.
    """

    executor: Executor | None = None
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES


DEFAULT_CONTEXT = TierContext()
"""The context of a tier built outside a daemon (tests, tools): the loop's executor, default limits."""


class Tier(abc.ABC):
    """A storage tier. Subclasses implement the eight primitives; batches come from here.

    Every tier is built the same way, by :meth:`from_settings` from its name, its settings and a
    :class:`TierContext`: the registry does it for ``store_pipeline``, tests and wrappers do it too.
    A tier declares its settings as a frozen dataclass in ``Settings`` (one field per key, a
    docstring per field, ``metadata={"secret": True}`` for values never to be shown in errors).
    """

    kind: ClassVar[str]
    """Name used in ``store_pipeline`` (``"Cache"``, ``"Posix"``...)."""
    persistent: ClassVar[bool] = False
    """Blocks survive a daemon restart."""
    shared: ClassVar[bool] = False
    """Other nodes' daemons write to it too: a local index cannot answer lookups alone."""
    max_concurrency: ClassVar[int] = 16
    """How many single-block operations the default batch helpers run at once."""
    Settings: ClassVar[type[Any] | None] = None
    """The frozen dataclass of the tier's settings (its ``tier_settings`` entry); ``None``: the tier
    cannot be built from configuration unless it overrides :meth:`from_settings`."""
    pin_gap: ClassVar[str] = "its eviction is its own and does not read this daemon's pins"
    """Empty when the tier's eviction honours :attr:`rules` (pins, priorities); otherwise why a pin
    is not held there (shown to whoever pins, who may then refuse the pin)."""
    rules: EvictionRules | None = None
    """The daemon's retention rules (set by the pipeline); ``None``: plain eviction order."""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        """Build the tier called ``name`` (its place in ``store_pipeline``) from ``settings``.

        The one way every tier is built (registry, tests, wrappers). The default checks ``settings``
        against :attr:`Settings` (unknown keys, types, sizes, required keys; errors name the tier and
        the key) and calls ``cls(name, **values)``, so the constructor's defaults apply to keys not
        given. Override it only to pass values from ``context`` (an executor, ``max_block_bytes``) or
        to derive values; call :func:`load_tier_settings` for the checking.
        """
        return cls(name, **load_tier_settings(cls, name, settings))

    # -- the primitives -------------------------------------------------------------------------------
    async def open(self) -> None:  # noqa: B027 - optional hook with a sensible default
        """Prepare the tier (rebuild indexes, connect). Raise only if it cannot serve at all."""

    async def close(self) -> None:  # noqa: B027
        """Flush and release resources; the tier is not used afterwards."""

    @property
    def indexing(self) -> bool:
        """True while the tier still builds its index in the background after :meth:`open` (its
        Lookups may miss blocks it holds); tiers that index before serving never are."""
        return False

    async def indexed(self) -> None:  # noqa: B027
        """Return once the index holds every block stored before this start (at once by default)."""

    @abc.abstractmethod
    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Size of each stored block, ``None`` where absent. Local tiers answer from memory."""

    @abc.abstractmethod
    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        """Copy the block into ``dest`` (whose total length must equal the block's size)."""

    @abc.abstractmethod
    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        """Store ``src`` as the block; visible to readers only once completely written."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many existed."""

    @abc.abstractmethod
    def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        """Every block (of ``namespace`` if given), in no promised order."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    # -- derived helpers (override only to go faster) ---------------------------------------------------
    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        """``lookup`` for many digests of one namespace (the Lookup RPC's shape). Default: build
        keys (about 0.1 µs each) and call ``lookup``; local tiers answer from a per-namespace map."""
        return await self.lookup([BlockKey(namespace, d) for d in digests])

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Read a batch. Default: ``read_into`` per block, ``max_concurrency`` at a time."""
        return await bounded_gather(self.max_concurrency, [self.read_into(k, d) for k, d in items])

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Write a batch. Default: ``write_from`` per block, ``max_concurrency`` at a time."""
        return await bounded_gather(self.max_concurrency, [self.write_from(k, s) for k, s in items])

    async def read_checked_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult | None]:
        """:meth:`read_checked` for a batch. Default: one block at a time, ``max_concurrency`` at
        once; a tier overrides it to batch (the Posix tier: one executor job per group of blocks)."""
        return await bounded_gather(self.max_concurrency, [self.read_checked(k, d) for k, d in items])

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        """Read a block straight into memory the daemon does not own (a client's region) and check
        it there, deciding nothing about the stored copy from what ``dest`` holds: OK when the bytes
        in ``dest`` match the stored checksum; MISSING or FAILED for what reading found without
        looking at ``dest`` (absent, unreadable, a bad header); ``None`` when ``dest`` did not match:
        the caller reads the block again into its own memory, where a mismatch does mean corruption,
        and overwrites ``dest`` with the verified block or zeroes it. It saves a copy on the common
        path. Default: ``None``, always read through daemon memory."""
        return None

    async def info(self, key: BlockKey) -> BlockInfo | None:
        """Metadata of one block. Default: a lookup (no checksum known)."""
        (size,) = await self.lookup([key])
        return None if size is None else BlockInfo(key=key, size=size, tier=self.name)

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        """Re-check a block's integrity; ``quarantine`` moves a corrupt copy aside (where the tier
        can). Default: read it into scratch memory (tiers that checksum on read report corruption)."""
        (size,) = await self.lookup([key])
        if size is None:
            return MISSING
        return await self.read_into(key, [memoryview(bytearray(size))])

    async def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` by the tier's eviction policy; returns bytes freed.
        Default: tiers without a policy free nothing."""
        return 0

    def use_rules(self, rules: EvictionRules) -> None:
        """Evict under ``rules`` from now on (a wrapper passes them to the tier it wraps)."""
        self.rules = rules

    def eviction_order(
        self, candidates: Iterable[tuple[bytes, V]], find: Callable[[bytes], V | None]
    ) -> Iterator[tuple[bytes, V]]:
        """The tier's own eviction order (``candidates``) under the daemon's :attr:`rules`."""
        return iter(candidates) if self.rules is None else self.rules.victims(candidates, find)


def load_tier_settings(cls: type[Tier], name: str, settings: Mapping[str, object]) -> dict[str, Any]:
    """``settings`` checked against ``cls.Settings``: only the keys given, converted to their types.

    Strings are parsed (``"true"``, ``"256MiB"`` for any int, ``"1.5"``); errors read ``tier 'NAME'
    (KIND): setting 'KEY' ...`` and never show a secret's value.
    """
    kind = getattr(cls, "kind", cls.__name__)
    if cls.Settings is None:
        raise ConfigError(f"tier {name!r} ({kind}) cannot be built from configuration (no Settings)")
    return load_fields(
        cls.Settings,
        settings,
        f"tier {name!r} ({kind})",
        at=lambda key: f"tier {name!r} ({kind}): setting {key!r}",
        source="structured",
        sizes=True,
    )


async def bounded_gather(limit: int, coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather`` with at most ``limit`` coroutines running at once."""
    sem = asyncio.Semaphore(limit)

    async def run(c: Coroutine[Any, Any, T]) -> T:
        async with sem:
            return await c

    return list(await asyncio.gather(*(run(c) for c in coros)))
