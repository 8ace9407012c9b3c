"""The presence tables, kept equal to what the tiers' indexes hold, one table per tenant.

A local Lookup is answered from a table instead of a round trip, so a table must say exactly what
the ``Lookup`` RPC would say, and only to whom the RPC would say it:

- **Exact.** Each tier whose index can be watched (:class:`~ucm_server.store.watch.Watchable`,
  natively: not an :class:`~ucm_server.store.observed.ObservedTier`, not shared) reports every change
  of its index here, and a key's slot holds one bit per tier that holds it, so a block evicted from
  the Cache but still on disk stays present. A pipeline with any other tier (shared, wrapped by
  encryption or compression, third-party) makes the table *incomplete*: readers then answer only
  when every key is present and ask gRPC otherwise.
- **Expiry.** The RPC deletes blocks whose TTL has passed before it answers. A table is trusted only
  until ``valid_until``, which the daemon pushes :data:`LEASE_S` ahead every :data:`REFRESH_S` as
  long as no retention rule will expire within the lease; when one will, readers ask gRPC (which
  sweeps it) until it is gone. A daemon that stops (or whose loop stalls) stops pushing, and its
  readers stop trusting the table within a lease.
- **Private.** Tenants' namespaces are private digests (:meth:`ucm_server.auth.Principal.scope`);
  a table holds only namespaces its tenant's sessions asked for (:meth:`Presence.track`), each listed
  under the name the client uses, routed by its scoped digest. Only that tenant's sessions get it.
  Without tenants there is one table and every namespace is in it as soon as a block is stored.

Tables are built when the first local client opens its channel (a daemon nobody reaches through
the data plane pays nothing), from the tiers' current contents, then kept up to date.

**Filling in the background.** A tier that reports many keys at once (its index installed from a
snapshot at start-up, or what it holds when the first channel opens) would hold the event loop for
a fifth of a second per million keys while they go into the tables. They go in
:data:`FILL_SLICE` at a time instead, one slice per pass of the loop (:class:`_Fill`), while the
tier already answers the RPC from its index. Until every fill has ended no table is trusted (its
lease is withheld, as while a tier re-adopts its files): a reader asks gRPC, so no key yet to be
filled reads as missing. A key the tier stores meanwhile goes in at once as usual; one it drops
meanwhile is cleared as usual and the fill leaves it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import cast

from ucm_protocol import dataplane as dp
from ucm_protocol.keys import NAMESPACE_BYTES, Namespace
from ucm_protocol.native import native
from ucm_server.dataplane.table import MAX_LOAD, PresenceTable, slots_for
from ucm_server.retention import RetentionTable
from ucm_server.store.base import Tier
from ucm_server.store.observed import ObservedTier
from ucm_server.store.pipeline import Pipeline
from ucm_server.store.watch import Watchable, add_watch, remove_watch
from ucm_server.store.wrapper import TierWrapper

log = logging.getLogger(__name__)

LEASE_S = 0.1
"""How long a table is trusted past its last refresh."""
REFRESH_S = 0.03
"""How often the daemon pushes the lease on (well inside it)."""
GROWTH = 1.4
"""A table that fills with entries is rebuilt for this many times them (about twice its slots)."""
FILL_SLICE = 16384
"""Keys a background fill puts in the tables per pass of the event loop (about 3 ms); a tier's
report of no more than this many goes in at once."""


def exact_tiers(pipeline: Pipeline) -> tuple[list[Tier], bool]:
    """The tiers whose own index reports every change, and whether that is every tier."""
    exact = [t for t in pipeline.tiers if isinstance(t, Watchable) and _indexed(t) and not t.shared]
    return list[Tier](exact), len(exact) == len(pipeline.tiers)


def _indexed(tier: Tier) -> bool:
    """The tier under its wrappers (tracing, admission, encryption...) keeps an index of its own: a
    wrapper that observes calls (:class:`ObservedTier`, which admission puts around a tier without
    one) knows nothing of what the tier held before."""
    while isinstance(tier, TierWrapper) and not isinstance(tier, ObservedTier):
        tier = tier.inner
    return isinstance(tier, Watchable) and not isinstance(tier, ObservedTier)


class _TierWatch:
    """One tier's :class:`~ucm_server.store.watch.IndexWatch`: its changes into every table.

    A new key costs one compiled call per table. A removal waits for the end of the event loop's
    current pass, with the others of that pass: a block replaced in place (the Cache drops the old
    version, then publishes the new one) then costs no table write at all, and removals go in one
    compiled call. Until then the key reads as present, as it would a moment earlier: the same race
    as an eviction right after a lookup, which the Load reports. Anything out of the ordinary (a
    namespace not listed yet, a table to rebuild) takes the general path."""

    __slots__ = ("bit", "due", "fills", "pending", "presence")

    def __init__(self, presence: Presence, bit: int) -> None:
        self.presence = presence
        self.bit = bit
        self.pending: set[bytes] = set()
        """Keys this tier dropped in this loop pass, not yet cleared in the tables."""
        self.due = False
        """A flush is scheduled for the end of this loop pass."""
        self.fills: set[_Fill] = set()
        """This tier's reports of many keys, going into the tables in the background."""

    def stored(self, key: bytes) -> None:
        if self.fills:  # stored again since a report: a fill that has not reached it sets it after all
            for fill in self.fills:
                fill.removed.discard(key)
        pending = self.pending
        if pending and key in pending:
            pending.discard(key)  # dropped and stored again: the tables already say so
            return
        assert native is not None
        presence = self.presence
        for table in list(presence.tables.values()):
            code = native.table_set(table.map, key, table.ns_ids, self.bit, True)
            if code == 2:  # done, and the table is crowded
                presence.rebuild(table)
            elif code == -1 or (code == -2 and not presence.tenants):
                presence.apply_to(table, [key], self.bit, True)  # a rebuild, or a namespace to list first

    def removed(self, key: bytes) -> None:
        self.removed_many((key,))

    def removed_many(self, keys: Sequence[bytes]) -> None:
        """Keys the tier dropped (one, or a batch of replaced blocks whose ``stored_many`` follows in
        this pass): cleared in the tables at the end of the loop pass (:meth:`flush`)."""
        for fill in self.fills:
            fill.removed.update(map(bytes, keys))
        if self.presence.scanning:
            self.presence.note_removed(keys, self.bit)
        if not self.due:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a tier used outside the daemon): at once
                self.presence.apply([bytes(k) for k in keys], self.bit, False)
                return
            self.due = True
        self.pending.update(map(bytes, keys))

    def flush(self) -> None:
        self.due = False
        if self.pending:
            keys, self.pending = list(self.pending), set()
            self.presence.apply(keys, self.bit, False)

    def stored_many(self, keys: Iterable[bytes]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        for fill in self.fills:  # as :meth:`stored`: a fill that has not reached them sets them after all
            fill.removed.difference_update(keys)
        pending = self.pending
        if pending:  # as :meth:`stored`: a key dropped and stored again in this pass is left as it is
            again = pending.intersection(keys)
            if again:
                pending.difference_update(again)
                keys = [k for k in keys if k not in again]
        if len(keys) > FILL_SLICE:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop (a tier used outside the daemon): at once
                pass
            else:
                self.fills.add(_Fill(self, keys))
                return
        self.presence.apply(keys, self.bit, True)

    def cleared(self) -> None:
        for fill in list(self.fills):
            fill.cancel()
        self.pending.clear()
        self.presence.clear(self.bit)


class _Fill:
    """One tier's report of many keys going into every table, :data:`FILL_SLICE` per pass of the
    event loop; the tables' lease is withheld until it ends (:meth:`Presence._lease_end`). The
    keys are the caller's list, read and never changed (the index's own order list, no copy)."""

    def __init__(self, watch: _TierWatch, keys: list[bytes]) -> None:
        self.watch = watch
        self.keys = keys
        self.removed: set[bytes] = set()
        """Keys the tier dropped since the report: left out (a later store sets them itself)."""
        self.started = time.monotonic()
        presence = watch.presence
        presence.fills.add(self)
        presence.refresh()  # readers stop trusting the tables now, not at the next tick
        presence.make_room(len(keys))
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        watch, presence, keys = self.watch, self.watch.presence, self.keys
        try:
            for start in range(0, len(keys), FILL_SLICE):
                await asyncio.sleep(0)  # the loop serves between slices
                part = keys[start : start + FILL_SLICE]
                if self.removed:
                    part = [key for key in part if key not in self.removed]
                presence.apply(part, watch.bit, True)
            log.info(
                "data plane: presence tables filled with %d keys in %.3fs",
                len(keys),
                time.monotonic() - self.started,
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # the tables keep no lease while a fill is unfinished: mark them incomplete
            log.exception("data plane: filling the presence tables failed; lookups use gRPC")
            for table in presence.tables.values():
                table.set_flags(table.flags & ~dp.FLAG_COMPLETE)
        finally:
            self._end()

    def cancel(self) -> None:
        self.task.cancel()
        self._end()

    def _end(self) -> None:
        presence = self.watch.presence
        if self in presence.fills:
            self.watch.fills.discard(self)
            presence.fills.discard(self)
            if not presence.fills:
                presence.refresh()  # the lease back now, not at the next tick


class Presence:
    """Every tenant's table, the tier watches that feed them, and their lease."""

    def __init__(
        self, pipeline: Pipeline, retention: RetentionTable, *, tenants: bool, max_keys: int
    ) -> None:
        self.pipeline = pipeline
        self.retention = retention
        self.tenants = tenants
        self.max_keys = max_keys
        """Tables per tenant, namespaces tracked on request; else one table of every namespace."""
        self.tables: dict[str, PresenceTable] = {}
        self._watches: list[tuple[Tier, _TierWatch]] = []
        self._scans: set[asyncio.Task[None]] = set()
        self._removed_during_scan: dict[bytes, set[tuple[bytes, int]]] = {}
        """Stored namespace being scanned -> (key, bit) removed meanwhile (not to be put back)."""
        self.fills: set[_Fill] = set()
        """Tiers' reports going into the tables in the background: no lease until they end."""
        exact, self.complete = exact_tiers(pipeline)
        self._exact = exact
        if len(exact) > dp.MAX_TIERS:
            self._exact, self.complete = exact[: dp.MAX_TIERS], False
        self.flags = (dp.FLAG_COMPLETE if self.complete else 0) | (0 if tenants else dp.FLAG_ALL_NAMESPACES)
        if pipeline.admission is not None:  # it counts lookups as uses: they must reach the pipeline
            self.flags |= dp.FLAG_LOOKUPS_BY_RPC

    # -- tables -------------------------------------------------------------------------------------------
    def table(self, tenant: str) -> PresenceTable:
        """The tenant's table, made (and filled from the tiers) the first time it is asked for."""
        table = self.tables.get(tenant)
        if table is None:
            table = PresenceTable(slots_for(0), flags=self.flags, max_keys=self.max_keys, tenant=tenant)
            self.tables[tenant] = table
            self._refresh(table)
            if not self._watches:
                self._attach()  # what the tiers hold may need a larger table: it replaces this one
            table = self.tables[tenant]
        return table

    def _attach(self) -> None:
        """Watch every exact tier: each reports what it holds now, then every change."""
        for i, tier in enumerate(self._exact):
            watch = _TierWatch(self, 1 << i)
            self._watches.append((tier, watch))
            add_watch(cast(Watchable, tier), watch)

    @property
    def scanning(self) -> bool:
        return bool(self._removed_during_scan)

    def note_removed(self, keys: Sequence[bytes], bit: int) -> None:
        """Keys a tier dropped while their namespace is being filled in (the fill must not put them back)."""
        for key in keys:
            scan = self._removed_during_scan.get(key[:NAMESPACE_BYTES])
            if scan is not None:
                scan.add((bytes(key), bit))

    def apply(self, keys: list[bytes], bit: int, on: bool) -> None:
        """One tier's statement about ``keys`` into every table that routes their namespaces."""
        if not keys:
            return
        if not on and self.scanning:
            self.note_removed(keys, bit)
        for table in list(self.tables.values()):
            self.apply_to(table, keys, bit, on)

    def apply_to(self, table: PresenceTable, keys: list[bytes], bit: int, on: bool) -> None:
        if on and len(keys) > 1 and table.used + len(keys) > MAX_LOAD * table.nslots:
            table = self.rebuild(table, table.live + len(keys))  # a whole index at once: one rebuild
        start = 0
        while start < len(keys):
            part = keys if start == 0 else keys[start:]
            done, unknown, crowded = table.apply(part, bit, on)
            if unknown and on and not self.tenants:  # every namespace, as soon as it holds a block
                added = [ns for ns in unknown if table.add_namespace(ns, ns, dp.DIR_TRACKED) is not None]
                if len(added) < len(unknown) and table.flags & dp.FLAG_ALL_NAMESPACES:
                    log.warning("data plane: the presence table's directory is full; new namespaces use gRPC")
                    table.set_flags(table.flags & ~dp.FLAG_ALL_NAMESPACES)
                if added:
                    done, _, crowded = table.apply(
                        part, bit, on
                    )  # again, routed now (statements are idempotent)
            start += done
            if start < len(keys) or crowded:
                table = self.rebuild(table)

    def rebuild(self, table: PresenceTable, entries: int = 0) -> PresenceTable:
        """A larger (or just fresh) table in place of ``table``, which is marked superseded: room for
        ``entries``, or for what it holds with room to grow (a table crowded by deleted slots rather
        than by entries comes back its size)."""
        live = table.live
        grow = GROWTH if live > table.nslots // 2 else 1.0
        new = table.rebuilt(slots_for(max(entries, int(live * grow) + 1)))
        self.tables[table.tenant] = new
        self._refresh(new)
        table.close()
        log.debug(
            "data plane: presence table of %r rebuilt: %d slots, %d entries", new.tenant, new.nslots, new.live
        )
        return new

    def make_room(self, entries: int) -> None:
        """Rebuild, once, each table too small for ``entries`` more (before a fill adds them a slice
        at a time, which would otherwise rebuild it again and again)."""
        for table in list(self.tables.values()):
            if table.used + entries > MAX_LOAD * table.nslots:
                self.rebuild(table, table.live + entries)

    def clear(self, bit: int) -> None:
        for table in self.tables.values():
            table.clear_bit(bit)

    # -- namespaces of tenants ----------------------------------------------------------------------
    def track(self, tenant: str, named: bytes, stored: bytes) -> None:
        """Put ``named`` (``stored`` in the tiers) in the tenant's table: listed at once as being
        filled, then filled from every exact tier, then marked tracked (readers use it from then on)."""
        table = self.table(tenant)
        if stored in table.ns_ids:
            return
        ns_id = table.add_namespace(stored, named, dp.DIR_POPULATING)
        if ns_id is None:
            return  # the directory is full: this namespace stays on gRPC
        task = asyncio.get_running_loop().create_task(self._scan(tenant, stored, ns_id))
        self._scans.add(task)
        task.add_done_callback(self._scans.discard)

    async def _scan(self, tenant: str, stored: bytes, ns_id: int) -> None:
        """Fill one namespace from the tiers. Changes that arrive meanwhile go straight in (the route
        exists); a key the scan listed but a tier dropped meanwhile is not put back."""
        removed = self._removed_during_scan.setdefault(stored, set())
        try:
            found: list[tuple[list[bytes], int]] = []
            for tier, watch in self._watches:
                keys = [bytes(info.key) async for info in tier.list_blocks(Namespace(stored))]
                found.append((keys, watch.bit))
            for keys, bit in found:
                keep = [k for k in keys if (k, bit) not in removed]
                if tenant in self.tables:
                    self.apply_to(self.tables[tenant], keep, bit, True)
            table = self.tables.get(tenant)
            if table is not None and stored in table.ns_ids:
                table.set_namespace_state(table.ns_ids[stored], dp.DIR_TRACKED)
        except Exception:
            log.exception("data plane: filling a namespace of tenant %r failed; it stays on gRPC", tenant)
        finally:
            self._removed_during_scan.pop(stored, None)

    # -- the lease ------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Push every table's validity on, unless a retention rule expires within the lease."""
        until = self._lease_end()
        for table in self.tables.values():
            table.valid_until(until)

    def _refresh(self, table: PresenceTable) -> None:
        table.valid_until(self._lease_end())

    def _lease_end(self) -> int:
        """Until when readers may trust the tables (monotonic ns); 0: they ask gRPC meanwhile."""
        assert native is not None
        if self.retention.due(time.time() + LEASE_S):
            return 0  # gRPC deletes what expired, until it is gone
        if self.fills:
            return 0  # a tier's keys still going in: a key not there yet is not missing
        if any(tier.indexing for tier in self._exact):
            # A tier still re-adopting its files after a start (no snapshot it could trust) holds
            # blocks its index has not reached: gRPC's lookup looks on disk for them.
            return 0
        return native.monotonic_ns() + int(LEASE_S * 1e9)

    async def close(self) -> None:
        for fill in list(self.fills):
            fill.cancel()
        for task in list(self._scans):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for tier, watch in self._watches:
            remove_watch(cast(Watchable, tier), watch)
        self._watches.clear()
        for table in self.tables.values():
            table.retire(dp.TABLE_CLOSED)
            table.close()
        self.tables.clear()
