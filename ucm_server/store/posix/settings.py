"""What configures a Posix tier: its settings, the profile of a tier built on it, an index entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class PosixSettings:
    """The Posix tier's settings; the daemon fills them from ``storage_backends`` (or
    ``<data_dir>/blocks``), ``posix_capacity``, ``durable`` and ``posix_direct_io``."""

    roots: tuple[Path, ...]
    """Root directories; blocks are striped over them by key."""
    capacity: int = field(default=0, metadata={"size": True})
    """Bytes the tier may hold before it evicts (0: no limit)."""
    durable: bool = True
    """fsync file and directory before a block becomes visible."""
    direct_io: bool = True
    """Write with ``O_DIRECT`` where buffers and filesystem allow it."""
    index_wait_s: float = 0.2
    """Seconds :meth:`PosixTier.open` waits for the index before serving with what it has."""
    direct_min_bytes: int = field(default=256 << 10, metadata={"size": True})
    """Smallest block written with ``O_DIRECT``: below it a synchronous device write per block costs
    more than the page-cache copy it saves (4 KiB: 275 µs direct, under 20 µs buffered)."""
    snapshot_interval_s: float = 60.0
    """Seconds between periodic index snapshots (written only if the index changed); 0: at
    shutdown only."""
    pack_max_block_bytes: int = field(default=0, metadata={"size": True})
    """Blocks of at most this many bytes are written into pack files when a dump batch has two or
    more of them (:mod:`ucm_server.store.posix.packs`: one file, one write and one rename per group
    of blocks); 0: one file per block, always."""


@dataclass(slots=True)
class Entry:
    """What the index holds about one stored block (file tiers built on this one share it)."""

    size: int
    stored_at: float


@dataclass(frozen=True, slots=True)
class Profile:
    """What a file tier built on the Posix tier changes about it, stated in one place."""

    flat_layout: bool = True
    """Write new blocks at ``<ns>/<k[0:2]>/<key>.blk`` with format version 3 (reading the files of
    the older layout too); False: the older layout only (a shared mount that nodes of older
    releases read)."""
    client_reads: bool = True
    """Loads read straight into client memory (:meth:`PosixTier.read_checked`); False: a tier with a
    read path of its own reads into daemon memory."""
    index_snapshots: bool = True
    """Index in the background after a start (serving at once) and leave an index snapshot at a
    clean close; False: scan every header before serving (a mount other nodes write)."""
    temp_grace_s: float = 0.0
    """Without snapshots, temporary files younger than this are another node's writes in flight and
    stay at the start-up scan (0: every one is an interrupted write of ours and goes)."""
    timeout_s: float | None = None
    """Bound on one executor job (a hung mount becomes a per-block ``TimeoutError``); None: none."""


DEFAULT_PROFILE = Profile()
"""The Posix tier's own profile: the flat layout, client reads, snapshots, no timeout."""
