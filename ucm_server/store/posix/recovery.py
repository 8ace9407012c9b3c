"""How a Posix tier learns what it holds after a start: index snapshots, then the files themselves.

The index of what is stored lives in memory (:mod:`ucm_server.store.posix.block_index`, under 256 B a
block), so a lookup never touches the disk. The daemon serves at once after a start: the tier's
``open`` waits at most ``index_wait_s`` (a small store is then fully indexed before the first call)
for the index, then carries on in the background. After a clean shutdown the index comes back from
the snapshot it left (:mod:`ucm_server.store.posix.index_snapshot`, trusted only with its
clean-shutdown marker); after a crash from the newest periodic snapshot (``snapshot_interval_s``:
:mod:`ucm_server.store.posix.periodic_snapshots`), swept against the files as every snapshot is; with
neither the tier re-adopts its files by reading every header (not every payload). Until that ends a
block not indexed yet is looked for on disk when asked for (the tier's Lookups and Loads), and the tier's
stats show the progress (``index_adopting``, ``index_adopted``, ``index_files_read``).

A file whose header or size is wrong, or whose header claims a payload above ``max_block_bytes``,
is moved to ``<root>/.quarantine/`` and never adopted. A tier on a mount other nodes write (DS3FS)
scans before serving instead (:meth:`Recovery.scan_before_serving`) and leaves no snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ucm_protocol.keys import BlockKey
from ucm_server.directories import make_private_dirs
from ucm_server.store.format import ALIGNED_HEADER_SIZE, CorruptBlock, UnsupportedFormat, decode_header
from ucm_server.store.posix import index_snapshot, snapshot_columns
from ucm_server.store.posix.block_index import BlockIndex, Stamp
from ucm_server.store.posix.confined import file_kind
from ucm_server.store.posix.files import (
    Disk,
    move_to_quarantine,
    report_skipped,
    skip,
)
from ucm_server.store.posix.layout import QUARANTINE, SUFFIX, TMP_MARK, block_key
from ucm_server.store.posix.packs import (
    PACK_DIR,
    PACK_SUFFIX,
    Pack,
    PackedStamp,
    PackTable,
    pack_place,
    scan_pack,
)
from ucm_server.store.posix.periodic_snapshots import PeriodicSnapshots
from ucm_server.store.posix.sweep import drop_stale, places_hold, scan_tree

log = logging.getLogger(__name__)

Run = Callable[..., Awaitable[Any]]
Found = tuple[bytes, int, float] | tuple[bytes, int, float, Pack, int]
"""A block the start-up scan found: key, size, store time, and for a packed one its pack and offset."""

SWEEP_AT_ONCE = 20_000
"""A snapshot of more blocks is swept a second after serving began, not during start-up."""
_SCAN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""Opening for a header read: no symlink, and a FIFO does not block (it is then skipped)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
INDEX_STATS = (
    "index_adopting",
    "index_verifying",
    "index_adopted",
    "index_files_read",
    "index_from_snapshot",
)


_gc_lock = threading.Lock()
_gc_pauses = 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a snapshot is built (any thread; nested or concurrent
    pauses end with the last one). A million-block load allocates a few container objects per
    pack, each of which may trigger a full collection that walks the million entries built so far:
    a third of a packed load's time, for no garbage (nothing built there is cyclic)."""
    global _gc_pauses
    with _gc_lock:
        mine = _gc_pauses > 0 or gc.isenabled()  # off already (by someone else): left alone
        if mine:
            _gc_pauses += 1
            gc.disable()
    try:
        yield
    finally:
        if mine:
            with _gc_lock:
                _gc_pauses -= 1
                if _gc_pauses == 0:
                    gc.enable()


