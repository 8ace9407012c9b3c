"""The Posix tier: one file per block under a sharded directory tree, durable and self-checking.

Layout: ``<root>/<namespace hex>/<k[0:2]>/<key hex>.blk`` where the root is chosen from several
``storage_backends`` by key, so blocks stripe across disks. Each file is a header of
:mod:`ucm_server.store.format` (version 3, :data:`~ucm_server.store.format.FLAT_LAYOUT_VERSION`)
followed by the payload. Releases before it wrote one directory level more,
``<namespace hex>/<k[0:2]>/<k[2:4]>/<key hex>.blk`` (format versions 1 and 2): 65,536 leaf
directories per namespace, so while a store was small nearly every new block paid a ``mkdir`` and a
directory open besides its own file (a 4 KiB dump ran at 0.4x a plain process writing into 256
directories). Those files keep loading: a read that finds no file at the new path tries the old one,
a delete removes both, the start-up scan adopts a file at the path its header's version names (and
quarantines one anywhere else). A release that reads only versions 1 and 2 skips version-3 files,
never quarantines them. DS3FS keeps the old layout (:attr:`PosixTier.flat_layout`): nodes of older
releases share its mount.

Writes use ``O_DIRECT`` when they can (``direct_io``, the default) and it pays: the block is at least
``direct_min_bytes`` (256 KiB; below that a synchronous device write per block costs more than the page-
cache copy it saves), its buffers are 4 KiB aligned (the Cache arena's pages and shared-memory regions
are), its length is a multiple of 4 KiB, and the filesystem accepts the flag. The header is then padded
to 4 KiB so the payload stays aligned. Skipping the page cache is the point: a buffered write of a 32
MiB block costs the kernel about 90 ms of CPU to copy it into the cache, a direct one under 3 ms, and on
a node where vLLM computes on the same cores that CPU is taken from inference. Anything else is written
buffered with the 128-byte header; readers take the payload offset from the header, so both kinds
coexist.

Durability: a block is written to a temporary file in its final directory, fsynced, renamed over the
final name and the directory fsynced, so after any crash a ``.blk`` file is either absent or complete;
leftover temporary files are removed at start-up. A batch (:meth:`PosixTier.write_many`) is written
in executor jobs of up to :data:`GROUP_BLOCKS` blocks reusing directory descriptors, and a durable one
is committed as a group where ``syncfs`` reports errors (Linux >= 5.8): all temporary files written,
one ``syncfs`` per root (their data is on disk), all renames, one more ``syncfs`` per root (the names
and any new directories are), then the blocks are acknowledged: two syncs per root per batch, and the
same guarantee (a visible block is complete; an acknowledged one survives). Elsewhere each file is
fsynced and each touched directory once per job. ``durable=False`` skips the fsyncs (faster, and a
power loss may then lose recent blocks, but still never exposes a torn one: the header's length and
checksum are verified on every read).

The index of what is stored lives in memory (:mod:`ucm_server.store.block_index`, under 256 B a
block), so a lookup never touches the disk. The daemon serves at once after a start: :meth:`open`
waits at most ``index_wait_s`` (a small store is then fully indexed before the first call)
for the index, then carries on in the background. After a clean
shutdown the index comes back from the snapshot it left (:mod:`ucm_server.store.index_snapshot`,
trusted only with its clean-shutdown marker); after a crash from the newest periodic snapshot
(``snapshot_interval_s``: :mod:`ucm_server.store.periodic_snapshots`), swept against the files as
every snapshot is; with neither the tier re-adopts its files by reading every header (not every
payload). Until that ends a Lookup may miss a block that is on disk; a Load
of it opens its file directly (header and checksum checked as always), and the tier's stats show
the progress (``index_adopting``, ``index_adopted``, ``index_files_read``).

A file whose header or size is wrong, or whose header claims a payload above ``max_block_bytes``,
is moved to ``<root>/.quarantine/`` and never served; so is one whose payload checksum fails on read.

With ``pack_max_block_bytes`` set, the small blocks of a batch are written many to a file instead
(:mod:`ucm_server.store.packs`: ``<root>/pack/<id[0:2]>/<id>.pack``, each block keeping its own
header inside); the index then points such a block at its pack. Block files and packs coexist.

Files on disk are data, not instructions (:mod:`ucm_server.store.confined`): below a root no symlink
is followed (a symlinked directory fails that block's write or read, nothing is written outside the
roots), only regular files are opened (a FIFO, socket, device or symlink where a block file should be
is skipped, logged once per kind and counted in the tier's ``skipped_files`` stats), and every
directory created on the way to a block file is fsynced into its parent before the block counts as
durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

from ucm_protocol.keys import NAMESPACE_BYTES, BlockKey, Digest, Namespace
from ucm_server.api.paths import make_private_dirs
from ucm_server.store import index_snapshot, packs
from ucm_server.store.base import (
    DEFAULT_CONTEXT,
    DEFAULT_MAX_BLOCK_BYTES,
    MISSING,
    OK,
    BlockInfo,
    BlockResult,
    IoVec,
    Tier,
    TierContext,
    TierStats,
    bounded_gather,
    failed,
    iov_len,
    load_tier_settings,
)
from ucm_server.store.block_index import BlockIndex, Stamp
from ucm_server.store.confined import (
    DirCache,
    NotRegularFile,
    file_kind,
    open_block,
    open_regular,
    open_regular_sized,
    parent_dir,
)
from ucm_server.store.format import (
    ALIGNED_HEADER_SIZE,
    FLAT_LAYOUT_VERSION,
    HEADER_SIZE,
    HEADER_SIZES,
    BlockHeader,
    CorruptBlock,
    UnsupportedFormat,
    decode_header,
    encode_header,
    fast_checksum,
    payload_checksum,
    verify_payload,
)
from ucm_server.store.packs import (
    PACK_SUFFIX,
    Pack,
    PackedStamp,
    PackTable,
    Retire,
    new_pack_id,
    pack_parts,
    pack_place,
    read_members,
    scan_pack,
    tombstone,
)
from ucm_server.store.periodic_snapshots import PeriodicSnapshots
from ucm_server.store.vector_io import preadv_all as _preadv_all
from ucm_server.store.vector_io import pwritev_all as _pwritev_all
from ucm_server.store.watch import IndexWatch

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")

SUFFIX = ".blk"
TMP_MARK = ".tmp."
QUARANTINE = ".quarantine"
DIRECT_ALIGN = 4096
"""Alignment of buffers, offsets and lengths for ``O_DIRECT`` (the common logical block size)."""


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
    more of them (:mod:`ucm_server.store.packs`: one file, one write and one rename per group of
    blocks); 0: one file per block, always."""


@dataclass(slots=True)
class Entry:
    """What the index holds about one stored block (file tiers built on this one share it)."""

    size: int
    stored_at: float


_Entry = Entry  # the name before #12; kept until 0.2


