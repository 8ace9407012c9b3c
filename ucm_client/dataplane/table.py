"""Lookup from the daemon's presence table, mapped read-only: no round trip.

:meth:`TableView.lookup` answers only when the table can: it is live (not superseded, not closed),
within its lease (the daemon keeps pushing it on; a daemon that stopped stops doing so), the
namespace is tracked, every probe ended, and (for a daemon with tiers the table does not cover)
every key is present. Otherwise it says why not and the caller asks gRPC. The probes, the sequence
lock and the checks of the table's geometry are compiled (:mod:`ucm_protocol._native`).
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Sequence

from ucm_protocol import dataplane as dp
from ucm_protocol.keys import NAMESPACE_BYTES
from ucm_protocol.native import native


class Miss(enum.Enum):
    """Why the table did not answer."""

    STALE = "stale"
    """Superseded, closed or past its lease: fetch the current table, ask gRPC meanwhile."""
    UNTRACKED = "untracked"
    """The namespace is not in the table (yet): ask for it to be tracked, ask gRPC meanwhile."""
    UNKNOWN = "unknown"
    """This lookup cannot be answered here (a probe ran out, a key is malformed, a key is absent
    from a table that does not cover every tier): ask gRPC."""


class TableView:
    def __init__(self, table: mmap.mmap, generation: int) -> None:
        self.map = table
        self.generation = generation
        self._ns: dict[bytes, int] = {}

    @property
    def flags(self) -> int:
        assert native is not None
        return native.load_u32(self.map, dp.T_FLAGS)

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> tuple[int, bytearray] | Miss:
        """(hit prefix, one byte per key: 1 present, 0 absent), or why not."""
        assert native is not None
        if not isinstance(keys, (list, tuple)) or type(namespace) is not bytes:
            return Miss.UNKNOWN  # the checked path takes it from here
        if self.flags & dp.FLAG_LOOKUPS_BY_RPC:
            return Miss.UNKNOWN  # the daemon counts lookups (admission): it must see each one
        ns_id = self._ns.get(namespace)
        if ns_id is None:
            if len(namespace) != NAMESPACE_BYTES:
                return Miss.UNKNOWN  # the daemon names what is wrong with it
            found = native.table_find_ns(self.map, namespace)
            if found == -1 and self.flags & dp.FLAG_ALL_NAMESPACES:
                found = dp.NS_NONE  # nothing of it is stored (yet): every key absent, if the table is live
            elif found < 0:
                return Miss.UNTRACKED
            else:
                self._ns[namespace] = found
            ns_id = found
        out = bytearray(len(keys))
        code = native.table_lookup(self.map, ns_id, keys, out)
        if code >= 0:
            return code, out
        return Miss.STALE if code == -3 else Miss.UNKNOWN

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a lookup in another thread still reads it: dropped with the last one
            pass