class Recovery:
    """The start-up indexing of one tier (and the snapshots that speed it up), on the event loop
    with its file work in worker threads; the tier asks it what is known while it runs."""

    def __init__(
        self,
        disk: Disk,
        index: BlockIndex,
        packs: PackTable,
        *,
        run: Run,
        unindex: Callable[[bytes], object],
        snapshot_interval_s: float,
        index_wait_s: float,
        capacity: int = 0,
    ) -> None:
        """``capacity``: the tier's; a snapshot listing more bytes (or more blocks) is not believed."""
        self.disk, self.index, self.packs = disk, index, packs
        self.capacity = capacity
        self.name = disk.name
        self.roots = disk.layout.roots
        self._run = run
        self._unindex = unindex
        self.index_wait_s = index_wait_s
        self._adopter: asyncio.Task[None] | None = None
        self.packs_adopted = asyncio.Event()
        """Set once every pack of the roots without a snapshot was read (or there was none to read):
        a block in a pack has no path of its own to probe, so a lookup of a key not indexed yet
        waits for this short pass (one header read per pack of up to 64 blocks) before it answers
        missing."""
        self._packs_scanned: set[Path] = set()
        self.complete = False
        self._stop = False
        self.adopted = 0
        self.files_read = 0
        self.from_snapshot = 0
        self._loaded_rows = 0
        """Records the snapshots held (more than the blocks loaded only where a key was listed twice)."""
        self.opened_at = 0.0
        self.phase = ""
        """What the background indexing does: snapshot, scan, verify (a snapshot's files), or nothing."""
        self._loaded_keys: list[bytes] = []
        """The keys of the map :meth:`load_snapshots` returned, in its order (each once)."""
        self._listed: list[bytes] = []
        """The keys the snapshots listed, while the sweep after them runs."""
        self._elsewhere: dict[bytes, list[Found]] = {}
        """Blocks the scan found in another place than the one the index holds (a file and a pack
        record, two packs): settled when it ends, the newest place that still holds the block wins."""
        self._seen: set[bytes] | None = None
        """Keys the sweep after a snapshot found on disk so far: the listed ones it did not find
        are dropped when it ends (their files were removed while the daemon was down)."""
        self.snapshots = PeriodicSnapshots(
            disk.name, snapshot_interval_s, index, lambda: self.complete, self._write_periodic
        )

    # -- life cycle (event loop) --------------------------------------------------------------------
    async def start(self) -> None:
        """Take the clean-shutdown markers, then index in the background (waiting ``index_wait_s``)."""
        self.opened_at = time.time()
        self.disk.scanning = True
        self.index.start_adopting()  # from now on the index notes what clients change
        self.phase = "snapshot"
        epochs = await self._run(self._take_markers)
        self._adopter = asyncio.create_task(self._adopt_all(epochs))
        self.snapshots.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._adopter), self.index_wait_s)

    async def indexed(self) -> None:
        if self._adopter is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._adopter)

    async def stop(self, *, snapshot: bool) -> None:
        """Stop any re-adoption and the periodic snapshots; with ``snapshot``, after a complete
        index, leave the snapshot the next start trusts."""
        if self._adopter is not None:
            self._stop = True
            with contextlib.suppress(Exception):
                await self._adopter
        await self.snapshots.stop()
        if not (snapshot and self.complete):
            return
        keys, stamps = self.index.columns()
        try:
            await self._run(self.write_snapshots, keys, stamps)
        except OSError as exc:  # disk full, ...: no marker was written, so the next start scans
            self.disk.stats.errors += 1
            log.error(
                "posix tier %s: index snapshot not written (next start re-reads headers): %s",
                self.name,
                exc.strerror or exc,
            )

    def figures(self) -> dict[str, float]:
        """Start-up progress for the tier's stats, shown while it lasts."""
        if not self.phase:
            return {}
        return {
            "index_adopting": float(self.phase in ("snapshot", "scan")),
            "index_verifying": float(self.phase == "verify"),
            "index_adopted": float(self.adopted),
            "index_files_read": float(self.files_read),
            "index_from_snapshot": float(self.from_snapshot),
        }

    async def scan_before_serving(self, temp_grace_s: float) -> None:
        """Index every root by reading each block file's header before serving (no snapshot):
        for a tree other nodes change. Temporary files older than ``temp_grace_s`` are removed."""
        started = time.monotonic()
        self.disk.scanning = True
        try:
            found = await self._run(scan_tree, self.disk, temp_grace_s)
        finally:
            self.disk.scanning = False
        report_skipped(self.disk)
        found.sort(key=lambda item: item[2])  # least recently stored first = LRU order
        for key, size, stored_at in found:
            self.index.add(key, size, stored_at)
        log.info(
            "posix tier %s: %d blocks (%d bytes) indexed from %s in %.2fs",
            self.name,
            len(found),
            self.index.bytes,
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
            loaded, loaded_bytes, unsure, found_packs = await self._run(self.load_snapshots, epochs)
            if loaded:
                self._listed, self._seen = self._loaded_keys, set()
                self._loaded_keys = []
                listed_once = len(self._listed) == self._loaded_rows
                displaced = self._displaced(loaded)
                self.adopted += self.index.install(loaded, loaded_bytes, self._listed)
                self.from_snapshot = len(loaded)
                self._register_loaded(found_packs, displaced, listed_once)
            if not unsure:  # the index is what a snapshot on disk says: nothing new to write yet
                self.snapshots.written_at_changes(self.index.changes)
            if self.from_snapshot:
                log.info(
                    "posix tier %s: %d blocks indexed from snapshots in %.3fs",
                    self.name,
                    self.from_snapshot,
                    time.monotonic() - started,
                )
            self.phase = "scan"
            for root in unsure:  # packs first: their blocks cannot be probed by path meanwhile
                await self._run(self._scan_packs, root, loop)
            self.packs_adopted.set()
            for root in unsure:
                await self._run(self._scan_root, root, loop)
            self.phase = "verify"
            # A stop cuts short only the scans of roots no snapshot vouched for; a snapshot's load
            # runs to its end, so with none to scan the index is whole however early the stop came
            # (counted unfinished, a restart in a row left no snapshot: the next start re-read every
            # header).
            self.complete = not (self._stop and unsure)
            if len(self.index) > SWEEP_AT_ONCE:  # let the daemon come up before the sweep competes
                await asyncio.sleep(self.index_wait_s + 1.0)
            for root in self.roots:
                if root not in unsure and not self._stop:
                    await self._run(self._scan_root, root, loop)
            if not self._stop:
                await self._settle_elsewhere()
                await self._drop_unseen()
        except OSError as exc:
            self.disk.stats.errors += 1
            log.error("posix tier %s: indexing stopped: %s (blocks not indexed load by path)", self.name, exc)
        finally:
            self.packs_adopted.set()
            self._packs_scanned.clear()
            self._listed, self._seen, self._elsewhere = [], None, {}
            self.phase = ""
            self.disk.scanning = False
            self.index.end_adopting()
            report_skipped(self.disk)
        log.info(
            "posix tier %s: %d blocks (%d bytes) indexed from %s in %.2fs (%d from snapshots)",
            self.name,
            len(self.index),
            self.index.bytes,
            ", ".join(map(str, self.roots)),
            time.monotonic() - started,
            self.from_snapshot,
        )

    def _merge(self, chunk: list[Found]) -> None:
        """Adopt found blocks (event loop): a key stored or deleted since start-up is left as it is;
        one the index holds with another size (a snapshot that is wrong) takes the file's."""
        touched, index, seen = self.index.touched or set(), self.index, self._seen
        if seen is not None:
            seen.update([item[0] for item in chunk if item[1] >= 0])
        for item in chunk:
            key, size, stored_at = item[0], item[1], item[2]
            if key in touched:
                continue
            if len(item) > 3:
                self._merge_packed(block_key(key), size, stored_at, item[3], item[4])
            elif size < 0:  # a file found torn or unreadable by the sweep after a snapshot
                if not isinstance(index.get(key), PackedStamp):
                    self._unindex(key)
            elif index.adopt(block_key(key), size, stored_at):
                self.adopted += 1
            elif isinstance(index.get(key), PackedStamp):  # a file of a block the index holds in a pack
                self._elsewhere.setdefault(key, []).append(item)
            elif index.get(key) != size:
                index.correct(key, size, stored_at)

    def _merge_packed(self, key: BlockKey, size: int, stored_at: float, found: Pack, offset: int) -> None:
        """Adopt a block found in a pack (event loop). The pack object is the table's when a snapshot
        already named that pack; a block the index holds elsewhere is settled when the scan ends."""
        pack = self.packs.packs.get(found.id, found)
        current = self.index.get(key)
        if isinstance(current, PackedStamp) and current.pack is pack:
            i = pack.keys.index(key)
            if pack.offsets[i] != offset or current != size:  # the snapshot was wrong: the file says
                pack.offsets[i] = offset
                self.index.put(key, pack.stamp(size, stored_at), adopted=True)
            return
        if current is not None:
            self._elsewhere.setdefault(key, []).append((key, size, stored_at, found, offset))
            return
        pack.add(key, offset)
        self.packs.register(pack)
        self.index.adopt_stamp(key, pack.stamp(size, stored_at))
        self.adopted += 1

    async def _settle_elsewhere(self) -> None:
        """For each block found in another place than the index holds: the index's place is read
        (its header, in a worker thread); if it no longer holds the block (a stale snapshot: the
        block was written again into a pack or a file since, and its old place removed) or another
        place is newer (a crash between a rewrite and the removal of the old copy), the index
        takes the newest place found, where the block stands in the LRU order."""
        touched = self.index.touched or set()
        conflicts = {k: found for k, found in self._elsewhere.items() if k not in touched and k in self.index}
        self._elsewhere = {}
        if not conflicts:
            return
        here = await self._run(places_hold, self.disk, [(k, self.index.get(k)) for k in conflicts])
        moved = 0
        for (key, found), held_at in zip(conflicts.items(), here, strict=True):
            newest = max(found, key=lambda item: item[2])
            if key in (self.index.touched or ()) or (held_at is not None and held_at >= newest[2]):
                continue
            old = self.index.get(key)
            if isinstance(old, PackedStamp):
                self.packs.kill(old, key, tombstone=False)
            if len(newest) > 3:
                pack = self.packs.register(self.packs.packs.get(newest[3].id, newest[3]))
                if pack.offset_of(key) is None:
                    pack.add(key, newest[4])
                self.index.replace(key, pack.stamp(newest[1], newest[2]))
            else:
                self.index.replace(key, self.index.stamp(newest[1], newest[2]))
            moved += 1
        if moved:
            log.info("posix tier %s: %d blocks found where a snapshot did not place them", self.name, moved)

    async def _drop_unseen(self) -> None:
        """Forget the blocks a snapshot listed whose files the sweep did not find (removed while the
        daemon was down, or since the snapshot), unless stored or deleted since start-up."""
        listed, seen, self._listed, self._seen = self._listed, self._seen or set(), [], None
        touched = self.index.touched or set()
        gone = 0
        for start in range(0, len(listed), 65536):
            for key in [key for key in listed[start : start + 65536] if key not in seen]:
                if key not in touched and key in self.index:
                    self._unindex(key)
                    gone += 1
            await asyncio.sleep(0)
        if gone:
            log.info("posix tier %s: %d blocks a snapshot listed are gone from disk", self.name, gone)

    def _displaced(self, loaded: dict[bytes, Stamp]) -> list[tuple[bytes, PackedStamp]]:
        """The packed blocks of ``loaded`` that were stored again or deleted since start-up (event
        loop, before :meth:`BlockIndex.install` drops them): not live in their packs."""
        found = [(key, loaded.get(key)) for key in self.index.touched or ()]
        return [(key, stamp) for key, stamp in found if isinstance(stamp, PackedStamp)]

    def _register_loaded(
        self, found: list[Pack], displaced: list[tuple[bytes, PackedStamp]], listed_once: bool
    ) -> None:
        """Keep the packs a snapshot named with the blocks the index took from it (event loop): a
        key stored or deleted since start-up (``displaced``), or listed twice, is not live there.
        Every key listed once (``listed_once``): the packs are as built, but for the displaced."""
        if not listed_once:
            self._register_slowly(found)
            return
        for key, stamp in displaced:
            stamp.pack.kill(key)
        for pack in found:
            if pack.live:
                self.packs.register(pack)

    def _register_slowly(self, found: list[Pack]) -> None:
        """:meth:`_register_loaded` of a snapshot that lists a key more than once (never written so
        by this daemon): each key live only where the index holds it now, and only once."""
        for pack in found:
            live = 0
            for i, key in enumerate(pack.keys):
                stamp = self.index.get(key) if key is not None else None
                if isinstance(stamp, PackedStamp) and stamp.pack is pack and key not in pack.keys[:i]:
                    live += 1
                else:
                    pack.keys[i] = None
            pack.live = live
            if live:
                self.packs.register(pack)

    async def _write_periodic(self, keys: list[bytes], stamps: list[Stamp]) -> None:
        await self._run(lambda: self.write_snapshots(keys, stamps, periodic=True))

    # -- snapshots (worker threads) -----------------------------------------------------------------
    def _take_markers(self) -> list[bytes | None]:
        epochs: list[bytes | None] = []
        for root in self.roots:
            make_private_dirs(root)
            epochs.append(index_snapshot.take_marker(root))
        return epochs

    def load_snapshots(
        self, epochs: list[bytes | None]
    ) -> tuple[dict[bytes, Stamp], int, list[Path], list[Pack]]:
        """Every root's snapshot its marker vouches for, as one map in LRU order
        (:meth:`BlockIndex.build`), the roots without a usable one (their headers are read), and
        the packs the snapshots name. Built in a few array operations and C-level calls per root,
        not a Python step per block, with the cyclic garbage collector paused (:func:`gc_paused`)."""
        with gc_paused():
            return self._load_snapshots(epochs)

    def _load_snapshots(
        self, epochs: list[bytes | None]
    ) -> tuple[dict[bytes, Stamp], int, list[Path], list[Pack]]:
        keys: list[list[bytes]] = []
        stamps: list[list[Stamp]] = []
        unsure: list[Path] = []
        found: list[Pack] = []
        total = 0
        for root, epoch in zip(self.roots, epochs, strict=True):
            blocks = self._load_root(root, epoch)
            if blocks is None:
                unsure.append(root)
                continue
            mine, packed = snapshot_columns.stamps_of(self.index, root, blocks)
            keys.append(blocks.keys if isinstance(blocks.keys, list) else list(blocks.keys))
            stamps.append(mine)
            found += packed
            total += int(np.asarray(blocks.sizes, dtype=np.uint64).sum(dtype=np.uint64))
        every = keys[0] if len(keys) == 1 else list(itertools.chain.from_iterable(keys))
        self._loaded_rows = len(every)
        loaded = BlockIndex.build(every, stamps[0] if len(stamps) == 1 else [*itertools.chain(*stamps)])
        if len(loaded) != len(every):  # a key listed twice (not by this daemon): counted once
            total = sum(loaded.values())
        self._loaded_keys = every if len(loaded) == len(every) else list(loaded)
        return loaded, total, unsure, found

    def _load_root(self, root: Path, epoch: bytes | None) -> index_snapshot.Columns | None:
        """The snapshot of ``root`` to start from: the clean one its marker vouches for (then made
        the newest periodic generation), else the newest periodic one (when periodic snapshots are
        on), else None (its headers are read)."""
        why = []
        limit = self.disk.max_block_bytes
        try:
            if epoch is None:
                raise index_snapshot.SnapshotRejected("no clean-shutdown marker")
            blocks = index_snapshot.read_snapshot(root, epoch, limit, capacity=self.capacity)
        except index_snapshot.SnapshotRejected as exc:
            why.append(str(exc))
        else:
            if self.snapshots.interval_s:
                try:
                    index_snapshot.promote_clean(root, epoch, durable=self.disk.durable)
                except OSError as exc:  # the previous periodic generation stays the crash base
                    log.warning("posix tier %s: %s not kept as periodic: %s", self.name, root, exc)
            return blocks
        if self.snapshots.interval_s:
            try:
                blocks = index_snapshot.read_periodic(root, limit, capacity=self.capacity)
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

    def write_snapshots(self, keys: list[bytes], stamps: list[Stamp], *, periodic: bool = False) -> None:
        """Write the snapshot of every root: the clean one at shutdown, or a new periodic generation."""
        write = index_snapshot.write_periodic if periodic else index_snapshot.write_snapshot
        by_root: dict[Path, tuple[list[bytes], list[Stamp]]] = {root: ([], []) for root in self.roots}
        if len(self.roots) == 1:
            by_root[self.roots[0]] = (keys, stamps)
        else:
            for key, stamp in zip(keys, stamps, strict=True):
                mine = by_root[self.disk.layout.root_of(key)]
                mine[0].append(key)
                mine[1].append(stamp)
        places = self.packs.offsets() if self.packs.packs else None
        for root, (mine_keys, mine_stamps) in by_root.items():
            write(
                root, snapshot_columns.columns_of(mine_keys, mine_stamps, places), durable=self.disk.durable
            )

    # -- the scan (worker threads) ------------------------------------------------------------------
    def _scan_root(self, root: Path, loop: asyncio.AbstractEventLoop) -> None:
        """Read every block file's header under ``root``, by directory descriptor: no symlink is
        followed, only regular files are read. Temporary files older than this start are
        interrupted writes and removed; newer ones are writes in flight. Found blocks go to
        :meth:`_merge` on the event loop, a chunk at a time."""
        top = os.fspath(root).rstrip("/")
        chunk: list[Found] = []
        rfd = os.open(top or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._scan_dir(rfd, top, 0, loop, chunk)
        finally:
            os.close(rfd)
        if chunk:
            loop.call_soon_threadsafe(self._merge, chunk)

    def _scan_packs(self, root: Path, loop: asyncio.AbstractEventLoop) -> None:
        """Adopt the packs of ``root`` (``<root>/pack/``) ahead of its block files; the scan of the
        whole root then passes over them."""
        top = os.fspath(root).rstrip("/")
        chunk: list[Found] = []
        try:
            rfd = os.open(top or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fd = os.open(PACK_DIR, _DIR_FLAGS, dir_fd=rfd)
        except OSError:  # no packs (or not a plain directory: the whole scan says so)
            os.close(rfd)
            return
        try:
            self._scan_dir(fd, f"{top}/{PACK_DIR}", 1, loop, chunk)
            self._packs_scanned.add(root)
        finally:
            os.close(fd)
            os.close(rfd)
        if chunk:
            loop.call_soon_threadsafe(self._merge, chunk)

    def _scan_dir(
        self, dfd: int, path: str, depth: int, loop: asyncio.AbstractEventLoop, chunk: list[Found]
    ) -> None:
        subdirs: list[str] = []
        with os.scandir(dfd) as entries:
            listed = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        packs_done = depth == 0 and any(os.fspath(r).rstrip("/") == path for r in self._packs_scanned)
        for name, is_dir in listed:
            if is_dir:
                if not (depth == 0 and (name == QUARANTINE or (name == PACK_DIR and packs_done))):
                    subdirs.append(name)
                continue
            if TMP_MARK in name:
                drop_stale(dfd, name, self.opened_at)  # no write of this run began before open()
                continue
            if name.endswith(PACK_SUFFIX):
                self.files_read += 1
                chunk.extend(self._adopt_pack(dfd, f"{path}/{name}", name))
                continue
            if not name.endswith(SUFFIX):
                continue
            self.files_read += 1
            item = self._adopt_file(dfd, f"{path}/{name}", name)
            if item is not None:
                chunk.append(item)
                if len(chunk) >= 1024:
                    loop.call_soon_threadsafe(self._merge, chunk[:])
                    chunk.clear()
        for name in subdirs:
            if self._stop:
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
                skip(self.disk, Path(path), "symlink")
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
            skip(self.disk, Path(path), file_kind(st.st_mode))
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
            header = decode_header(
                os.pread(fd, ALIGNED_HEADER_SIZE, 0), max_payload=self.disk.max_block_bytes
            )
            if st.st_size != header.stored_len:
                raise CorruptBlock(f"file is {st.st_size} bytes, header promises {header.stored_len}")
            key = header.key
            if self.disk.layout.expected_path(header) != path:
                raise CorruptBlock(f"header names {key.hex()}, which does not live at this path")
        except UnsupportedFormat as exc:
            log.warning("posix tier %s: skipping %s: %s", self.name, path, exc)
            return self._unusable(path)
        except CorruptBlock as exc:
            move_to_quarantine(self.disk, Path(path), str(exc))
            return self._unusable(path)
        except OSError as exc:
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return self._unusable(path)
        finally:
            os.close(fd)
        return key, header.payload_len, header.created_ns / 1e9

    def _adopt_pack(self, dirfd: int, path: str, fname: str) -> list[Found]:
        """The blocks of pack file ``fname`` (a regular file at the path its header's id names)
        whose records are whole, inside the file and not overlapping (:func:`packs.scan_pack`); a
        pack whose own header is bad is quarantined whole. Payload checksums are checked at load."""
        opened = self._open_scanned(dirfd, path, fname)
        if opened is None:
            return []
        fd, st = opened
        try:
            found = scan_pack(fd, st.st_size, self.disk.max_block_bytes)
            root, parts = self.disk.layout.split(Path(path))
            where, name = pack_place(found.pack_id)
            if parts != [*where, name]:
                raise CorruptBlock(f"pack header names pack {found.pack_id:016x}, which does not live here")
        except CorruptBlock as exc:
            move_to_quarantine(self.disk, Path(path), str(exc))
            return []
        except OSError as exc:
            log.warning("posix tier %s: cannot read %s: %s", self.name, path, exc)
            return []
        finally:
            os.close(fd)
        if found.refused:
            self.disk.count("pack_refused", found.refused)
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
        key = self.disk.layout.key_at(path)
        return None if key is None else (key, -1, 0.0)