class PosixTier(Tier):
    kind = "Posix"
    persistent = True
    shared = False
    pin_gap: ClassVar[str] = ""
    flat_layout: ClassVar[bool] = True
    """Write new blocks at ``<ns>/<k[0:2]>/<key>.blk`` with format version 3 (reading the files of
    the older ``<ns>/<k[0:2]>/<k[2:4]>/`` layout too); False: the older layout only (a shared mount
    that nodes of older releases read)."""
    max_concurrency = 16
    client_reads: ClassVar[bool] = True
    """:meth:`read_checked` reads into client memory (subclasses with their own read path say no)."""

    def __init__(
        self,
        name: str = "Posix",
        *,
        roots: Sequence[Path],
        capacity: int = 0,
        durable: bool = True,
        direct_io: bool = True,
        index_wait_s: float = 0.2,
        direct_min_bytes: int = 256 << 10,
        snapshot_interval_s: float = 60.0,
        pack_max_block_bytes: int = 0,
        executor: Executor | None = None,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    ) -> None:
        """``max_block_bytes``: a stored header claiming a larger payload is corrupt (quarantined,
        never allocated for), whatever its CRC says."""
        super().__init__(name)
        if not roots:
            raise ValueError("PosixTier needs at least one root directory")
        if not snapshot_interval_s >= 0:
            raise ValueError(f"snapshot_interval_s: must be 0 (off) or more, got {snapshot_interval_s}")
        if not 0 <= pack_max_block_bytes <= GROUP_BYTES:
            raise ValueError(
                f"pack_max_block_bytes: must be 0 (off) to {GROUP_BYTES} bytes, got {pack_max_block_bytes}"
            )
        self.roots = [Path(r) for r in roots]
        self.pack_max_block_bytes = pack_max_block_bytes
        self._packs = PackTable()
        """Pack files holding live blocks (:mod:`ucm_server.store.packs`)."""
        self.capacity = capacity
        self.durable = durable
        self.direct_io = direct_io
        self.index_wait_s = index_wait_s
        self.direct_min_bytes = direct_min_bytes
        self._no_direct: set[Path] = set()
        """Roots whose filesystem refused ``O_DIRECT``: written buffered from then on."""
        self._executor = executor
        self._index = BlockIndex()
        self._sizes = self._index  # one structure answers both (a stamp is the block's size)
        self._stats = TierStats(name=name, kind=self.kind, capacity_bytes=capacity)
        self.max_block_bytes = max_block_bytes
        self._skipped: Counter[str] = Counter()
        """Non-regular files met where block files should be, by kind (fifo, symlink, ...)."""
        self._skip_examples: dict[str, str] = {}
        self._scanning = False
        self._adopter: asyncio.Task[None] | None = None
        self._adopting = False
        self._index_complete = False
        self._stop_adopt = False
        self._touched: set[bytes] = set()
        """Keys stored or deleted since start-up, while the index is adopted: what the files said
        before is older, so adoption leaves these keys as they are now."""
        self._adopted = 0
        self._files_read = 0
        self._from_snapshot = 0
        self._opened_at = 0.0
        self._phase = ""
        """What the background indexing does: snapshot, scan, verify (a snapshot's files), or nothing."""
        self._tmp_tag = uuid.uuid4().hex[:8]
        self._tmp_seq = itertools.count()
        self._unseen: set[bytes] | None = None
        """Keys a snapshot listed that the sweep after it has not found on disk yet: dropped when
        the sweep ends (their files were removed while the daemon was down)."""
        self.snapshots = PeriodicSnapshots(
            name, snapshot_interval_s, self._index, lambda: self._index_complete, self._write_periodic
        )

    Settings: ClassVar[type[Any] | None] = PosixSettings

    @classmethod
    def from_settings(
        cls, name: str, settings: Mapping[str, object], context: TierContext = DEFAULT_CONTEXT
    ) -> Self:
        """File work runs in ``context.executor``; headers above ``context.max_block_bytes`` are corrupt."""
        values = load_tier_settings(cls, name, settings)
        return cls(name, executor=context.executor, max_block_bytes=context.max_block_bytes, **values)

    # -- layout ---------------------------------------------------------------------------------------
    def root_of(self, key: BlockKey) -> Path:
        if len(self.roots) == 1:  # asked per block on the data path: no slicing when there is no choice
            return self.roots[0]
        pick = int.from_bytes(key[NAMESPACE_BYTES : NAMESPACE_BYTES + 4], "little")
        return self.roots[pick % len(self.roots)]

    def _place(self, key: BlockKey, *, flat: bool | None = None) -> tuple[Path, tuple[str, ...], str]:
        """Root, directories below it and file name of ``key``'s block, as strings: the one place
        the layout is spelled. ``flat``: the two-level layout of format version 3
        (``<ns>/<k[0:2]>/<key>.blk``) or, False, the one level deeper of versions 1 and 2
        (``<ns>/<k[0:2]>/<k[2:4]>/<key>.blk``); None: the layout this tier writes."""
        name, ns = block_name(key), key[:NAMESPACE_BYTES].hex()
        if self.flat_layout if flat is None else flat:
            return self.root_of(key), (ns, name[:2]), name
        return self.root_of(key), (ns, name[:2], name[2:4]), name

    def path_of(self, key: BlockKey) -> Path:
        """Where ``key``'s block is written (and read first)."""
        root, parts, name = self._place(key)
        return root.joinpath(*parts, name)

    def legacy_path_of(self, key: BlockKey) -> Path:
        """Where format versions 1 and 2 put ``key``'s block: one directory level deeper."""
        root, parts, name = self._place(key, flat=False)
        return root.joinpath(*parts, name)

    def file_paths_of(self, key: BlockKey) -> list[Path]:
        """Every block file ``key`` may have: its path, and with the flat layout the one an older
        release left one level deeper (a read would find that next, so removing a block removes both)."""
        path = self.path_of(key)
        return [path, self.legacy_path_of(key)] if self.flat_layout else [path]

    def _expected_path(self, header: BlockHeader) -> str:
        """Where a file with ``header`` must be found: the layout its format version names."""
        root, parts, name = self._place(header.key, flat=header.version >= FLAT_LAYOUT_VERSION)
        return "/".join((os.fspath(root).rstrip("/"), *parts, name))

    # -- primitives -----------------------------------------------------------------------------------
    index_snapshots: ClassVar[bool] = True
    """Whether :meth:`open` indexes in the background (serving at once) and a clean close leaves an
    index snapshot; a tier on a mount other nodes write (DS3FS) scans before serving instead."""

    async def open(self) -> None:
        if not self.index_snapshots:
            await self._open_by_scan()
            return
        self._opened_at = time.time()
        self._scanning = self._adopting = True
        self._phase = "snapshot"
        epochs = await self._run(self._take_markers)
        self._adopter = asyncio.create_task(self._adopt_all(epochs))
        self.snapshots.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._adopter), self.index_wait_s)

    @property
    def indexing(self) -> bool:
        return self._phase in ("snapshot", "scan")

    async def indexed(self) -> None:
        if self._adopter is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._adopter)

    async def close(self) -> None:
        """Stop any re-adoption; after a complete index, leave a snapshot the next start trusts."""
        if self._adopter is not None:
            self._stop_adopt = True
            with contextlib.suppress(Exception):
                await self._adopter
        await self.snapshots.stop()
        if not (self.index_snapshots and self._index_complete):
            return
        keys, stamps = self._index.columns()
        try:
            await self._run(self._write_snapshots, keys, stamps)
        except OSError as exc:  # disk full, ...: no marker was written, so the next start scans
            self._stats.errors += 1
            log.error(
                "posix tier %s: index snapshot not written (next start re-reads headers): %s",
                self.name,
                exc.strerror or exc,
            )

    async def _open_by_scan(self) -> None:
        started = time.monotonic()
        self._scanning = True
        try:
            found = await self._run(self._scan)
        finally:
            self._scanning = False
        self._report_skipped()
        found.sort(key=lambda item: item[1].stored_at)  # least recently stored first = LRU order
        for key, entry in found:
            self._remember(key, entry)
        log.info(
            "posix tier %s: %d blocks (%d bytes) indexed from %s in %.2fs",
            self.name,
            len(found),
            self._index.bytes,
            ", ".join(map(str, self.roots)),
            time.monotonic() - started,
        )

    async def _adopt_all(self, epochs: list[bytes | None]) -> None:
        """Index every root: first from the snapshots their clean-shutdown markers vouch for, then
        by reading the header of each file of a root without one; last, the roots that came from a
        snapshot are swept the same way (a file torn or removed while the daemon was down is then
        dropped or quarantined; one the snapshot lacks is added). Chunks merge on the event loop."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            loaded, loaded_bytes, unsure, found_packs = await self._run(self._load_snapshots, epochs)
            if loaded:
                self._unseen = set(loaded)
                self._adopted += self._index.install(loaded, loaded_bytes, self._touched)
                self._from_snapshot = len(loaded)
                self._register_loaded(found_packs)
            if not unsure:  # the index is what a snapshot on disk says: nothing new to write yet
                self.snapshots.written_at_changes(self._index.changes)
            if self._from_snapshot:
                log.info(
                    "posix tier %s: %d blocks indexed from snapshots in %.3fs",
                    self.name,
                    self._from_snapshot,
                    time.monotonic() - started,
                )
            self._phase = "scan"
            for root in unsure:
                await self._run(self._scan_root, root, loop)
            self._phase = "verify"
            self._index_complete = not self._stop_adopt
            if len(self._index) > SWEEP_AT_ONCE:  # let the daemon come up before the sweep competes
                await asyncio.sleep(self.index_wait_s + 1.0)
            for root in self.roots:
                if root not in unsure and not self._stop_adopt:
                    await self._run(self._scan_root, root, loop)
            if not self._stop_adopt:
                await self._drop_unseen()
        except OSError as exc:
            self._stats.errors += 1
            log.error("posix tier %s: indexing stopped: %s (blocks not indexed load by path)", self.name, exc)
        finally:
            self._unseen = None
            self._phase = ""
            self._adopting = self._scanning = False
            self._touched.clear()
            self._report_skipped()
        log.info(
            "posix tier %s: %d blocks (%d bytes) indexed from %s in %.2fs (%d from snapshots)",
            self.name,
            len(self._index),
            self._index.bytes,
            ", ".join(map(str, self.roots)),
            time.monotonic() - started,
            self._from_snapshot,
        )

    def _merge(self, chunk: list[_Found]) -> None:
        """Adopt found blocks (event loop): a key stored or deleted since start-up is left as it is;
        one the index holds with another size (a snapshot that is wrong) takes the file's."""
        touched, index, unseen = self._touched, self._index, self._unseen
        if unseen is not None:
            unseen.difference_update([item[0] for item in chunk if item[1] >= 0])
        for item in chunk:
            key, size, stored_at = item[0], item[1], item[2]
            if key in touched:
                continue
            if len(item) > 3:
                self._merge_packed(_block_key(key), size, stored_at, item[3], item[4])
            elif size < 0:  # a file found torn or unreadable by the sweep after a snapshot
                if not isinstance(index.get(key), PackedStamp):
                    self._unindex(key)
            elif index.adopt(_block_key(key), size, stored_at):
                self._adopted += 1
            elif index.get(key) != size and not isinstance(index.get(key), PackedStamp):
                index.correct(key, size, stored_at)  # (a packed block keeps its place in its pack)

    def _merge_packed(self, key: BlockKey, size: int, stored_at: float, found: Pack, offset: int) -> None:
        """Adopt a block found in a pack (event loop). The pack object is the table's when a snapshot
        already named that pack; a block the index holds elsewhere keeps that place."""
        pack = self._packs.packs.get(found.id, found)
        current = self._index.get(key)
        if isinstance(current, PackedStamp) and current.pack is pack:
            i = pack.keys.index(key)
            if pack.offsets[i] != offset or current != size:  # the snapshot was wrong: the file says
                pack.offsets[i] = offset
                self._index.put(key, pack.stamp(size, stored_at))
            return
        if current is not None:
            return
        pack.add(key, offset)
        self._packs.register(pack)
        self._index.adopt_stamp(key, pack.stamp(size, stored_at))
        self._adopted += 1

    async def _drop_unseen(self) -> None:
        """Forget the blocks a snapshot listed whose files the sweep did not find (removed while the
        daemon was down, or since the snapshot), unless stored or deleted since start-up."""
        unseen, self._unseen = self._unseen or set(), None
        gone = [key for key in unseen.difference(self._touched) if key in self._index]
        for start in range(0, len(gone), 8192):
            for key in gone[start : start + 8192]:
                if key not in self._touched:
                    self._unindex(key)
            await asyncio.sleep(0)
        if gone:
            log.info("posix tier %s: %d blocks a snapshot listed are gone from disk", self.name, len(gone))

    def _take_markers(self) -> list[bytes | None]:
        epochs: list[bytes | None] = []
        for root in self.roots:
            make_private_dirs(root)
            epochs.append(index_snapshot.take_marker(root))
        return epochs

    def _load_snapshots(
        self, epochs: list[bytes | None]
    ) -> tuple[OrderedDict[bytes, Stamp], int, list[Path], list[Pack]]:
        """Every root's snapshot its marker vouches for, as one ordered map (worker thread), the
        roots without a usable one (their headers are read), and the packs the snapshots name."""
        keys: list[bytes] = []
        stamps: list[Stamp] = []
        unsure: list[Path] = []
        found: list[Pack] = []
        total = 0
        for root, epoch in zip(self.roots, epochs, strict=True):
            blocks = self._load_root(root, epoch)
            if blocks is None:
                unsure.append(root)
                continue
            keys += blocks.keys
            mine = self._index.stamps_for(blocks.sizes, blocks.times)
            if blocks.packs is not None and blocks.offsets is not None and any(blocks.packs):
                found += self._packed_stamps(root, blocks, mine)
            stamps += mine
            total += sum(blocks.sizes)
        return BlockIndex.build(keys, stamps), total, unsure, found

    @staticmethod
    def _packed_stamps(root: Path, blocks: index_snapshot.Columns, stamps: list[Stamp]) -> list[Pack]:
        """Give the snapshot's packed blocks (``stamps``, in place) their packs' stamps; the packs."""
        assert blocks.packs is not None and blocks.offsets is not None
        found: dict[int, Pack] = {}
        for n, pack_id in enumerate(blocks.packs):
            if pack_id:
                pack = found.get(pack_id)
                if pack is None:
                    pack = found[pack_id] = Pack(pack_id, root)
                pack.add(blocks.keys[n], blocks.offsets[n])
                stamps[n] = pack.stamp(blocks.sizes[n], blocks.times[n])
        return list(found.values())

    def _register_loaded(self, found: list[Pack]) -> None:
        """Keep the packs a snapshot named with the blocks the index took from it (event loop): a
        key stored or deleted since start-up, or listed twice, is not live there."""
        for pack in found:
            live = 0
            for i, key in enumerate(pack.keys):
                stamp = self._index.get(key) if key is not None else None
                if isinstance(stamp, PackedStamp) and stamp.pack is pack and key not in pack.keys[:i]:
                    live += 1
                else:
                    pack.keys[i] = None
            pack.live = live
            if live:
                self._packs.register(pack)

    async def _write_periodic(self, keys: list[bytes], stamps: list[Stamp]) -> None:
        await self._run(lambda: self._write_snapshots(keys, stamps, periodic=True))

    def _load_root(self, root: Path, epoch: bytes | None) -> index_snapshot.Columns | None:
        """The snapshot of ``root`` to start from (worker thread): the clean one its marker vouches
        for (then made the newest periodic generation), else the newest periodic one (when periodic
        snapshots are on), else None (its headers are read)."""
        why = []
        try:
            if epoch is None:
                raise index_snapshot.SnapshotRejected("no clean-shutdown marker")
            blocks = index_snapshot.read_snapshot(root, epoch, self.max_block_bytes)
        except index_snapshot.SnapshotRejected as exc:
            why.append(str(exc))
        else:
            if self.snapshots.interval_s:
                try:
                    index_snapshot.promote_clean(root, epoch, durable=self.durable)
                except OSError as exc:  # the previous periodic generation stays the crash base
                    log.warning("posix tier %s: %s not kept as periodic: %s", self.name, root, exc)
            return blocks
        if self.snapshots.interval_s:
            try:
                blocks = index_snapshot.read_periodic(root, self.max_block_bytes)
            except index_snapshot.SnapshotRejected as exc:
                why.append(str(exc))
            else:
                log.info(
                    "posix tier %s: index of %s from its periodic snapshot, then swept (%s)",
                    self.name,
                    root,
                    why[0],
                )
                return blocks
        log.info("posix tier %s: index of %s from block headers (%s)", self.name, root, "; ".join(why))
        return None

    def _write_snapshots(self, keys: list[bytes], stamps: list[Stamp], *, periodic: bool = False) -> None:
        """Write the snapshot of every root (worker thread): the clean one at shutdown, or a new
        periodic generation."""
        write = index_snapshot.write_periodic if periodic else index_snapshot.write_snapshot
        by_root: dict[Path, tuple[list[bytes], list[Stamp]]] = {root: ([], []) for root in self.roots}
        if len(self.roots) == 1:
            by_root[self.roots[0]] = (keys, stamps)
        else:
            for key, stamp in zip(keys, stamps, strict=True):
                mine = by_root[self.root_of(_block_key(key))]
                mine[0].append(key)
                mine[1].append(stamp)
        locs = self._packs.locations() if self._packs.packs else {}
        for root, (mine_keys, mine_stamps) in by_root.items():
            write(root, _snapshot_columns(mine_keys, mine_stamps, locs), durable=self.durable)

    def _scan_root(self, root: Path, loop: asyncio.AbstractEventLoop) -> None:
        """Read every block file's header under ``root`` (worker thread), by directory descriptor:
        no symlink is followed, only regular files are read. Temporary files older than this
        start are interrupted writes and removed; newer ones are writes in flight. Found blocks go
        to :meth:`_merge` on the event loop, a chunk at a time."""
        top = os.fspath(root).rstrip("/")
        chunk: list[_Found] = []
        rfd = os.open(top or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._scan_dir(rfd, top, 0, loop, chunk)
        finally:
            os.close(rfd)
        if chunk:
            loop.call_soon_threadsafe(self._merge, chunk)

    def _scan_dir(
        self,
        dfd: int,
        path: str,
        depth: int,
        loop: asyncio.AbstractEventLoop,
        chunk: list[_Found],
    ) -> None:
        subdirs: list[str] = []
        with os.scandir(dfd) as entries:
            listed = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_dir in listed:
            if is_dir:
                if not (depth == 0 and name == QUARANTINE):
                    subdirs.append(name)
                continue
            if TMP_MARK in name:
                _drop_stale(dfd, name, self._opened_at)  # no write of this run began before open()
                continue
            if name.endswith(PACK_SUFFIX):
                self._files_read += 1
                chunk.extend(self._adopt_pack(dfd, f"{path}/{name}", name))
                continue
            if not name.endswith(SUFFIX):
                continue
            self._files_read += 1
            item = self._adopt_file(dfd, f"{path}/{name}", name)
            if item is not None:
                chunk.append(item)
                if len(chunk) >= 1024:
                    loop.call_soon_threadsafe(self._merge, chunk[:])
                    chunk.clear()
        for name in subdirs:
            if self._stop_adopt:
                return
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            except OSError as exc:  # gone, or replaced by a symlink meanwhile: not followed
                log.warning("posix tier %s: not scanning %s/%s: %s", self.name, path, name, exc)
                continue
            try:
                self._scan_dir(fd, f"{path}/{name}", depth + 1, loop, chunk)
            finally:
                os.close(fd)

    def _open_scanned(self, dirfd: int, path: str, fname: str) -> tuple[int, os.stat_result] | None:
        """Regular file ``fname`` of ``dirfd`` opened for the start-up scan, with its ``fstat``; None
        (counted, or logged) for a symlink, FIFO, device or a file that cannot be opened."""
        try:
            fd = os.open(fname, os.O_RDONLY | _SCAN_FLAGS, dir_fd=dirfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._skip(Path(path), "symlink")
            else:
                log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return None
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            self._skip(Path(path), file_kind(st.st_mode))
            return None
        return fd, st

    def _adopt_file(self, dirfd: int, path: str, fname: str) -> tuple[bytes, int, float] | None:
        """The block in regular file ``fname`` of ``dirfd`` if its header is whole, names the key
        that lives at ``path`` and promises the file's size; else quarantined or skipped."""
        opened = self._open_scanned(dirfd, path, fname)
        if opened is None:
            return None
        fd, st = opened
        try:
            header = decode_header(os.pread(fd, ALIGNED_HEADER_SIZE, 0), max_payload=self.max_block_bytes)
            if st.st_size != header.stored_len:
                raise CorruptBlock(f"file is {st.st_size} bytes, header promises {header.stored_len}")
            key = header.key
            if self._expected_path(header) != path:
                raise CorruptBlock(f"header names {key.hex()}, which does not live at this path")
        except UnsupportedFormat as exc:
            log.warning("posix tier %s: skipping %s: %s", self.name, path, exc)
            return self._unusable(path)
        except CorruptBlock as exc:
            self._move_to_quarantine(Path(path), str(exc))
            return self._unusable(path)
        except OSError as exc:
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return self._unusable(path)
        finally:
            os.close(fd)
        return key, header.payload_len, header.created_ns / 1e9

    def _adopt_pack(self, dirfd: int, path: str, fname: str) -> list[_Found]:
        """The blocks of pack file ``fname`` (a regular file at the path its header's id names)
        whose records are whole, inside the file and not overlapping (:func:`packs.scan_pack`); a
        pack whose own header is bad is quarantined whole. Payload checksums are checked at load."""
        opened = self._open_scanned(dirfd, path, fname)
        if opened is None:
            return []
        fd, st = opened
        try:
            found = scan_pack(fd, st.st_size, self.max_block_bytes)
            root, parts = self._split(Path(path))
            where, name = pack_place(found.pack_id)
            if parts != [*where, name]:
                raise CorruptBlock(f"pack header names pack {found.pack_id:016x}, which does not live here")
        except CorruptBlock as exc:
            self._move_to_quarantine(Path(path), str(exc))
            return []
        except OSError as exc:
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return []
        finally:
            os.close(fd)
        if found.refused:
            self._stats.extra["pack_refused"] = self._stats.extra.get("pack_refused", 0.0) + found.refused
            log.error(
                "posix tier %s: %d block(s) of pack %s not adopted (e.g. %s)",
                self.name,
                found.refused,
                path,
                found.reason,
            )
        pack = Pack(found.pack_id, root)
        stored_at = found.created_ns / 1e9
        return [(key, size, stored_at, pack, offset) for key, size, offset in found.blocks]

    def _unusable(self, path: str) -> tuple[bytes, int, float] | None:
        """A record telling :meth:`_merge` to drop the key whose file ``path`` would be (size -1)."""
        root, parts = self._split(Path(path))
        try:
            ns, digest = bytes.fromhex(parts[0]), bytes.fromhex(parts[-1].removesuffix(SUFFIX))
        except (ValueError, IndexError):
            return None
        if len(parts) not in (3, 4) or len(ns) != NAMESPACE_BYTES or len(digest) != 32:
            return None
        key = BlockKey(Namespace(ns), Digest(digest))
        if root != self.root_of(key) or Path(path) not in (self.path_of(key), self.legacy_path_of(key)):
            return None
        return key, -1, 0.0

    async def _entry(self, key: BlockKey) -> Stamp | None:
        """The index's entry for ``key``; while re-adopting, a key not indexed yet is looked for on
        disk (its header checked) and adopted, so a Load never waits for the scan."""
        entry = self._index.get(key)
        if entry is not None or not self._adopting or key in self._touched:
            return entry
        try:
            item = await self._run(self._probe_one, key)
        except OSError:
            return None
        if item is not None and key not in self._touched:
            self._index.adopt(key, item[1], item[2])
        return self._index.get(key)

    def _probe_one(self, key: BlockKey) -> tuple[bytes, int, float] | None:
        path = self.path_of(key)
        try:
            header = self._read_header(path, key)
        except (UnsupportedFormat, FileNotFoundError, NotRegularFile):
            return None
        except CorruptBlock as exc:
            self._quarantine_key(key, str(exc))
            return None
        return key, header.payload_len, header.created_ns / 1e9

    def watch_index(self, watch: IndexWatch) -> None:
        """KV events (:class:`~ucm_server.store.watch.Watchable`): the index sees every change."""
        self._index.watch = watch
        watch.stored_many(self._index.columns()[0])

    async def lookup(self, keys: Sequence[BlockKey]) -> list[int | None]:
        return self._sizes.lookup(keys)

    async def lookup_digests(self, namespace: Namespace, digests: Sequence[bytes]) -> list[int | None]:
        if self.shared:  # a subclass on a shared mount looks beyond its own index (see its lookup)
            return await super().lookup_digests(namespace, digests)
        return self._sizes.lookup_digests(namespace, digests)

    async def _sized_entry(self, key: BlockKey, dest: IoVec) -> Stamp | BlockResult:
        """The indexed entry of ``key`` when ``dest`` has its size; else the answer to give (missing,
        or a length mismatch)."""
        entry = await self._entry(key)
        if entry is None:
            self._stats.misses += 1
            return MISSING
        want = iov_len(dest)
        if want != entry.size:
            return failed(f"length mismatch: block is {entry.size} bytes, destination {want}")
        return entry

    async def read_into(self, key: BlockKey, dest: IoVec) -> BlockResult:
        result = await self._read_one(key, dest, checked=False)
        assert result is not None  # only a checked read answers "not matched"
        return result

    async def read_checked(self, key: BlockKey, dest: IoVec) -> BlockResult | None:
        if not self.client_reads:
            return None
        return await self._read_one(key, dest, checked=True)

    async def _read_one(self, key: BlockKey, dest: IoVec, *, checked: bool) -> BlockResult | None:
        """One block read from wherever its entry puts it (its file, or its pack's record);
        ``checked``: straight into ``dest`` and verified there (None when it did not match)."""
        entry = await self._sized_entry(key, dest)
        if isinstance(entry, BlockResult):
            return entry
        outcome: packs.Outcome
        if isinstance(entry, PackedStamp):
            (outcome,) = await self._read_packed([(key, dest, entry)], checked)
        else:
            try:
                if checked:
                    outcome = await self._run(self._read_file_checked, self.path_of(key), key, dest)
                else:
                    await self._run(self._read_file, self.path_of(key), key, dest)
                    outcome = True
            except (OSError, CorruptBlock) as exc:  # a corrupt header or length: read into daemon memory
                outcome = exc
        return await self._settle(key, dest, checked, entry, outcome)

    async def _settle(
        self, key: BlockKey, dest: IoVec, checked: bool, entry: Stamp, outcome: packs.Outcome
    ) -> BlockResult | None:
        """The answer for one block's read from where ``entry`` put it (:meth:`_read_result`). A
        failed read whose key was stored again or deleted while it ran is stale, not a fault: its
        old place may be gone (a block moved into or out of a pack, its pack record retired), so
        the block is read again from where it is now, and nothing is forgotten or quarantined."""
        if outcome is not True and outcome is not False:
            current = self._index.get(key)
            if current is not entry:
                if current is None:
                    self._stats.misses += 1
                    return MISSING
                return await (self.read_checked(key, dest) if checked else self.read_into(key, dest))
        return await self._read_result(key, outcome, entry.size, packed=isinstance(entry, PackedStamp))

    async def _read_result(
        self, key: BlockKey, outcome: _ReadOutcome, size: int, *, packed: bool = False
    ) -> BlockResult | None:
        """What one block's read means for the caller and the tier (one place for the single-block
        and the batched reads): True read (and verified), False read but not matching in the
        caller's memory (None: read it again through daemon memory), or the error it raised.
        A corrupt block in a pack (``packed``) is not moved (its pack holds others) but dies in the
        index and on disk (its header zeroed): never served again."""
        if outcome is True:
            self._index.move_to_end(key)
            self._stats.hits += 1
            self._stats.read_bytes += size
            return OK
        if outcome is False:
            return None
        if isinstance(outcome, FileNotFoundError):
            self._forget(key, tombstone=False)  # evicted or deleted under us
            self._stats.misses += 1
            return MISSING
        if isinstance(outcome, UnsupportedFormat):
            self._forget(key)  # not ours to read, nor to quarantine
            return failed(f"{self.name}: {outcome}")
        if isinstance(outcome, CorruptBlock):
            if packed:
                self._forget(key)
                await self._retire()
                self._stats.corrupt += 1
                log.error(
                    "posix tier %s: block %s in a pack is corrupt, dropped: %s", self.name, key.hex(), outcome
                )
            else:
                await self._quarantine(key, str(outcome))
            return failed(f"corrupt block in {self.name}: {outcome}")
        self._stats.errors += 1
        return failed(f"{self.name} read error: {outcome.strerror or outcome}")

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """:meth:`read_into` for a batch, in executor jobs of many blocks (see :meth:`_read_batch`)."""
        if len(items) < 2:
            return [await self.read_into(k, d) for k, d in items]
        return [r if r is not None else failed("not read") for r in await self._read_batch(items, False)]

    async def read_checked_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult | None]:
        """:meth:`read_checked` for a batch, in executor jobs of many blocks."""
        if not self.client_reads or type(self).read_checked is not PosixTier.read_checked:
            return await super().read_checked_many(items)
        if len(items) < 2:
            return [await self.read_checked(k, d) for k, d in items]
        return await self._read_batch(items, True)

    async def _read_batch(
        self, items: Sequence[tuple[BlockKey, IoVec]], checked: bool
    ) -> list[BlockResult | None]:
        """Read a batch with one executor job per group of blocks (:data:`READ_GROUP_BLOCKS`) and the
        roots' descriptors opened once per job: a small block's read costs its own opens and reads,
        not an executor hop and a root walk. Each block's outcome is mapped as the one-block
        methods map it (missing, corrupt and quarantined, read error; ``checked``: None when the
        bytes in the caller's memory did not match)."""
        results: list[BlockResult | None] = [MISSING] * len(items)
        todo: list[int] = []
        packed: list[tuple[int, PackedStamp]] = []
        sizes = [0] * len(items)
        entries: list[Stamp | None] = [None] * len(items)
        index = self._index
        for i, (key, dest) in enumerate(items):
            # While re-adopting, a key not indexed yet is probed on disk (see _entry), as one-block reads do.
            entry = index.get(key) if not self._adopting else await self._entry(key)
            if entry is None:
                self._stats.misses += 1
                continue
            want = dest[0].nbytes if len(dest) == 1 else iov_len(dest)
            if want != entry:  # a stamp is the block's size
                results[i] = failed(f"length mismatch: block is {entry.size} bytes, destination {want}")
                continue
            sizes[i] = want
            entries[i] = entry
            if isinstance(entry, PackedStamp):
                packed.append((i, entry))
            else:
                todo.append(i)
        if packed:
            await self._read_batch_packed(items, packed, sizes, results, checked)
        todo.sort(key=lambda i: items[i][0])  # by namespace and key: a job's blocks share few directories
        outcomes: list[_ReadOutcome] = await self._in_groups(
            self._read_group, [items[i] for i in todo], sizes, todo, checked, most=READ_GROUP_BLOCKS
        )
        hits = nbytes = 0
        for i, outcome in zip(todo, outcomes, strict=True):
            if outcome is True:  # the common case without a coroutine per block (_read_result's first case)
                index.move_to_end(items[i][0])
                hits += 1
                nbytes += sizes[i]
                results[i] = OK
            else:
                results[i] = await self._settle(items[i][0], items[i][1], checked, entries[i], outcome)  # type: ignore[arg-type]
        self._stats.hits += hits
        self._stats.read_bytes += nbytes
        return results

    async def _read_batch_packed(
        self,
        items: Sequence[tuple[BlockKey, IoVec]],
        packed: list[tuple[int, PackedStamp]],
        sizes: list[int],
        results: list[BlockResult | None],
        checked: bool,
    ) -> None:
        """The packed blocks of :meth:`_read_batch` (item index and entry), their results set."""
        outcomes = await self._read_packed(
            [(items[i][0], items[i][1], stamp) for i, stamp in packed], checked
        )
        index = self._index
        hits = nbytes = 0
        for (i, stamp), got in zip(packed, outcomes, strict=True):
            if got is True:
                index.move_to_end(items[i][0])
                hits += 1
                nbytes += sizes[i]
                results[i] = OK
            else:
                results[i] = await self._settle(items[i][0], items[i][1], checked, stamp, got)
        self._stats.hits += hits
        self._stats.read_bytes += nbytes

    async def _read_packed(
        self, reads: Sequence[tuple[BlockKey, IoVec, PackedStamp]], checked: bool
    ) -> list[packs.Outcome]:
        """Read blocks held in packs: per pack one open and one ``preadv`` per run of nearby records
        (:func:`~ucm_server.store.packs.read_members`), packs in executor jobs of up to
        :data:`READ_GROUP_BLOCKS` blocks. Outcomes in ``reads`` order."""
        out: list[packs.Outcome] = [FileNotFoundError(errno.ENOENT, "not in its pack")] * len(reads)
        wanted: dict[Pack, list[int]] = {}
        for n, (_, _, stamp) in enumerate(reads):
            wanted.setdefault(stamp.pack, []).append(n)
        by_pack: list[tuple[Pack, list[int], list[tuple[int, bytes, IoVec]]]] = []
        for pack, which in wanted.items():
            slot: tuple[Pack, list[int], list[tuple[int, bytes, IoVec]]] = (pack, [], [])
            for n, offset in zip(which, pack.offsets_of([reads[n][0] for n in which]), strict=True):
                if offset is not None:  # (None: deleted since it was looked up)
                    slot[1].append(n)
                    slot[2].append((offset, reads[n][0], reads[n][1]))
            if slot[1]:
                by_pack.append(slot)
        jobs: list[list[tuple[Pack, list[int], list[tuple[int, bytes, IoVec]]]]] = [[]]
        count = 0
        for slot in by_pack:
            if count >= READ_GROUP_BLOCKS:
                jobs.append([])
                count = 0
            jobs[-1].append(slot)
            count += len(slot[1])
        done = await bounded_gather(
            self.max_concurrency, [self._run(self._read_pack_job, job, checked) for job in jobs if job]
        )
        for job, outcomes in zip([job for job in jobs if job], done, strict=True):
            for (_, which, _), got in zip(job, outcomes, strict=True):
                for n, outcome in zip(which, got, strict=True):
                    out[n] = outcome
        return out

    def _read_pack_job(
        self, job: list[tuple[Pack, list[int], list[tuple[int, bytes, IoVec]]]], checked: bool
    ) -> list[list[packs.Outcome]]:
        out: list[list[packs.Outcome]] = []
        with DirCache() as dirs:
            for pack, _, members in job:
                parts, name = pack.place
                try:
                    fd, size = self._open_in(dirs, pack.root, parts, name)
                except NotRegularFile as exc:
                    self._skip(pack.root.joinpath(*parts, name), exc.kind)
                    out.append([exc] * len(members))
                    continue
                except OSError as exc:
                    out.append([exc] * len(members))
                    continue
                try:
                    out.append(read_members(fd, size, members, self.max_block_bytes, checked))
                finally:
                    os.close(fd)
        return out

    async def write_from(self, key: BlockKey, src: IoVec) -> BlockResult:
        size = iov_len(src)
        if self.capacity and size > self.capacity:
            return failed(f"block of {size} bytes exceeds {self.name} capacity {self.capacity}")
        if self.capacity and await self._make_room(size) < size:
            return failed(self._full(size))
        try:
            direct = await self._run(self._write_file, self.path_of(key), key, src)
        except OSError as exc:
            self._stats.errors += 1
            return failed(f"{self.name} write error: {exc.strerror or exc}")
        self._forget(key)
        self._remember(key, Entry(size=size, stored_at=time.time()))
        self._stats.write_bytes += size
        kind = "direct_writes" if direct else "buffered_writes"  # so an operator can see O_DIRECT at work
        self._stats.extra[kind] = self._stats.extra.get(kind, 0.0) + 1
        await self._retire()
        return OK

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Write a batch in a few executor jobs of many blocks each, with group commit.

        Per-block costs dominate small blocks, so a job writes :data:`GROUP_BLOCKS` blocks (up to
        :data:`GROUP_BYTES`) and reuses each directory's descriptor; jobs run ``max_concurrency`` at
        a time. Durable tiers commit as a group (:func:`syncfs` where the kernel reports its errors):
        every temporary file written, one ``syncfs`` per root so their data is on disk, then the
        renames, then one more ``syncfs`` per root for the directory entries, and only then is any
        block acknowledged: a batch costs two syncs per root, not two fsyncs per block, and a block
        visible after a crash is still always complete (its data was durable before its name was).
        """
        if len(items) < 2:
            return [await self.write_from(k, s) for k, s in items]
        results: list[BlockResult] = [OK] * len(items)
        sizes = [iov_len(src) for _, src in items]
        todo: list[int] = []
        for i, size in enumerate(sizes):
            if self.capacity and size > self.capacity:
                results[i] = failed(f"block of {size} bytes exceeds {self.name} capacity {self.capacity}")
            else:
                todo.append(i)
        if self.capacity and todo:
            room = await self._make_room(min(self.capacity, sum(sizes[i] for i in todo)))
            fits: list[int] = []
            for i in todo:
                if sizes[i] <= room:
                    room -= sizes[i]
                    fits.append(i)
                else:
                    results[i] = failed(self._full(sizes[i]))
            todo = fits
        group = self.durable and _SYNCFS is not None
        todo.sort(key=lambda i: items[i][0])  # by namespace and key: a job's blocks share few directories
        packed = self._packable(items, sizes, todo)
        in_packs = set(packed)
        files = [i for i in todo if i not in in_packs] if packed else todo
        file_outcomes, pack_outcomes = await asyncio.gather(
            self._in_groups(self._stage_group, [items[i] for i in files], sizes, files, group),
            self._in_groups(self._stage_packs, [items[i] for i in packed], sizes, packed, group),
        )
        by_item = dict(zip(files, file_outcomes, strict=True))
        by_item.update(zip(packed, pack_outcomes, strict=True))
        outcomes = [by_item[i] for i in todo]
        if group:
            staged = [(i, o) for i, o in zip(todo, outcomes, strict=True) if isinstance(o, _Staged)]
            outcomes = await self._commit_group(staged, outcomes, todo)
        stale: list[Path] = []
        now = time.time()
        for i, outcome in zip(todo, outcomes, strict=True):
            key = items[i][0]
            if isinstance(outcome, BaseException):
                self._stats.errors += 1
                text = outcome.strerror if isinstance(outcome, OSError) and outcome.strerror else outcome
                results[i] = failed(f"{self.name} write error: {text}")
                continue
            old = self._forget(key)
            if isinstance(outcome, _PackStaged):
                pack = self._packs.register(outcome.pack)
                self._index.put(key, pack.stamp(sizes[i], now))
                if self._adopting:
                    self._touched.add(key)
                if old is not None and not isinstance(old, PackedStamp):  # its block file is older now
                    stale += self.file_paths_of(key)
                kind = "packed_writes"
            else:
                self._remember(key, Entry(size=sizes[i], stored_at=now))
                kind = "direct_writes" if outcome.direct else "buffered_writes"
            self._stats.write_bytes += sizes[i]
            self._stats.extra[kind] = self._stats.extra.get(kind, 0.0) + 1
        if stale:
            await self._run(self._unlink_all, stale)
        await self._retire()
        return results

    def _packable(
        self, items: Sequence[tuple[BlockKey, IoVec]], sizes: list[int], todo: list[int]
    ) -> list[int]:
        """The blocks of a batch that go into packs: at most ``pack_max_block_bytes`` (not empty), a
        key only once in the batch, and at least two of them (else one file each, as always)."""
        limit = self.pack_max_block_bytes
        if not limit:
            return []
        small = [i for i in todo if 0 < sizes[i] <= limit]
        if len(small) < 2:
            return []
        counts = Counter(items[i][0] for i in small)
        chosen = [i for i in small if counts[items[i][0]] == 1]
        return chosen if len(chosen) >= 2 else []

    async def _in_groups(
        self,
        job: Callable[[list[tuple[BlockKey, IoVec]], bool], list[R]],
        items: list[tuple[BlockKey, IoVec]],
        sizes: list[int],
        which: list[int],
        flag: bool,
        *,
        most: int = 0,
    ) -> list[R]:
        """``job`` over ``items`` cut into groups of at most ``most`` (:data:`GROUP_BLOCKS`) blocks
        and :data:`GROUP_BYTES` bytes, ``max_concurrency`` groups at a time; outcomes in item order."""
        bounds: list[tuple[int, int]] = []
        start = total = 0
        most = most or GROUP_BLOCKS
        for n, i in enumerate(which):
            total += sizes[i]
            if n + 1 - start >= most or total >= GROUP_BYTES:
                bounds.append((start, n + 1))
                start, total = n + 1, 0
        if start < len(which):
            bounds.append((start, len(which)))
        done = await bounded_gather(
            self.max_concurrency, [self._run(job, items[a:b], flag) for a, b in bounds]
        )
        return [outcome for chunk in done for outcome in chunk]

    async def _commit_group(
        self, staged: list[tuple[int, _Staged]], outcomes: list[_Outcome], todo: list[int]
    ) -> list[_Outcome]:
        """Group commit of staged temporary files: sync their roots, rename, sync the roots again.
        A failed sync fails (and removes the temporary files of) every block of that root."""
        out: dict[int, _Outcome] = dict(zip(todo, outcomes, strict=True))
        roots = sorted({o.root for _, o in staged})
        broken = await self._run(self._sync_roots, roots)
        renames = [(i, o) for i, o in staged if o.root not in broken]
        for i, o in staged:
            if o.root in broken:
                out[i] = broken[o.root]
        if staged:
            await self._run(self._discard_temps, _distinct(o for _, o in staged if o.root in broken))
        if renames:
            files = _distinct(o for _, o in renames)  # a pack's blocks share one staged file
            done = dict(zip(map(id, files), await self._run(self._rename_staged, files), strict=True))
            for i, o in renames:
                out[i] = done[id(o)]
            renamed = sorted({o.root for i, o in renames if isinstance(out[i], _Staged)})
            for root, exc in (await self._run(self._sync_roots, renamed)).items():
                for i, o in renames:
                    if o.root == root:
                        out[i] = exc
        return [out[i] for i in todo]

    async def delete(self, keys: Sequence[BlockKey]) -> int:
        present = [k for k in keys if k in self._index]
        files = [k for k in present if not isinstance(self._forget(k), PackedStamp)]
        paths = [path for k in files for path in self.file_paths_of(k)]
        if paths:
            await self._run(self._unlink_all, paths)
        await self._retire()
        return len(present)

    async def list_blocks(self, namespace: Namespace | None = None) -> AsyncIterator[BlockInfo]:
        for key, entry in self._index.items():
            if namespace is None or key.namespace == namespace:
                yield BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)

    def stats(self) -> TierStats:
        s = self._stats
        s.blocks, s.bytes = len(self._index), self._index.bytes + self._packs.dead_bytes
        if self._packs.packs or self.pack_max_block_bytes:
            s.extra["pack_files"] = float(len(self._packs.packs))
            s.extra["pack_dead_bytes"] = float(self._packs.dead_bytes)
        for name in _INDEX_STATS:
            s.extra.pop(name, None)
        if self._phase:  # start-up progress, shown while it lasts: an operator sees re-adoption advance
            s.extra["index_adopting"] = float(self.indexing)
            s.extra["index_verifying"] = float(self._phase == "verify")
            s.extra["index_adopted"] = float(self._adopted)
            s.extra["index_files_read"] = float(self._files_read)
            s.extra["index_from_snapshot"] = float(self._from_snapshot)
        if self._skipped:
            s.extra["skipped_files"] = float(sum(self._skipped.values()))
        s.extra.update(self.snapshots.figures())
        return TierStats(**{f: getattr(s, f) for f in s.__slots__})

    def eviction_candidates(self) -> Iterator[bytes]:
        """Keys in the order :meth:`evict` would take them (an admission policy's victims)."""
        return (key for key, _ in self.eviction_order(self._index.oldest(), self._index.get))

    async def evict(self, nbytes: int) -> int:
        victims: list[BlockKey] = []
        freed = 0
        for key, entry in self.eviction_order(self._index.oldest(), self._index.get):
            if freed >= nbytes:
                break
            victims.append(_block_key(key))
            freed += entry.size
        self._stats.evictions += len(victims)
        await self.delete(victims)
        return freed

    async def info(self, key: BlockKey) -> BlockInfo | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        if isinstance(entry, PackedStamp):
            return BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)
        try:
            header = await self._run(self._read_header, self.path_of(key), key)
        except (OSError, CorruptBlock):
            return BlockInfo(key=key, size=entry.size, tier=self.name, stored_at=entry.stored_at)
        return BlockInfo(
            key=key,
            size=entry.size,
            tier=self.name,
            stored_at=header.created_ns / 1e9,
            checksum=header.checksum,
        )

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        entry = self._index.get(key)
        if entry is None:
            return MISSING
        scratch = [memoryview(bytearray(entry.size))]
        if isinstance(entry, PackedStamp):
            (packed,) = await self._read_packed([(key, scratch, entry)], False)
            if isinstance(packed, CorruptBlock) and not quarantine:
                self._stats.corrupt += 1
                return failed(f"corrupt block in {self.name}: {packed}")
            return await self._read_result(key, packed, entry.size, packed=True) or failed("not read")
        try:
            await self._run(self._read_file, self.path_of(key), key, scratch)
        except FileNotFoundError:
            self._forget(key)
            return MISSING
        except CorruptBlock as exc:
            if quarantine:
                await self._quarantine(key, str(exc))
            else:
                self._stats.corrupt += 1
            return failed(f"corrupt block in {self.name}: {exc}")
        except OSError as exc:
            return failed(f"{self.name} read error: {exc.strerror or exc}")
        return OK

    # -- blocking file I/O (runs in the executor) -----------------------------------------------------
    def _write_file(self, path: Path, key: BlockKey, src: IoVec) -> bool:
        """Write one block file durably; True if it went out with ``O_DIRECT``."""
        root = self.root_of(key)
        with self._parent(path, create=True) as dfd:
            tmp = f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
            direct = self._write_tmp(dfd, tmp, root, key, src, fsync=self.durable)
            try:
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                unlink_at(dfd, tmp)
                raise
            if self.durable:
                os.fsync(dfd)
        return direct

    def _write_tmp(self, dfd: int, tmp: str, root: Path, key: BlockKey, src: IoVec, *, fsync: bool) -> bool:
        """Create ``tmp`` in directory ``dfd`` and write the block (header and payload) into it,
        fsynced when ``fsync``; True if it went out with ``O_DIRECT``. On any error the file is
        removed again and the error raised, so no temporary file outlives a failed write."""
        size, checksum = iov_len(src), payload_checksum(src)
        fd, direct = self._create(dfd, tmp, root, want_direct=self._wants_direct(src, size))
        try:
            version = FLAT_LAYOUT_VERSION if self.flat_layout else None
            if direct:
                header = encode_header(key, size, checksum, header_len=ALIGNED_HEADER_SIZE, version=version)
                direct = _write_direct(fd, header, src)
            if not direct:
                _pwritev_all(fd, [memoryview(encode_header(key, size, checksum, version=version)), *src], 0)
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_at(dfd, tmp)
            raise
        os.close(fd)
        return direct

    def _wants_direct(self, src: IoVec, size: int) -> bool:
        return self.direct_io and size >= self.direct_min_bytes and _direct_ready(src)

    def _stage_group(self, items: list[tuple[BlockKey, IoVec]], group: bool) -> list[_Outcome]:
        """Write each block of ``items`` to a temporary file in its directory (descriptors reused
        across the group). With ``group`` (a group commit follows) the temporary files are left for
        :meth:`_rename_staged`; otherwise each is fsynced (durable tiers) and renamed at once, and
        each directory fsynced once at the end, so the fallback also costs one fsync per directory,
        not per block, beyond the files' own."""
        outcomes: list[_Outcome] = []
        touched: dict[int, list[int]] = {}
        with DirCache(create=True, sync_created=self.durable and not group) as dirs:
            for n, (key, src) in enumerate(items):
                try:
                    staged, dfd = self._stage_one(key, src, dirs, group)
                    outcomes.append(staged)
                    touched.setdefault(dfd, []).append(n)
                except OSError as exc:
                    outcomes.append(exc)
            if self.durable and not group:
                for dfd, which in touched.items():  # the renames above, durable before any ack
                    try:
                        os.fsync(dfd)
                    except OSError as exc:
                        for n in which:
                            outcomes[n] = exc
        return outcomes

    def _stage_one(self, key: BlockKey, src: IoVec, dirs: DirCache, group: bool) -> tuple[_Staged, int]:
        root, parts, name = self._place(key)
        dfd = dirs.get(root, parts)
        tmp = f"{name}{TMP_MARK}{self._tmp_tag}{next(self._tmp_seq):x}"  # unique: no urandom per block
        direct = self._write_tmp(dfd, tmp, root, key, src, fsync=self.durable and not group)
        if not group:
            try:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                unlink_at(dfd, tmp)
                raise
        return _Staged(root=root, parts=parts, tmp=tmp, name=name, direct=direct), dfd

    def _stage_packs(self, items: list[tuple[BlockKey, IoVec]], group: bool) -> list[_Outcome]:
        """Write the blocks of one job as one pack file per root (:mod:`ucm_server.store.packs`):
        one ``pwritev`` of every header and payload into a temporary file. With ``group`` it is left
        for the group commit; otherwise fsynced (durable tiers), renamed, and its directory fsynced."""
        by_root: dict[Path, list[int]] = {}
        for n, (key, _) in enumerate(items):
            by_root.setdefault(self.root_of(key), []).append(n)
        outcomes: list[_Outcome] = [OSError(errno.EIO, "not written")] * len(items)
        with DirCache(create=True, sync_created=self.durable and not group) as dirs:
            for root, which in by_root.items():
                try:
                    staged: _Outcome = self._stage_pack(dirs, root, [items[n] for n in which], group)
                except OSError as exc:
                    staged = exc
                for n in which:
                    outcomes[n] = staged
        return outcomes

    def _stage_pack(
        self, dirs: DirCache, root: Path, items: list[tuple[BlockKey, IoVec]], group: bool
    ) -> _PackStaged:
        pack = Pack(new_pack_id(), root)
        parts, name = pack.place
        dfd = dirs.get(root, parts)
        segments, offsets = pack_parts(pack.id, items)
        tmp = f"{name}{TMP_MARK}{self._tmp_tag}{next(self._tmp_seq):x}"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
        )
        try:
            try:
                _pwritev_all(fd, segments, 0)
                if self.durable and not group:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if not group:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                if self.durable:
                    os.fsync(dfd)
        except BaseException:
            unlink_at(dfd, tmp)
            raise
        for (key, _), offset in zip(items, offsets, strict=True):
            pack.add(key, offset)
        return _PackStaged(root=root, parts=parts, tmp=tmp, name=name, direct=False, pack=pack)

    def _sync_roots(self, roots: list[Path]) -> dict[Path, OSError]:
        """``syncfs`` of each root's filesystem; the roots that failed, with their error."""
        broken: dict[Path, OSError] = {}
        for root in roots:
            try:
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    syncfs(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                broken[root] = exc
        if roots:
            self._stats.extra["group_syncs"] = self._stats.extra.get("group_syncs", 0.0) + len(roots)
        return broken

    def _rename_staged(self, staged: list[_Staged]) -> list[_Outcome]:
        """Rename staged temporary files over their final names (each directory opened once)."""
        out: list[_Outcome] = []
        with DirCache() as dirs:
            for o in staged:
                try:
                    dfd = dirs.get(o.root, o.parts)
                    try:
                        os.replace(o.tmp, o.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    except BaseException:
                        unlink_at(dfd, o.tmp)
                        raise
                    out.append(o)
                except OSError as exc:
                    out.append(exc)
        return out

    def _discard_temps(self, staged: list[_Staged]) -> None:
        with DirCache() as dirs:
            for o in staged:
                with contextlib.suppress(OSError):
                    unlink_at(dirs.get(o.root, o.parts), o.tmp)

    def _create(self, dfd: int, tmp: str, root: Path, *, want_direct: bool) -> tuple[int, bool]:
        """A new temporary file in ``dfd``, opened ``O_DIRECT`` if wanted and the root's filesystem
        allows it (``O_EXCL`` with ``O_NOFOLLOW``: never through a planted symlink)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if want_direct and root not in self._no_direct:
            try:
                return os.open(tmp, flags | os.O_DIRECT, 0o600, dir_fd=dfd), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                unlink_at(dfd, tmp)  # some filesystems create the file before refusing the flag
                self._no_direct.add(root)
                log.info("posix tier %s: %s refuses O_DIRECT; writing buffered", self.name, root)
        return os.open(tmp, flags, 0o600, dir_fd=dfd), False

    # -- confined file access (see ucm_server.store.confined) -----------------------------------------
    def _root_for(self, path: Path) -> Path:
        return self._split(path)[0]

    def _split(self, path: Path) -> tuple[Path, list[str]]:
        """The root holding ``path`` and the components below it (string work: on the data path,
        pathlib's ``relative_to`` would cost more than the opens)."""
        text = os.fspath(path)
        for root in self.roots:
            prefix = os.fspath(root).rstrip("/") + "/"
            if text.startswith(prefix):
                return root, text[len(prefix) :].split("/")
        raise OSError(errno.EXDEV, "path is outside the tier's roots", text)

    @contextlib.contextmanager
    def _parent(self, path: Path, *, create: bool = False) -> Iterator[int]:
        """The directory holding ``path``, reached without following symlinks below its root; with
        ``create``, missing directories are made and (durable tiers) fsynced into their parents."""
        root, parts = self._split(path)
        with parent_dir(root, parts, create=create, sync_created=self.durable) as dfd:
            yield dfd

    def _open_block(self, path: Path, key: BlockKey | None = None) -> int:
        """``path`` opened read-only if it is a regular file reached without symlinks; anything else
        is counted and reported as skipped and raises :class:`NotRegularFile` (an ``OSError``).
        ``key``: the block ``path`` is the current-layout path of; when absent there, the older
        layout's file of it is opened (a tier that writes the older layout itself tries nothing)."""
        root, parts = self._split(path)
        try:
            try:
                return open_block(root, parts, os.O_RDONLY)
            except FileNotFoundError:
                if key is None or not self.flat_layout:
                    raise
            root, legacy, name = self._place(key, flat=False)  # an older release's block
            path = root.joinpath(*legacy, name)
            return open_block(root, [*legacy, name], os.O_RDONLY)
        except NotRegularFile as exc:
            self._skip(path, exc.kind)
            raise

    def _skip(self, path: Path, kind: str) -> None:
        """Count a non-regular file; warn once per kind (at start-up: once per kind, with a count)."""
        first = kind not in self._skipped
        self._skipped[kind] += 1
        self._skip_examples.setdefault(kind, str(path))
        if first and not self._scanning:
            log.warning(
                "posix tier %s: skipping %s: a %s, not a regular block file (counted in skipped_files; "
                "further ones are not logged)",
                self.name,
                path,
                kind,
            )

    def _report_skipped(self) -> None:
        for kind, count in sorted(self._skipped.items()):
            log.warning(
                "posix tier %s: skipped %d %s file(s) where block files should be (e.g. %s); "
                "only regular files are read",
                self.name,
                count,
                kind,
                self._skip_examples[kind],
            )

    def _unlink_all(self, paths: list[Path]) -> None:
        for p in paths:
            try:
                with self._parent(p) as dfd:
                    unlink_at(dfd, p.name)
            except FileNotFoundError:
                continue
            except OSError as exc:  # a symlinked directory: nothing outside the roots is touched
                log.warning("posix tier %s: not deleting %s: %s", self.name, p, exc)

    def _read_group(self, items: list[tuple[BlockKey, IoVec]], checked: bool) -> list[_ReadOutcome]:
        """Each block of a group read into the caller's memory: True (payload verified), or with
        ``checked`` whether the bytes there matched the header's checksum (see
        :meth:`_read_file_checked`), or the error it raised.

        One tight loop per group (issue #13: a 4 KiB read is about 6 µs of system calls, so every
        Python step per block shows): the shard directory's descriptor is found by the key's first
        bytes, the file is one ``openat(O_NOFOLLOW)`` + ``fstat`` + one ``preadv`` of header and
        payload + ``close``, the header is checked by :func:`fast_checksum` without building an
        object. Anything unusual (no file at the current layout's path, not a regular file, a
        header or size that fails a check) is read again by :meth:`_read_careful`, which knows the
        older layout and names what is wrong."""
        out: list[_ReadOutcome] = []
        shards: dict[bytes, int] = {}
        cut = NAMESPACE_BYTES + (4 if len(self.roots) > 1 else 1 if self.flat_layout else 2)
        heads = {HEADER_SIZE: bytearray(HEADER_SIZE), ALIGNED_HEADER_SIZE: bytearray(ALIGNED_HEADER_SIZE)}
        limit = self.max_block_bytes
        with DirCache() as dirs:
            for key, dest in items:
                outcome: _ReadOutcome | None = None
                if len(dest) == 1:
                    dfd = shards.get(key[:cut])
                    if dfd is None:
                        root, parts, _ = self._place(key)
                        with contextlib.suppress(OSError):  # a symlinked or missing directory: careful path
                            dfd = shards[key[:cut]] = dirs.get(root, parts)
                    if dfd is not None:
                        outcome = _read_fast(dfd, block_name(key), key, dest[0], heads, limit, checked)
                if outcome is None:
                    try:
                        outcome = self._read_careful(key, dest, dirs, checked)
                    except (OSError, CorruptBlock) as exc:
                        outcome = exc
                out.append(outcome)
        return out

    def _read_careful(self, key: BlockKey, dest: IoVec, dirs: DirCache, checked: bool) -> bool:
        """One block of :meth:`_read_group` step by step: the older layout tried, a non-regular
        file counted and refused, each failed check raised with its reason (``dest`` zeroed)."""
        fd, size = self._open_key(key, dirs)
        try:
            header = self._read_whole(fd, size, key, dest)
        finally:
            os.close(fd)
        if checked:
            return bool(payload_checksum(dest) == header.checksum)
        try:
            verify_payload(header, dest)
        except CorruptBlock:
            _zero(dest)
            raise
        return True

    def _read_whole(self, fd: int, size: int, key: BlockKey, dest: IoVec) -> BlockHeader:
        """Header and payload of an open block file of ``size`` bytes in one ``preadv`` when the
        size fits a header of either kind, else header first; the header is checked (key, CRC,
        ``max_block_bytes``, file size) before the caller trusts anything, and on any error
        ``dest`` is zeroed (none of the file's bytes stay where they were read)."""
        try:
            head_len = size - iov_len(dest)
            if head_len not in HEADER_SIZES:
                header = read_block_header(fd, expect=key, max_payload=self.max_block_bytes, size=size)
                _preadv_all(fd, dest, header.header_len)
                return header
            head = bytearray(head_len)
            iov = [memoryview(head), *dest]
            if os.preadv(fd, iov, 0) != size:  # one call reads it all, unless the file is shorter
                _preadv_all(fd, iov, 0)
            header = decode_header(memoryview(head), expect=key, max_payload=self.max_block_bytes)
            if header.stored_len != size:
                raise CorruptBlock(f"file is {size} bytes, header promises {header.stored_len}")
            return header
        except BaseException:
            _zero(dest)
            raise

    def _open_key(self, key: BlockKey, dirs: DirCache) -> tuple[int, int]:
        """``key``'s block file opened read-only (confined, regular files only, as
        :meth:`_open_block`), with its size. Its directory comes from ``dirs``, opened one component
        at a time without following symlinks and kept for the batch, so the file itself is one
        ``openat`` of its name with ``O_NOFOLLOW``: on a 4 KiB read a whole-path ``openat2`` through
        ctypes cost more than the read."""
        root, parts, name = self._place(key)
        try:
            try:
                return self._open_in(dirs, root, parts, name)
            except FileNotFoundError:
                if not self.flat_layout:
                    raise
            root, parts, name = self._place(key, flat=False)  # an older release's block
            return self._open_in(dirs, root, parts, name)
        except NotRegularFile as exc:
            self._skip(root.joinpath(*parts, name), exc.kind)
            raise

    @staticmethod
    def _open_in(dirs: DirCache, root: Path, parts: tuple[str, ...], name: str) -> tuple[int, int]:
        try:
            dfd = dirs.get(root, parts)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlinked directory on the way: never followed
                raise NotRegularFile(str(root.joinpath(*parts)), "symlink") from None
            raise
        try:
            return open_regular_sized(name, os.O_RDONLY, dir_fd=dfd)
        except NotRegularFile as exc:  # the whole path in messages, built only when needed
            raise NotRegularFile(str(root.joinpath(*parts, name)), exc.kind) from None

    def _read_file(self, path: Path, key: BlockKey, dest: IoVec) -> None:
        fd = self._open_block(path, key)
        try:
            header = read_block_header(fd, expect=key, max_payload=self.max_block_bytes)
            _preadv_all(fd, dest, header.header_len)
        finally:
            os.close(fd)
        try:
            verify_payload(header, dest)
        except CorruptBlock:
            _zero(dest)  # the block failed: leave no trace of its bytes in the reader's memory
            raise

    def _read_file_checked(self, path: Path, key: BlockKey, dest: IoVec) -> bool:
        """Read a block into client memory; whether the bytes there match the header's checksum.
        On an error ``dest`` is zeroed (the block fails: none of its bytes stay there); on a
        mismatch the caller reads the block again and overwrites or zeroes ``dest``."""
        fd = self._open_block(path, key)
        try:
            header = read_block_header(fd, expect=key, max_payload=self.max_block_bytes)
            try:
                _preadv_all(fd, dest, header.header_len)
                return bool(payload_checksum(dest) == header.checksum)
            except BaseException:
                _zero(dest)
                raise
        finally:
            os.close(fd)

    def _read_header(self, path: Path, key: BlockKey | None = None) -> BlockHeader:
        fd = self._open_block(path, key)
        try:
            return read_block_header(fd, expect=key, max_payload=self.max_block_bytes)
        finally:
            os.close(fd)

    def _scan(self) -> list[tuple[BlockKey, Entry]]:
        found: list[tuple[BlockKey, Entry]] = []
        for root in self.roots:
            make_private_dirs(root)
            for dirpath, dirnames, filenames in os.walk(root):
                if Path(dirpath) == root and QUARANTINE in dirnames:
                    dirnames.remove(QUARANTINE)
                for fname in filenames:
                    path = Path(dirpath) / fname
                    if TMP_MARK in fname:
                        path.unlink(missing_ok=True)  # an interrupted write: never visible, now gone
                        continue
                    if not fname.endswith(SUFFIX):
                        continue
                    item = self._check_file(path)
                    if item is not None:
                        found.append(item)
        return found

    def _check_file(self, path: Path) -> tuple[BlockKey, Entry] | None:
        try:
            header = self._read_header(path)
            if self._expected_path(header) != os.fspath(path):
                raise CorruptBlock(f"header names {header.key.hex()}, which does not live at this path")
        except UnsupportedFormat as exc:
            log.warning("posix tier %s: skipping %s: %s", self.name, path, exc)
            return None
        except CorruptBlock as exc:
            self._move_to_quarantine(path, str(exc))
            return None
        except NotRegularFile:
            return None  # counted and reported by _open_block
        except OSError as exc:
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return None
        return header.key, Entry(size=header.payload_len, stored_at=header.created_ns / 1e9)

    def _move_to_quarantine(self, path: Path, reason: str) -> bool:
        """Move a bad block file into ``<root>/.quarantine`` by directory descriptors: neither the
        file's directories nor the quarantine directory is followed if it is a symlink. False when
        there was no file at ``path``."""
        root = self._root_for(path)
        target = f"{path.name}.{uuid.uuid4().hex[:8]}"
        try:
            with self._parent(path) as src, self._parent(root / QUARANTINE / target, create=True) as qdir:
                os.replace(path.name, target, src_dir_fd=src, dst_dir_fd=qdir)
                if self.durable:
                    os.fsync(qdir)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._stats.errors += 1
            log.error("posix tier %s: cannot quarantine %s (%s): %s", self.name, path, reason, exc)
            return True
        self._stats.corrupt += 1
        target = str(root / QUARANTINE / target)
        log.error("posix tier %s: quarantined %s -> %s: %s", self.name, path, target, reason)
        return True

    def _quarantine_key(self, key: BlockKey, reason: str) -> None:
        """Quarantine ``key``'s file: the one at its path, else one the older layout left."""
        if not self._move_to_quarantine(self.path_of(key), reason) and self.flat_layout:
            self._move_to_quarantine(self.legacy_path_of(key), reason)

    # -- helpers --------------------------------------------------------------------------------------
    async def _quarantine(self, key: BlockKey, reason: str) -> None:
        self._forget(key)
        await self._run(self._quarantine_key, key, reason)

    def _remember(self, key: BlockKey, entry: Entry) -> None:
        self._index.add(key, entry.size, entry.stored_at)
        if self._adopting:
            self._touched.add(key)

    def _forget(self, key: BlockKey, *, tombstone: bool = True) -> Stamp | None:
        """Drop ``key`` from the index; a packed block dies in its pack (its header zeroed on disk at
        the next :meth:`_retire` unless not ``tombstone``). The entry it had, if any."""
        stamp = self._unindex(key, tombstone=tombstone)
        if self._adopting:
            self._touched.add(key)
        return stamp

    def _unindex(self, key: bytes, *, tombstone: bool = False) -> Stamp | None:
        stamp = self._index.pop(key)
        if isinstance(stamp, PackedStamp):
            self._packs.kill(stamp, key, tombstone=tombstone)
        return stamp

    async def _retire(self) -> None:
        """Do the disk work removals of packed blocks left: tombstones, and unlinks of emptied packs."""
        if self._packs.pending:
            await self._run(self._apply_retired, self._packs.take())

    def _apply_retired(self, work: list[Retire]) -> None:
        by_pack: dict[int, list[Retire]] = {}
        for item in work:
            by_pack.setdefault(id(item.pack), []).append(item)
        with DirCache() as dirs:
            for group in by_pack.values():
                pack = group[0].pack
                parts, name = pack.place
                try:
                    dfd = dirs.get(pack.root, parts)
                    if any(item.offset is None for item in group):
                        unlink_at(dfd, name)
                        continue
                    fd, _ = open_regular_sized(name, os.O_RDWR, dir_fd=dfd)
                    try:
                        for item in group:
                            assert item.offset is not None
                            tombstone(fd, item.offset, item.key)
                    finally:
                        os.close(fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # a symlink or FIFO planted there: nothing is followed
                    log.warning("posix tier %s: pack %016x not updated: %s", self.name, pack.id, exc)

    async def _make_room(self, size: int) -> int:
        """Evict so ``size`` more bytes fit; returns how many of them do: all of them unless the
        retention rules keep what would have to go (pinned blocks are never evicted). The capacity
        stays soft under concurrent writers, as before: only pins make a write fail for room."""
        over = self._index.bytes + self._packs.dead_bytes + size - self.capacity
        if over <= 0:
            return size
        freed = await self.evict(over)
        return size if freed >= over else max(0, size - (over - freed))

    def _full(self, size: int) -> str:
        return (
            f"{self.name} is full: {size} bytes needed, "
            f"{max(0, self.capacity - self._index.bytes - self._packs.dead_bytes)} free "
            f"of {self.capacity} and the rest is pinned"
        )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


def read_block_header(
    fd: int, expect: BlockKey | None = None, max_payload: int | None = None, size: int | None = None
) -> BlockHeader:
    """The checked header of an open block file: valid, padding zero, file size as it promises, and
    (``max_payload``) a payload no larger than the daemon accepts. ``size``: the file's size from an
    ``fstat`` the caller just made on ``fd`` (saves asking again)."""
    raw = os.pread(fd, ALIGNED_HEADER_SIZE, 0)
    header = decode_header(
        raw, expect=expect, max_payload=max_payload
    )  # checks the padding read; a file too short to
    if size is None:  # hold the rest fails the size check
        size = os.fstat(fd).st_size
    if size != header.stored_len:
        raise CorruptBlock(f"file is {size} bytes, header promises {header.stored_len}")
    return header


def block_file_header(
    path: Path, expect: BlockKey | None = None, max_payload: int | None = None
) -> BlockHeader:
    """:func:`read_block_header` of the regular file at ``path`` (a symlink or FIFO there raises
    :class:`~ucm_server.store.confined.NotRegularFile`)."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_regular(path.name, os.O_RDONLY, dir_fd=dfd, shown=str(path))
    finally:
        os.close(dfd)
    try:
        return read_block_header(fd, expect=expect, max_payload=max_payload)
    finally:
        os.close(fd)


def _address(view: memoryview) -> int | None:
    """Where a writable buffer starts in memory; None for one ctypes cannot see (read-only)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _direct_ready(src: IoVec) -> bool:
    """Whether every segment starts and ends on a :data:`DIRECT_ALIGN` boundary (``O_DIRECT``)."""
    if not src:
        return False
    for view in src:
        if view.nbytes == 0 or view.nbytes % DIRECT_ALIGN or not view.c_contiguous:
            return False
        address = _address(view)
        if address is None or address % DIRECT_ALIGN:
            return False
    return True


def _write_direct(fd: int, header: bytes, src: IoVec) -> bool:
    """Write the padded header and payload with ``O_DIRECT``; False (nothing kept) if refused.

    The header goes through an anonymous mapping, page aligned like ``O_DIRECT`` wants. A device
    with a logical block larger than 4 KiB refuses the write (``EINVAL``): the file is emptied and
    ``O_DIRECT`` turned off for it, and the caller writes it buffered.
    """
    page = mmap.mmap(-1, len(header))
    try:
        page[:] = header
        with memoryview(page) as head:
            _pwritev_all(fd, [head, *src], 0)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        os.ftruncate(fd, 0)
        return False
    finally:
        page.close()


SWEEP_AT_ONCE = 20_000
"""A snapshot of more blocks is swept a second after serving began, not during start-up."""
_SCAN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""Opening for a header read: no symlink, and a FIFO does not block (it is then skipped)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_INDEX_STATS = (
    "index_adopting",
    "index_verifying",
    "index_adopted",
    "index_files_read",
    "index_from_snapshot",
)
GROUP_BLOCKS = 64
"""Most blocks one executor job of :meth:`PosixTier.write_many` writes."""
GROUP_BYTES = 8 << 20
"""A job ends at the block that brings it to this many bytes (big blocks: one or two per job)."""
READ_GROUP_BLOCKS = 256
"""Most blocks one executor job of a batched read reads (a whole chunk of small blocks, see
:data:`ucm_server.chunks.CHUNK_BLOCKS`). Measured on 2 cores with 4,096 blocks of 4 KiB: one job
per 256 blocks 6.9 µs a block, jobs of 64 running 16 at a time 16.5 µs: the Python between a
block's system calls needs the GIL, so small blocks read in parallel threads mostly wait for it
(large ones still read in parallel: a job ends at :data:`GROUP_BYTES`)."""


@dataclass(slots=True)
class _Staged:
    """A block written to a temporary file in its directory, waiting for (or past) its rename."""

    root: Path
    parts: tuple[str, ...]
    tmp: str
    name: str
    direct: bool


@dataclass(slots=True)
class _PackStaged(_Staged):
    """A pack file staged like a block file; every block in it has this one as its outcome."""

    pack: Pack


def _distinct(staged: Iterator[_Staged]) -> list[_Staged]:
    """Each staged file once, in order (a pack's blocks share one)."""
    return list({id(o): o for o in staged}.values())


_Outcome = _Staged | OSError
_Found = tuple[bytes, int, float] | tuple[bytes, int, float, Pack, int]
"""A block the start-up scan found: key, size, store time, and for a packed one its pack and offset."""
_ReadOutcome = bool | OSError | CorruptBlock
"""A batched read's result per block: read (checked: whether the bytes matched), or its error."""


def _find_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs`` where the kernel reports writeback errors through it (Linux >= 5.8;
    before that it returned 0 even when data was lost, so per-file fsync is used instead)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
        if os.uname().sysname != "Linux" or (major, minor) < (5, 8):
            return None
        call: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError, ValueError):
        return None
    return call


_SYNCFS = _find_syncfs()


def syncfs(fd: int) -> None:
    """Flush the whole filesystem holding ``fd`` (data and metadata); raises ``OSError``."""
    assert _SYNCFS is not None
    if _SYNCFS(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""A block file opened for reading: never through a symlink, and a FIFO does not block."""


def block_name(key: bytes) -> str:
    """The file name of ``key``'s block in its directory, in every layout: the digest in hex."""
    return f"{key[NAMESPACE_BYTES:].hex()}{SUFFIX}"


def _read_fast(
    dfd: int, name: str, key: bytes, view: memoryview, heads: dict[int, bytearray], limit: int, checked: bool
) -> _ReadOutcome | None:
    """Read block ``name`` of directory ``dfd`` into ``view`` when nothing is unusual: a regular
    file whose size is one of the header sizes plus ``view``'s length, whose header passes every
    check (:func:`fast_checksum`, ``limit``: ``max_block_bytes``); None otherwise (the caller then
    reads it the careful way, which zeroes ``view`` or overwrites it). The outcome as
    :meth:`PosixTier._read_group` reports it; a payload that fails its checksum is zeroed first."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        head = heads.get(st.st_size - view.nbytes)
        if head is None or not stat.S_ISREG(st.st_mode) or os.preadv(fd, (head, view), 0) != st.st_size:
            return None
    except OSError:  # an I/O error: the careful path meets it again and reports it for this block
        return None
    finally:
        os.close(fd)
    want = fast_checksum(head, key, view.nbytes, limit)
    if want is None:
        return None
    matched = payload_checksum((view,)) == want
    if checked or matched:
        return matched
    _zero((view,))  # daemon memory: the block fails, none of its bytes stay
    return CorruptBlock("payload checksum mismatch")


def _snapshot_columns(
    keys: list[bytes], stamps: list[Stamp], locs: dict[bytes, tuple[int, int]]
) -> index_snapshot.Columns:
    """A root's snapshot columns; with packs (``locs``: key -> pack id, offset) the packed blocks'
    places too, a packed block that died while the snapshot was taken left out."""
    if not locs:
        return index_snapshot.Columns(keys, stamps, [s.stored_at for s in stamps])
    kept_keys: list[bytes] = []
    kept: list[Stamp] = []
    ids: list[int] = []
    offsets: list[int] = []
    for key, stamp in zip(keys, stamps, strict=True):
        if isinstance(stamp, PackedStamp):
            loc = locs.get(key)
            if loc is None:
                continue
            ids.append(loc[0])
            offsets.append(loc[1])
        else:
            ids.append(0)
            offsets.append(0)
        kept_keys.append(key)
        kept.append(stamp)
    return index_snapshot.Columns(kept_keys, kept, [s.stored_at for s in kept], ids, offsets)


def _zero(dest: IoVec) -> None:
    for seg in dest:
        seg[:] = bytes(seg.nbytes)


def _block_key(key: bytes) -> BlockKey:
    return key if isinstance(key, BlockKey) else BlockKey(key[:NAMESPACE_BYTES], key[NAMESPACE_BYTES:])


def _drop_stale(dirfd: int, name: str, cutoff: float) -> None:
    """Remove the temporary file ``name`` if it was last written before ``cutoff`` (an interrupted
    write of an earlier run); a newer one belongs to a write in flight."""
    try:
        if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mtime < cutoff:
            os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass


def unlink_at(dfd: int, name: str) -> None:
    """Remove ``name`` in directory ``dfd`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)


_unlink_at = unlink_at  # the name before #12; kept until 0.2
