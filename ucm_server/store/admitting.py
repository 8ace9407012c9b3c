"""Admission at the daemon's tier boundaries: where the policies of :mod:`ucm_server.store.admission`
decide, and what happens to a block they turn away.

Three boundaries, each with its own policy (settings ``admission_daemon``, ``admission_local``,
``admission_shared``; ``always`` everywhere by default, which installs nothing):

* **the daemon's door** (connector → daemon): a dumped block the policy refuses is not stored at
  all; its Dump still reports it OK (a cache may drop any block), and the refusal is counted. Applied
  to host dumps; the GPU path commits into the Cache before the pipeline sees the block.
* **Cache → a local tier below it** (Posix: the write-back) and **→ a shared tier** (DS3FS, Mooncake,
  S3): each such tier is wrapped in an :class:`AdmittingTier`. A block its policy defers is not
  written there (nor to any tier below: a block reaches a tier only through the one above it) and
  reports OK to the write-down: it stays in the tiers above, evictable as any block. It is
  remembered as *pending* there while the Cache holds it; when it is used again (a Lookup that
  finds it, a read) and the policy now admits it, it is written down from the Cache
  (:meth:`~ucm_server.store.pipeline.Pipeline.flow_down`, in the background). A pending block
  evicted from the Cache first is simply not written: if it is wanted again it is recomputed and
  offered again, and then it is admitted (its uses are remembered for the window).

Blocks a policy must not turn away: a durable dump's (``wait_durable``: it asked for the disk), and
a block the Cache refused (it is nowhere else). Uses are recorded only where a policy is not
``always``, so the default costs nothing on the Lookup and Load paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from ucm_protocol.keys import BlockKey, PackedDigests
from ucm_server.store.admission import (
    NO_VICTIM,
    AdmissionPolicy,
    AdmissionSettings,
    AlwaysAdmit,
    Hashes,
    digest_hashes,
    key_hashes,
    make_admission,
)
from ucm_server.store.base import OK, BlockResult, IoVec, Tier, TierStats, iov_len
from ucm_server.store.io_classes import IoClass, io_class
from ucm_server.store.observed import ObservedTier
from ucm_server.store.watch import IndexWatch, Watchable
from ucm_server.store.wrapper import TierWrapper

if TYPE_CHECKING:
    from ucm_server.store.leasing import Leasing

log = logging.getLogger(__name__)

__all__ = ["Admission", "AdmissionConfig", "AdmittingTier", "cache_only", "install_admission"]

cache_only: ContextVar[bool] = ContextVar("ucm_cache_only", default=False)
"""A dump its client asked to keep in the Cache only (``DumpRequest.cache_only``: a one-off prompt
worth a moment in memory, never the disk's wear): the Dump RPC sets it, the pipeline's write reads
it in the task that inherits it, and writes such blocks to no tier below the Cache (an older copy
there is dropped). Ignored for a durable dump."""


@runtime_checkable
class EvictionCandidates(Protocol):
    """A tier that can name the blocks it would evict next (a frequency policy's victims)."""

    def eviction_candidates(self) -> Iterator[bytes]: ...


class AdmissionHost(Protocol):
    """What admission needs of the pipeline (:class:`~ucm_server.store.pipeline.Pipeline`)."""

    tiers: list[Tier]
    top: Tier
    leasing: Leasing | None

    async def flow_down(self, keys: Sequence[BlockKey], *, durable: bool = False) -> list[BlockResult]: ...


class AdmissionConfig(Protocol):
    """What :func:`install_admission` reads of the daemon's config (``ServerConfig`` has it all)."""

    @property
    def admission_daemon(self) -> str: ...
    @property
    def admission_local(self) -> str: ...
    @property
    def admission_shared(self) -> str: ...
    @property
    def admission_window_s(self) -> float: ...
    @property
    def admission_window_keys(self) -> int: ...


@dataclass(slots=True)
class BoundaryFigures:
    """What one boundary decided (counters since start; tier stats ``extra`` ``admission_*``)."""

    offered: int = 0
    """Blocks offered to the tier (write-downs, not counting re-offers)."""
    admitted: int = 0
    """Offered blocks written to the tier."""
    deferred: int = 0
    """Offered blocks the policy turned away (kept in the tiers above)."""
    deferred_bytes: int = 0
    readmitted: int = 0
    """Deferred blocks written down later, at a use that made the policy admit them."""

    def as_extra(self) -> dict[str, float]:
        return {f"admission_{f.name}": float(getattr(self, f.name)) for f in fields(self)}


class AdmittingTier(TierWrapper):
    """A tier below the Cache behind an admission policy (see the module); to every reader it is the
    tier it wraps (name, kind, index, KV events), plus ``admission_*`` figures in its stats."""

    def __init__(self, inner: Tier, policy: AdmissionPolicy, admission: Admission, index: int) -> None:
        super().__init__(inner)
        setattr(self, "kind", inner.kind)  # noqa: B010 - it is the inner tier to every reader
        self.policy = policy
        self.admission = admission
        self.index = index
        """Which boundary: 0 for the first tier below the Cache."""
        self.figures = BoundaryFigures()

    def watch_index(self, watch: IndexWatch) -> None:
        """KV events: the inner tier's index, or (a tier without one) what its calls return, observed
        inside this wrapper so a deferred block is never announced as stored."""
        if not isinstance(self.inner, Watchable):
            self.inner = ObservedTier(self.inner)
        assert isinstance(self.inner, Watchable)
        self.inner.watch_index(watch)

    async def close(self) -> None:
        await self.admission.close()  # no write-down of a re-admitted block starts any more
        await self.inner.close()

    def stats(self) -> TierStats:
        s = self.inner.stats()
        s.extra = {**s.extra, **self.figures.as_extra()}
        return s

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        return (await self.write_many([(key, src)]))[0]

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        admit = await self.admission.decide(self, items)
        chosen = [i for i, ok in enumerate(admit) if ok]
        if len(chosen) == len(items):
            return await self.inner.write_many(items)
        results: list[BlockResult] = [OK] * len(items)
        if chosen:
            for i, r in zip(chosen, await self.inner.write_many([items[i] for i in chosen]), strict=True):
                results[i] = r
        return results


class Admission:
    """The daemon's admission: the policy at its door, the :class:`AdmittingTier` boundaries, and
    the blocks pending below the Cache. The pipeline calls :meth:`looked_up`, :meth:`read`,
    :meth:`at_door` and :meth:`insist` (its hooks); the boundaries call :meth:`decide`."""

    def __init__(self, host: AdmissionHost, door: AdmissionPolicy | None, max_pending: int) -> None:
        self.host = host
        self.door = door
        self.door_figures = BoundaryFigures()
        self.boundaries: list[AdmittingTier] = []
        self.max_pending = max(max_pending, 1)
        self.pending: OrderedDict[bytes, int] = OrderedDict()
        """``namespace + digest`` of blocks deferred somewhere -> bit mask of the boundaries."""
        self._reoffering: dict[bytes, int] = {}
        """Blocks being written down after a use -> the boundaries that take them now."""
        self._insisted: OrderedDict[bytes, None] = OrderedDict()
        """Blocks of durable dumps: every boundary admits them."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def policies(self) -> list[AdmissionPolicy]:
        found = [b.policy for b in self.boundaries]
        return found if self.door is None else [self.door, *found]

    # -- uses (the pipeline's hooks) -----------------------------------------------------------------
    def looked_up(self, namespace: bytes, digests: Sequence[bytes], sizes: Sequence[int | None]) -> None:
        """A Lookup answered ``sizes``: the blocks it found are used again."""
        if all(s is not None for s in sizes):
            hits: Sequence[bytes] = digests
            h = digest_hashes(namespace, digests.packed if isinstance(digests, PackedDigests) else digests)
        else:
            hits = [d for d, s in zip(digests, sizes, strict=True) if s is not None]
            if not hits:
                return
            h = digest_hashes(namespace, hits)
        self._used(h, [namespace + d for d in hits] if self.pending else [])

    def read(self, keys: Sequence[BlockKey], results: Sequence[BlockResult]) -> None:
        """A read found these blocks (OK results): they are used again."""
        found = [k for k, r in zip(keys, results, strict=True) if r.ok]
        if found:
            self._used(key_hashes(found), found)

    def _used(self, h: Hashes, keys: Sequence[bytes]) -> None:
        for policy in self.policies:
            policy.record(h)
        if not self.pending or not keys:
            return
        waiting = [i for i, k in enumerate(keys) if k in self.pending]
        if waiting:
            self._reoffer([keys[i] for i in waiting], h[waiting])

    def _reoffer(self, keys: list[bytes], h: Hashes) -> None:
        """Pending blocks just used: those the policies now admit somewhere are written down."""
        take = [0] * len(keys)
        for b in self.boundaries:
            bit = 1 << b.index
            sel = [i for i, k in enumerate(keys) if self.pending[k] & bit]
            if not sel:
                continue
            victims = self._victims(b.inner, [0] * len(sel)) if b.policy.needs_victims else h[sel] * 0
            for i, ok in zip(sel, b.policy.admit(h[sel], victims), strict=True):
                if ok:
                    take[i] |= bit
        leasing = self.host.leasing
        flow: list[BlockKey] = []
        for key, bits in zip(keys, take, strict=True):
            if not bits:
                continue
            left = self.pending.pop(key) & ~bits
            if left:
                self.pending[key] = left
            if leasing is not None and leasing.holds(BlockKey(key[:16], key[16:])):
                self._reoffering[key] = self._reoffering.get(key, 0) | bits
                flow.append(BlockKey(key[:16], key[16:]))
        if flow:
            task = asyncio.get_running_loop().create_task(self._flow_down(flow))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flow_down(self, keys: list[BlockKey]) -> None:
        cache_only.set(False)  # this task's own context: a write-down, whoever's use started it
        with io_class(IoClass.BACKGROUND):
            try:
                results = await self.host.flow_down(keys)
            except Exception:  # a failed write-down is a future miss, never a failed request
                log.exception("writing down %d blocks admitted at their second use", len(keys))
                results = []
        for key, r in zip(keys, results, strict=False):
            if not r.ok:  # left the Cache meanwhile, or failed below: not written
                self._reoffering.pop(key, None)

    # -- the door --------------------------------------------------------------------------------------
    async def write(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        durable: bool,
        store: Callable[[Sequence[tuple[BlockKey, IoVec]]], Awaitable[list[BlockResult]]],
    ) -> list[BlockResult]:
        """A dump's write through the door: ``store`` the blocks the door admits (all of a durable
        dump's, which every boundary then admits too); the others are reported OK, not stored."""
        if durable:
            self.insist([k for k, _ in items])
            return await store(items)
        admit = self.at_door(items)
        if all(admit):
            return await store(items)
        results: list[BlockResult] = [OK] * len(items)
        chosen = [i for i, ok in enumerate(admit) if ok]
        if chosen:
            for i, r in zip(chosen, await store([items[i] for i in chosen]), strict=True):
                results[i] = r
        return results

    def at_door(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[bool]:
        """Whether each dumped block is stored at all (the ``admission_daemon`` policy)."""
        door = self.door
        if door is None:
            return [True] * len(items)
        keys = [k for k, _ in items]
        h = key_hashes(keys)
        door.record(h)
        victims = self._cache_victims([iov_len(src) for _, src in items]) if door.needs_victims else h * 0
        admit = [bool(x) for x in door.admit(h, victims)]
        f = self.door_figures
        f.offered += len(items)
        f.admitted += sum(admit)
        for (_, src), ok in zip(items, admit, strict=True):
            if not ok:
                f.deferred += 1
                f.deferred_bytes += iov_len(src)
        return admit

    def insist(self, keys: Sequence[bytes]) -> None:
        """A durable dump: every boundary admits these blocks."""
        for k in keys:
            self._insisted[k] = None
            self._insisted.move_to_end(k)
        while len(self._insisted) > self.max_pending:
            self._insisted.popitem(last=False)

    # -- the boundaries ----------------------------------------------------------------------------------
    async def decide(self, boundary: AdmittingTier, items: Sequence[tuple[BlockKey, IoVec]]) -> list[bool]:
        """Which of ``items`` go to ``boundary``'s tier now; the others are deferred (pending)."""
        j, bit = boundary.index, 1 << boundary.index
        keys = [k for k, _ in items]
        above = await self._held_above(j, keys)
        admit = [False] * len(items)
        ask: list[int] = []
        last = j == len(self.boundaries) - 1
        for i, key in enumerate(keys):
            if key in self._insisted:
                admit[i] = True
                if last:
                    del self._insisted[key]
            elif (bits := self._reoffering.get(key)) is not None:  # written down after a use
                admit[i] = bool(bits & bit) and above[i]
                if bits & bit and not above[i]:
                    self._defer(key, bit)
                if last or not bits & ~((bit << 1) - 1):  # no deeper boundary waits for it
                    self._reoffering.pop(key, None)
                else:
                    self._reoffering[key] = bits & ~bit
                if admit[i]:
                    boundary.figures.readmitted += 1
            elif j == 0 and not above[i]:
                admit[i] = True  # the Cache refused it: this is where it is stored
            elif not above[i]:
                self._defer(key, bit)  # not in the tier above: it cannot pass this boundary
            else:
                ask.append(i)
        if ask:
            f = boundary.figures
            h = key_hashes([keys[i] for i in ask])
            boundary.policy.record(h)
            sizes = [iov_len(items[i][1]) for i in ask]
            victims = self._victims(boundary.inner, sizes) if boundary.policy.needs_victims else h * 0
            f.offered += len(ask)
            for i, size, ok in zip(ask, sizes, boundary.policy.admit(h, victims), strict=True):
                if ok:
                    admit[i] = True
                    f.admitted += 1
                    self._undefer(keys[i], bit)
                else:
                    f.deferred += 1
                    f.deferred_bytes += size
                    self._defer(keys[i], bit)
        return admit

    async def _held_above(self, j: int, keys: list[BlockKey]) -> list[bool]:
        """Per key: held by the tier above boundary ``j`` (the Cache for the first one)."""
        if j == 0:
            leasing = self.host.leasing
            return [leasing is not None and leasing.holds(k) for k in keys]
        sizes = await self.boundaries[j - 1].inner.lookup(keys)
        return [s is not None for s in sizes]

    def _defer(self, key: bytes, bit: int) -> None:
        self.pending[key] = self.pending.pop(key, 0) | bit
        while len(self.pending) > self.max_pending:  # the oldest left the Cache long ago, most likely
            self.pending.popitem(last=False)

    def _undefer(self, key: bytes, bit: int) -> None:
        bits = self.pending.get(key)
        if bits is not None:
            if bits & ~bit:
                self.pending[key] = bits & ~bit
            else:
                del self.pending[key]

    def _victims(self, tier: Tier, sizes: Sequence[int]) -> Hashes:
        """Per candidate, the hash of the block ``tier`` would evict to store it (none while it has
        room; none when the tier cannot name its victims)."""
        s = tier.stats()
        source = _candidates_of(tier)
        if not s.capacity_bytes or source is None:
            return np.full(len(sizes), NO_VICTIM, dtype=np.uint64)
        needs = [max(size, 1) for size in sizes]
        return _victims_in_order(needs, s.capacity_bytes - s.bytes, source.eviction_candidates())

    def _cache_victims(self, sizes: Sequence[int]) -> Hashes:
        """:meth:`_victims` for the Cache at the door: its free pages, then its eviction policy's order."""
        leasing, policy = self.host.leasing, getattr(self.host.top, "policy", None)
        if leasing is None or policy is None:
            return np.full(len(sizes), NO_VICTIM, dtype=np.uint64)
        arena = leasing.arena
        needs = [arena.pages_for(size) for size in sizes]
        return _victims_in_order(needs, arena.free_pages, iter(policy.order()))

    def door_extra(self) -> dict[str, float]:
        """The door's figures as the top tier's ``extra`` entries (``admission_*``)."""
        return self.door_figures.as_extra() if self.door is not None else {}

    async def settle(self) -> None:
        """Wait until the write-downs of re-admitted blocks started so far have ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Stop the write-downs of re-admitted blocks still under way (they were never promised)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def _victims_in_order(needs: Sequence[int], free: int, order: Iterator[bytes]) -> Hashes:
    """Candidates needing ``needs`` (bytes or pages) of a tier with ``free`` of them: each one that
    does not fit gets the next key of the tier's eviction ``order`` as its victim (hashed)."""
    out = np.full(len(needs), NO_VICTIM, dtype=np.uint64)
    victims: list[bytes] = []
    where: list[int] = []
    for i, need in enumerate(needs):
        if free >= need:
            free -= need
            continue
        victim = next(order, None)
        if victim is None:
            break
        victims.append(victim)
        where.append(i)
    if victims:
        out[where] = key_hashes(victims)
    return out


def _candidates_of(tier: Tier) -> EvictionCandidates | None:
    """``tier`` or the tier it wraps (wrappers all the way down) as one that names its victims."""
    seen: Tier | None = tier
    while seen is not None:
        if isinstance(seen, EvictionCandidates):
            return seen
        seen = getattr(seen, "inner", None)
    return None


def install_admission(pipeline: AdmissionHost, config: AdmissionConfig) -> Admission | None:
    """Put the configured policies at the pipeline's boundaries (before it opens, after every other
    wrapper: a deferred block then costs no encryption or compression). ``None``, and nothing
    installed, when every policy is ``always``."""
    settings = AdmissionSettings(config.admission_window_s, config.admission_window_keys)
    door = make_admission(config.admission_daemon, settings, "admission_daemon")
    below = pipeline.tiers[1:] if pipeline.leasing is not None else []
    setting = ["admission_shared" if t.shared else "admission_local" for t in below]
    policies = [make_admission(getattr(config, name), settings, name) for name in setting]  # one each
    if isinstance(door, AlwaysAdmit) and all(isinstance(p, AlwaysAdmit) for p in policies):
        return None
    leasing = pipeline.leasing
    max_pending = min(settings.window_keys, leasing.arena.npages) if leasing is not None else 1
    admission = Admission(pipeline, None if isinstance(door, AlwaysAdmit) else door, max_pending)
    for j, (tier, policy) in enumerate(zip(below, policies, strict=True)):
        boundary = AdmittingTier(tier, policy, admission, j)
        admission.boundaries.append(boundary)
        pipeline.tiers[j + 1] = boundary
    log.info(
        "admission: daemon %s; %s",
        config.admission_daemon,
        ", ".join(f"{b.name} {b.policy.name}" for b in admission.boundaries) or "no tier below the Cache",
    )
    return admission
