"""Writing a batch of blocks as a group: staged temporary files, one commit for all of them.

Durability: a block is written to a temporary file in its final directory, fsynced, renamed over the
final name and the directory fsynced, so after any crash a ``.blk`` file is either absent or complete;
leftover temporary files are removed at start-up. A batch is written in executor jobs of up to
:data:`GROUP_BLOCKS` blocks reusing directory descriptors (:func:`stage_group`, :func:`stage_packs`),
and a durable one is committed as a group where ``syncfs`` reports errors (Linux >= 5.8,
:func:`commit`): all temporary files written, one ``syncfs`` per root (their data is on disk), all
renames, one more ``syncfs`` per root (the names and any new directories are), then the blocks are
acknowledged: two syncs per root per batch, and the same guarantee (a visible block is complete; an
acknowledged one survives). Elsewhere each file is fsynced and each touched directory once per job.
``durable=False`` skips the fsyncs (faster, and a power loss may then lose recent blocks, but still
never exposes a torn one: the header's length and checksum are verified on every read).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm_protocol.keys import BlockKey
from ucm_server.store.copying import IoVec
from ucm_server.store.io_classes import yield_to_loads
from ucm_server.store.posix.confined import DirCache
from ucm_server.store.posix.files import Disk, create_tmp, unlink_at, write_tmp
from ucm_server.store.posix.packs import Pack, new_pack_id, pack_parts
from ucm_server.store.vector_io import pwritev_all

Run = Callable[..., Awaitable[Any]]
"""The tier's executor hop: ``await run(fn, *args)`` runs ``fn(*args)`` in a worker thread."""

GROUP_BLOCKS = 64
"""Most blocks one executor job of a batched write writes."""
GROUP_BYTES = 8 << 20
"""A job ends at the block that brings it to this many bytes (big blocks: one or two per job)."""


@dataclass(slots=True)
class Staged:
    """A block written to a temporary file in its directory, waiting for (or past) its rename."""

    root: Path
    parts: tuple[str, ...]
    tmp: str
    name: str
    direct: bool


@dataclass(slots=True)
class PackStaged(Staged):
    """A pack file staged like a block file; every block in it has this one as its outcome."""

    pack: Pack


Outcome = Staged | OSError


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


SYNCFS = _find_syncfs()
"""libc's ``syncfs``, or None where group commit is not safe (each block is then fsynced)."""


