"""One presence table: a memfd the daemon writes and its local clients map read-only.

Layout in :mod:`ucm_protocol.dataplane`; the per-slot sequence lock and the probes are compiled
(:mod:`ucm_protocol._native`). The daemon is the only writer, on its event-loop thread.

What keeps a client from writing here: the memfd is sealed against writes
(:func:`~ucm_server.dataplane.memory.sealed_memfd`) and the descriptor handed out is a read-only
reopening.

A table never changes size: when it fills (or deleted slots make probes long, or an insert finds no
slot within :data:`~ucm_protocol.dataplane.MAX_PROBE`), :meth:`PresenceTable.rebuilt` makes a new
one with the same directory, and this one is marked superseded: a client reading it falls back to
gRPC and fetches the new one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

from ucm_protocol import dataplane as dp
from ucm_protocol.native import native
from ucm_server.dataplane.memory import sealed_memfd

NS_CAPACITY = 4096
MIN_SLOTS = 1 << 14
MAX_LOAD = 0.75
"""Slots in use (entries and deleted ones) past which the table is rebuilt (the helper's test)."""
TARGET_LOAD = 0.55
"""How full a rebuilt table starts: 40-byte slots, so 55-75 % full is 53-73 bytes per key."""


def _sizes(nslots: int, ns_capacity: int) -> tuple[int, int, int]:
    dir_at = dp.TABLE_HEADER_BYTES
    slots_at = dp.page_align(dir_at + ns_capacity * dp.DIR_ENTRY_BYTES)
    return dir_at, slots_at, dp.page_align(slots_at + nslots * dp.SLOT_BYTES)


def slots_for(entries: int) -> int:
    """The slot count that holds ``entries`` at :data:`TARGET_LOAD`."""
    return max(MIN_SLOTS, int(entries / TARGET_LOAD) + 1)


class PresenceTable:
    """A table's memory and directory; :meth:`apply` and friends change its slots."""

    def __init__(
        self, nslots: int, *, flags: int, max_keys: int, tenant: str = "", ns_capacity: int = NS_CAPACITY
    ) -> None:
        assert native is not None, "the presence table needs the compiled helper"
        if nslots <= 0:
            raise ValueError(f"nslots must be positive, got {nslots}")
        self.nslots = nslots
        self.ns_capacity = ns_capacity
        self.generation = secrets.randbits(63) or 1
        self.tenant = tenant
        """Whose table it is ("": the default tenant); only that tenant's sessions get it."""
        dir_at, slots_at, size = _sizes(nslots, ns_capacity)
        self.size = size
        self._dir_at = dir_at

        def header(m: mmap.mmap) -> None:
            dp.TABLE_HEADER.pack_into(
                m, 0, dp.TABLE_MAGIC, 1, dp.TABLE_HEADER_BYTES, self.generation, secrets.randbits(64),
                nslots, slots_at, ns_capacity, 0, dp.TABLE_LIVE, flags, 0, 0, 0, dir_at, max_keys,
            )  # fmt: skip

        self.fd, self.map = sealed_memfd("ucmd-presence", size, header, read_only=True)
        self.max_keys = max_keys
        self.ns_ids: dict[bytes, int] = {}
        """Stored namespace (as the tiers index it) -> directory id: what :meth:`apply` routes by."""
        self.names: list[tuple[bytes, bytes, int]] = []
        """Directory entries by id: (stored namespace, namespace as the client names it, state)."""

    # -- the header ---------------------------------------------------------------------------------
    @property
    def flags(self) -> int:
        assert native is not None
        return native.load_u32(self.map, dp.T_FLAGS)

    def set_flags(self, flags: int) -> None:
        assert native is not None
        native.store_u32(self.map, dp.T_FLAGS, flags)

    def valid_until(self, monotonic_ns: int) -> None:
        """Readers trust the table until then (CLOCK_MONOTONIC); the daemon keeps pushing it on."""
        assert native is not None
        native.store_u64(self.map, dp.T_VALID_UNTIL, monotonic_ns)

    def retire(self, state: int) -> None:
        """Superseded or closed: readers stop trusting it at once."""
        assert native is not None
        native.store_u64(self.map, dp.T_VALID_UNTIL, 0)
        native.store_u32(self.map, dp.T_STATE, state)

    @property
    def live(self) -> int:
        assert native is not None
        return native.load_u64(self.map, dp.T_LIVE)

    @property
    def used(self) -> int:
        assert native is not None
        return native.load_u64(self.map, dp.T_USED)

    # -- the directory --------------------------------------------------------------------------------
    def add_namespace(self, stored: bytes, named: bytes, state: int) -> int | None:
        """A directory entry for ``stored`` (named ``named`` by clients); None when the directory is full."""
        assert native is not None
        found = self.ns_ids.get(stored)
        if found is not None:
            return found
        ns_id = len(self.names)
        if ns_id >= self.ns_capacity:
            return None
        at = self._dir_at + ns_id * dp.DIR_ENTRY_BYTES
        dp.DIR_ENTRY.pack_into(self.map, at, named, 0)
        native.store_u32(self.map, at + 16, state)  # after the name: a reader never sees a half entry
        native.store_u32(self.map, dp.T_NS_COUNT, ns_id + 1)
        self.names.append((stored, named, state))
        self.ns_ids[stored] = ns_id
        return ns_id

    def set_namespace_state(self, ns_id: int, state: int) -> None:
        assert native is not None
        stored, named, _ = self.names[ns_id]
        self.names[ns_id] = (stored, named, state)
        native.store_u32(self.map, self._dir_at + ns_id * dp.DIR_ENTRY_BYTES + 16, state)

    # -- slots ------------------------------------------------------------------------------------------
    def apply(self, keys: list[bytes], bit: int, on: bool) -> tuple[int, set[bytes], bool]:
        """Set or clear tier ``bit`` for each 48-byte key whose namespace is in the directory: how many
        keys were done (fewer than all: no slot within reach, rebuild), the unknown namespaces, and
        whether the table is crowded (rebuild soon)."""
        assert native is not None
        return native.table_apply(self.map, keys, self.ns_ids, bit, on)

    def clear_bit(self, bit: int) -> int:
        assert native is not None
        return native.table_clear_bit(self.map, bit)

    def rebuilt(self, nslots: int) -> PresenceTable:
        """A new table with this one's directory and entries (in ``nslots`` slots, a fresh seed), and
        this one superseded. Grows the new one until every entry fits."""
        assert native is not None
        while True:
            new = PresenceTable(
                nslots,
                flags=self.flags,
                max_keys=self.max_keys,
                tenant=self.tenant,
                ns_capacity=self.ns_capacity,
            )
            for stored, named, state in self.names:
                new.add_namespace(stored, named, state)
            if native.table_copy(self.map, new.map) >= 0:
                break
            new.close()
            nslots *= 2
        self.retire(dp.TABLE_SUPERSEDED)
        return new

    def reader_fd(self) -> int:
        """A read-only descriptor of the table, for a client (the caller closes it once sent)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
