"""The one small interface every storage tier implements.

A tier stores opaque blocks under :class:`~ucm_protocol.keys.BlockKey`. It offers eight async
primitives — ``open``, ``close``, ``lookup``, ``read_into``, ``write_from``, ``delete``,
``list_blocks``, ``stats`` — and everything else (batches, verification) is derived here in the base
class, where a backend overrides it only to go faster. Capabilities are class flags, never optional
methods that raise at run time.

Bytes move through *iovecs* (:mod:`ucm_server.store.copying`, the copy engine): a sequence of writable
(or readable) memoryviews whose concatenation is the block. A block whose layers sit apart in the
client's memory is thus copied straight to and from those places, with no staging buffer, and POSIX
tiers hand the iovec to ``preadv``/``pwritev``.

Missing is a value and failures are data: reads and writes return a :class:`BlockResult`, they do not
raise for a missing or corrupt block. Exceptions are for programming errors and for a tier that cannot
start at all.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self, TypeVar

import numpy as np

from ucm_protocol.errors import ConfigError
from ucm_protocol.keys import KEY_BYTES, BlockKey, Namespace
from ucm_protocol.keys import NAMESPACE_BYTES as _NS
from ucm_protocol.settings import load_fields
from ucm_protocol.states import BlockState
from ucm_server.store.copying import IoVec
from ucm_server.store.watch import IndexWatch, removed_many

_KEY = _NS + KEY_BYTES
T = TypeVar("T")
V = TypeVar("V")


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


ARRAY_KEYS = 64
"""A batch of at least this many keys is cut into namespace and digest as an array."""


def _digests_of_one_namespace(keys: list[BlockKey]) -> list[bytes] | None:
    """Each key's digest, where every key is ``namespace + digest`` of one namespace; else None."""
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8)
    if rows.size != len(keys) * _KEY:
        return None
    rows = rows.reshape(len(keys), _KEY)
    if not (rows[:, :_NS] == rows[0, :_NS]).all():
        return None
    return rows[:, _NS:].copy().view(f"V{_KEY - _NS}").ravel().tolist()  # void: keeps trailing zeros


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

    def add_many(self, keys: list[BlockKey], sizes: list[int]) -> None:
        """Hold ``keys`` at ``sizes``; the watcher hears of the batch in one ``stored_many`` call.
        A batch of one namespace (a Dump's chunk) is cut into digests by one array operation and
        put in its map by one ``update`` (a slice, a ``setdefault`` and a store a key before)."""
        by_ns = self._by_ns
        digests = _digests_of_one_namespace(keys) if len(keys) >= ARRAY_KEYS else None
        if digests is not None and len(sizes) == len(keys):
            by_ns.setdefault(keys[0][:_NS], {}).update(zip(digests, sizes, strict=True))
        else:
            for key, size in zip(keys, sizes, strict=True):
                by_ns.setdefault(key[:_NS], {})[key[_NS:]] = size
        if self.watch is not None and keys:
            self.watch.stored_many(keys)

    def discard_many(self, keys: list[BlockKey]) -> None:
        """Hold none of ``keys``; the watcher hears of the batch in one ``removed_many`` call."""
        by_ns = self._by_ns
        for key in keys:
            ns = key[:_NS]
            digests = by_ns.get(ns)
            if digests is not None:
                digests.pop(key[_NS:], None)
                if not digests:
                    del by_ns[ns]
        if self.watch is not None and keys:
            removed_many(self.watch, keys)

    def replacing(self, keys: list[BlockKey]) -> None:
        """``keys`` are held now and :meth:`add_many` holds each of them again next, at its new
        version's size: the watcher hears now that the old versions are gone, as
        :meth:`discard_many` would tell it, and the index's entries are left for ``add_many`` to
        overwrite (a dump replacing its blocks paid to take each one out and put it back)."""
        if self.watch is not None and keys:
            removed_many(self.watch, keys)

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

    def pinned(self, key: bytes) -> bool:
        """Whether ``key`` is pinned (the pipeline never leaves a pinned block in the Cache alone)."""
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

    def footprint(self, size: int) -> int:
        """Bytes of the tier's capacity a block of ``size`` bytes takes (what a pin holds of it).
        Default: its size; a tier that allocates in pages says so."""
        return size

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