def syncfs(fd: int) -> None:
    """Flush the whole filesystem holding ``fd`` (data and metadata); raises ``OSError``."""
    assert SYNCFS is not None
    if SYNCFS(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# -- staging (worker threads) -----------------------------------------------------------------------
def stage_group(disk: Disk, items: list[tuple[BlockKey, IoVec]], group: bool) -> list[Outcome]:
    """Write each block of ``items`` to a temporary file in its directory (descriptors reused
    across the group). With ``group`` (a group commit follows) the temporary files are left for
    :func:`rename_staged`; otherwise each is fsynced (durable tiers) and renamed at once, and
    each directory fsynced once at the end, so the fallback also costs one fsync per directory,
    not per block, beyond the files' own."""
    outcomes: list[Outcome] = []
    touched: dict[int, list[int]] = {}
    with DirCache(create=True, sync_created=disk.durable and not group) as dirs:
        for n, (key, src) in enumerate(items):
            yield_to_loads()  # a write-back holds here while loads read the disk
            try:
                staged, dfd = _stage_one(disk, key, src, dirs, group)
                outcomes.append(staged)
                touched.setdefault(dfd, []).append(n)
            except OSError as exc:
                outcomes.append(exc)
        if disk.durable and not group:
            for dfd, which in touched.items():  # the renames above, durable before any ack
                try:
                    os.fsync(dfd)
                except OSError as exc:
                    for n in which:
                        outcomes[n] = exc
    return outcomes


def _stage_one(disk: Disk, key: BlockKey, src: IoVec, dirs: DirCache, group: bool) -> tuple[Staged, int]:
    root, parts, name = disk.layout.place(key)
    dfd = dirs.get(root, parts)
    tmp = disk.tmp_name(name)
    direct = write_tmp(disk, dfd, tmp, root, key, src, fsync=disk.durable and not group)
    if not group:
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            unlink_at(dfd, tmp)
            raise
    return Staged(root=root, parts=parts, tmp=tmp, name=name, direct=direct), dfd


def stage_packs(disk: Disk, items: list[tuple[BlockKey, IoVec]], group: bool) -> list[Outcome]:
    """Write the blocks of one job as one pack file per root (:mod:`ucm_server.store.posix.packs`):
    one ``pwritev`` of every header and payload into a temporary file. With ``group`` it is left
    for the group commit; otherwise fsynced (durable tiers), renamed, and its directory fsynced."""
    by_root: dict[Path, list[int]] = {}
    for n, (key, _) in enumerate(items):
        by_root.setdefault(disk.layout.root_of(key), []).append(n)
    outcomes: list[Outcome] = [OSError(errno.EIO, "not written")] * len(items)
    with DirCache(create=True, sync_created=disk.durable and not group) as dirs:
        for root, which in by_root.items():
            yield_to_loads()
            try:
                staged: Outcome = _stage_pack(disk, dirs, root, [items[n] for n in which], group)
            except OSError as exc:
                staged = exc
            for n in which:
                outcomes[n] = staged
    return outcomes


def _stage_pack(
    disk: Disk, dirs: DirCache, root: Path, items: list[tuple[BlockKey, IoVec]], group: bool
) -> PackStaged:
    pack = Pack(new_pack_id(), root)
    parts, name = pack.place
    dfd = dirs.get(root, parts)
    segments, offsets = pack_parts(pack.id, items)
    tmp = disk.tmp_name(name)
    fd = create_tmp(dfd, tmp)
    try:
        try:
            pwritev_all(fd, segments, 0)
            if disk.durable and not group:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not group:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if disk.durable:
                os.fsync(dfd)
    except BaseException:
        unlink_at(dfd, tmp)
        raise
    for (key, _), offset in zip(items, offsets, strict=True):
        pack.add(key, offset)
    return PackStaged(root=root, parts=parts, tmp=tmp, name=name, direct=False, pack=pack)


def sync_roots(disk: Disk, roots: list[Path]) -> dict[Path, OSError]:
    """``syncfs`` of each root's filesystem; the roots that failed, with their error."""
    broken: dict[Path, OSError] = {}
    for root in roots:
        yield_to_loads()  # a sync flushes the device's cache: not while loads read
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                syncfs(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            broken[root] = exc
    if roots:
        disk.count("group_syncs", len(roots))
    return broken


def rename_staged(staged: list[Staged]) -> list[Outcome]:
    """Rename staged temporary files over their final names (each directory opened once)."""
    out: list[Outcome] = []
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


def discard_temps(staged: list[Staged]) -> None:
    with DirCache() as dirs:
        for o in staged:
            with contextlib.suppress(OSError):
                unlink_at(dirs.get(o.root, o.parts), o.tmp)


def _distinct(staged: Iterator[Staged]) -> list[Staged]:
    """Each staged file once, in order (a pack's blocks share one)."""
    return list({id(o): o for o in staged}.values())


# -- the commit (event loop) ------------------------------------------------------------------------
async def commit(run: Run, disk: Disk, outcomes: list[Outcome]) -> list[Outcome]:
    """Group commit of the staged temporary files among ``outcomes``: sync their roots, rename,
    sync the roots again. A failed sync fails (and removes the temporary files of) every block of
    that root. The outcomes, in order, each the block's staged file or its error."""
    out = list(outcomes)
    staged = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, Staged)]
    roots = sorted({o.root for _, o in staged})
    broken = await run(sync_roots, disk, roots)
    renames = [(i, o) for i, o in staged if o.root not in broken]
    for i, o in staged:
        if o.root in broken:
            out[i] = broken[o.root]
    if staged:
        await run(discard_temps, _distinct(o for _, o in staged if o.root in broken))
    if renames:
        files = _distinct(o for _, o in renames)  # a pack's blocks share one staged file
        done = dict(zip(map(id, files), await run(rename_staged, files), strict=True))
        for i, o in renames:
            out[i] = done[id(o)]
        renamed = sorted({o.root for i, o in renames if isinstance(out[i], Staged)})
        for root, exc in (await run(sync_roots, disk, renamed)).items():
            for i, o in renames:
                if o.root == root:
                    out[i] = exc
    return out
