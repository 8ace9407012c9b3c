"""The Posix tier's blocking file work, as module functions the tier runs in its executor.

Every function takes the tier's :class:`Disk` (where blocks live, how they are written, what to
count) and does one piece of work on the files: read a batch of blocks into memory, read one with
every check spelled out, write one durably, remove or quarantine files. Nothing here touches the
index or awaits: the async tier (:mod:`ucm_server.store.posix.tier`) decides, these do.

Files on disk are data, not instructions (:mod:`ucm_server.store.posix.confined`): below a root no
symlink is followed (a symlinked directory fails that block's write or read, nothing is written
outside the roots), only regular files are opened (a FIFO, socket, device or symlink where a block
file should be is skipped, logged once per kind and counted in the tier's ``skipped_files`` stats),
and every directory created on the way to a block file is fsynced into its parent before the block
counts as durable.

Writes use ``O_DIRECT`` when they can (``direct_io``) and it pays: the block is at least
``direct_min_bytes``, its buffers are 4 KiB aligned (the Cache arena's pages and shared-memory regions
are), its length is a multiple of 4 KiB, and the filesystem accepts the flag. The header is then padded
to 4 KiB so the payload stays aligned. Skipping the page cache is the point: a buffered write of a 32
MiB block costs the kernel about 90 ms of CPU to copy it into the cache, a direct one under 3 ms, and on
a node where vLLM computes on the same cores that CPU is taken from inference. Anything else is written
buffered with the 128-byte header; readers take the payload offset from the header, so both kinds
coexist.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ucm_protocol.keys import BlockKey
from ucm_server.store.base import TierStats
from ucm_server.store.copying import IoVec, iov_len
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
from ucm_server.store.posix.confined import (
    DirCache,
    NotRegularFile,
    open_block,
    open_regular,
    open_regular_sized,
    parent_dir,
)
from ucm_server.store.posix.layout import QUARANTINE, TMP_MARK, Layout, block_name
from ucm_server.store.posix.packs import (
    Outcome,
    Pack,
    PackRead,
    RecordReads,
    Retire,
    natively_readable,
    read_records,
    tombstone,
)
from ucm_server.store.vector_io import IOV_MAX, preadv_all, pwritev_all

log = logging.getLogger(__name__)

DIRECT_ALIGN = 4096
"""Alignment of buffers, offsets and lengths for ``O_DIRECT`` (the common logical block size)."""
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""A block file opened for reading: never through a symlink, and a FIFO does not block."""
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""A temporary file created: new (never through a planted symlink), written, renamed."""

ReadOutcome = bool | OSError | CorruptBlock
"""A batched read's result per block: read (checked: whether the bytes matched), or its error."""


@dataclass(slots=True)
class Disk:
    """What the file functions know of their tier: its layout and write options, and the figures
    they keep (stats, skipped files). One per tier; shared with the worker threads."""

    name: str
    layout: Layout
    durable: bool
    direct_io: bool
    direct_min_bytes: int
    max_block_bytes: int
    stats: TierStats
    no_direct: set[Path] = field(default_factory=set)
    """Roots whose filesystem refused ``O_DIRECT``: written buffered from then on."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Non-regular files met where block files should be, by kind (fifo, symlink, ...)."""
    skip_examples: dict[str, str] = field(default_factory=dict)
    scanning: bool = False
    """A start-up scan runs: skipped files are reported once at its end, not one by one."""
    tmp_tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    tmp_seq: Iterator[int] = field(default_factory=itertools.count)

    def tmp_name(self, name: str) -> str:
        """A unique temporary name for ``name`` in its directory (no urandom per block)."""
        return f"{name}{TMP_MARK}{self.tmp_tag}{next(self.tmp_seq):x}"

    def count(self, figure: str, n: float = 1.0) -> None:
        self.stats.extra[figure] = self.stats.extra.get(figure, 0.0) + n


# -- confined opens ---------------------------------------------------------------------------------
@contextlib.contextmanager
def parent(disk: Disk, path: Path, *, create: bool = False) -> Iterator[int]:
    """The directory holding ``path``, reached without following symlinks below its root; with
    ``create``, missing directories are made and (durable tiers) fsynced into their parents."""
    root, parts = disk.layout.split(path)
    with parent_dir(root, parts, create=create, sync_created=disk.durable) as dfd:
        yield dfd


def open_block_file(disk: Disk, path: Path, key: BlockKey | None = None) -> int:
    """``path`` opened read-only if it is a regular file reached without symlinks; anything else
    is counted and reported as skipped and raises :class:`NotRegularFile` (an ``OSError``).
    ``key``: the block ``path`` is the current-layout path of; when absent there, the older
    layout's file of it is opened (a tier that writes the older layout itself tries nothing)."""
    root, parts = disk.layout.split(path)
    try:
        try:
            return open_block(root, parts, os.O_RDONLY)
        except FileNotFoundError:
            if key is None or not disk.layout.flat:
                raise
        root, legacy, name = disk.layout.place(key, flat=False)  # an older release's block
        path = root.joinpath(*legacy, name)
        return open_block(root, [*legacy, name], os.O_RDONLY)
    except NotRegularFile as exc:
        skip(disk, path, exc.kind)
        raise


def open_key(disk: Disk, key: BlockKey, dirs: DirCache) -> tuple[int, int]:
    """``key``'s block file opened read-only (confined, regular files only, as
    :func:`open_block_file`), with its size. Its directory comes from ``dirs``, opened one component
    at a time without following symlinks and kept for the batch, so the file itself is one
    ``openat`` of its name with ``O_NOFOLLOW``: on a 4 KiB read a whole-path ``openat2`` through
    ctypes cost more than the read."""
    root, parts, name = disk.layout.place(key)
    try:
        try:
            return open_in(dirs, root, parts, name)
        except FileNotFoundError:
            if not disk.layout.flat:
                raise
        root, parts, name = disk.layout.place(key, flat=False)  # an older release's block
        return open_in(dirs, root, parts, name)
    except NotRegularFile as exc:
        skip(disk, root.joinpath(*parts, name), exc.kind)
        raise


def open_in(dirs: DirCache, root: Path, parts: tuple[str, ...], name: str) -> tuple[int, int]:
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


def skip(disk: Disk, path: Path, kind: str) -> None:
    """Count a non-regular file; warn once per kind (at start-up: once per kind, with a count)."""
    first = kind not in disk.skipped
    disk.skipped[kind] += 1
    disk.skip_examples.setdefault(kind, str(path))
    if first and not disk.scanning:
        log.warning(
            "posix tier %s: skipping %s: a %s, not a regular block file (counted in skipped_files; "
            "further ones are not logged)",
            disk.name,
            path,
            kind,
        )


def report_skipped(disk: Disk) -> None:
    for kind, count in sorted(disk.skipped.items()):
        log.warning(
            "posix tier %s: skipped %d %s file(s) where block files should be (e.g. %s); "
            "only regular files are read",
            disk.name,
            count,
            kind,
            disk.skip_examples[kind],
        )


# -- reads ------------------------------------------------------------------------------------------
def read_group(disk: Disk, items: list[tuple[BlockKey, IoVec]], checked: bool) -> list[ReadOutcome]:
    """Each block of a group read into the caller's memory: True (payload verified), or with
    ``checked`` whether the bytes there matched the header's checksum (see
    :func:`read_file_checked`), or the error it raised.

    One tight loop per group (a 4 KiB read is about 6 µs of system calls, so every Python step per
    block shows): the shard directory's descriptor is found by the key's first bytes, the file is
    one ``openat(O_NOFOLLOW)`` + ``fstat`` + one ``preadv`` of header and payload + ``close``, the
    header is checked by :func:`fast_checksum` without building an object. Anything unusual (no
    file at the current layout's path, not a regular file, a header or size that fails a check)
    is read again by :func:`read_careful`, which knows the older layout and names what is wrong."""
    out: list[ReadOutcome] = []
    shards: dict[bytes, int] = {}
    cut = disk.layout.shard_cut
    heads = {HEADER_SIZE: bytearray(HEADER_SIZE), ALIGNED_HEADER_SIZE: bytearray(ALIGNED_HEADER_SIZE)}
    limit = disk.max_block_bytes
    with DirCache() as dirs:
        for key, dest in items:
            outcome: ReadOutcome | None = None
            if len(dest) == 1:
                dfd = shards.get(key[:cut])
                if dfd is None:
                    root, parts, _ = disk.layout.place(key)
                    with contextlib.suppress(OSError):  # a symlinked or missing directory: careful path
                        dfd = shards[key[:cut]] = dirs.get(root, parts)
                if dfd is not None:
                    outcome = read_fast(dfd, block_name(key), key, dest[0], heads, limit, checked)
            if outcome is None:
                try:
                    outcome = read_careful(disk, key, dest, dirs, checked)
                except (OSError, CorruptBlock) as exc:
                    outcome = exc
            out.append(outcome)
    return out


def read_fast(
    dfd: int, name: str, key: bytes, view: memoryview, heads: dict[int, bytearray], limit: int, checked: bool
) -> ReadOutcome | None:
    """Read block ``name`` of directory ``dfd`` into ``view`` when nothing is unusual: a regular
    file whose size is one of the header sizes plus ``view``'s length, whose header passes every
    check (:func:`fast_checksum`, ``limit``: ``max_block_bytes``); None otherwise (the caller then
    reads it the careful way, which zeroes ``view`` or overwrites it). The outcome as
    :func:`read_group` reports it; a payload that fails its checksum is zeroed first."""
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
    zero((view,))  # daemon memory: the block fails, none of its bytes stay
    return CorruptBlock("payload checksum mismatch")


def read_careful(disk: Disk, key: BlockKey, dest: IoVec, dirs: DirCache, checked: bool) -> bool:
    """One block of :func:`read_group` step by step: the older layout tried, a non-regular
    file counted and refused, each failed check raised with its reason (``dest`` zeroed)."""
    fd, size = open_key(disk, key, dirs)
    try:
        header = read_whole(fd, size, key, dest, disk.max_block_bytes)
    finally:
        os.close(fd)
    if checked:
        return bool(payload_checksum(dest) == header.checksum)
    try:
        verify_payload(header, dest)
    except CorruptBlock:
        zero(dest)
        raise
    return True


def read_whole(fd: int, size: int, key: BlockKey, dest: IoVec, max_payload: int) -> BlockHeader:
    """Header and payload of an open block file of ``size`` bytes in one ``preadv`` when the
    size fits a header of either kind, else header first; the header is checked (key, CRC,
    ``max_payload``, file size) before the caller trusts anything, and on any error ``dest`` is
    zeroed (none of the file's bytes stay where they were read)."""
    try:
        head_len = size - iov_len(dest)
        if head_len not in HEADER_SIZES:
            header = read_block_header(fd, expect=key, max_payload=max_payload, size=size)
            preadv_all(fd, dest, header.header_len)
            return header
        head = bytearray(head_len)
        iov = [memoryview(head), *dest]
        # One call reads it all, unless the file is shorter or the block has more segments than
        # one preadv takes (IOV_MAX: EINVAL): preadv_all then goes a piece at a time.
        if len(iov) > IOV_MAX or os.preadv(fd, iov, 0) != size:
            preadv_all(fd, iov, 0)
        header = decode_header(memoryview(head), expect=key, max_payload=max_payload)
        if header.stored_len != size:
            raise CorruptBlock(f"file is {size} bytes, header promises {header.stored_len}")
        return header
    except BaseException:
        zero(dest)
        raise


def read_file(disk: Disk, key: BlockKey, dest: IoVec) -> None:
    """Read ``key``'s block file into daemon memory, its payload verified (else ``dest`` zeroed)."""
    fd = open_block_file(disk, disk.layout.path_of(key), key)
    try:
        header = read_block_header(fd, expect=key, max_payload=disk.max_block_bytes)
        preadv_all(fd, dest, header.header_len)
    finally:
        os.close(fd)
    try:
        verify_payload(header, dest)
    except CorruptBlock:
        zero(dest)  # the block failed: leave no trace of its bytes in the reader's memory
        raise


def read_file_checked(disk: Disk, key: BlockKey, dest: IoVec) -> bool:
    """Read a block into client memory; whether the bytes there match the header's checksum.
    On an error ``dest`` is zeroed (the block fails: none of its bytes stay there); on a
    mismatch the caller reads the block again and overwrites or zeroes ``dest``."""
    fd = open_block_file(disk, disk.layout.path_of(key), key)
    try:
        header = read_block_header(fd, expect=key, max_payload=disk.max_block_bytes)
        try:
            preadv_all(fd, dest, header.header_len)
            return bool(payload_checksum(dest) == header.checksum)
        except BaseException:
            zero(dest)
            raise
    finally:
        os.close(fd)


def read_header(disk: Disk, path: Path, key: BlockKey | None = None) -> BlockHeader:
    fd = open_block_file(disk, path, key)
    try:
        return read_block_header(fd, expect=key, max_payload=disk.max_block_bytes)
    finally:
        os.close(fd)


def read_packed_header(disk: Disk, pack: Pack, offset: int, key: BlockKey) -> BlockHeader:
    """The checked header of ``key``'s record at ``offset`` of ``pack`` (confined open, as every read)."""
    parts, name = pack.place
    with DirCache() as dirs:
        fd, _ = open_in(dirs, pack.root, parts, name)
    try:
        return decode_header(os.pread(fd, HEADER_SIZE, offset), expect=key, max_payload=disk.max_block_bytes)
    finally:
        os.close(fd)


def read_block_header(
    fd: int, expect: BlockKey | None = None, max_payload: int | None = None, size: int | None = None
) -> BlockHeader:
    """The checked header of an open block file: valid, padding zero, file size as it promises, and
    (``max_payload``) a payload no larger than the daemon accepts. ``size``: the file's size from an
    ``fstat`` the caller just made on ``fd`` (saves asking again)."""
    raw = os.pread(fd, ALIGNED_HEADER_SIZE, 0)
    header = decode_header(raw, expect=expect, max_payload=max_payload)  # checks the padding read;
    if size is None:  # a file too short to hold the rest fails the size check
        size = os.fstat(fd).st_size
    if size != header.stored_len:
        raise CorruptBlock(f"file is {size} bytes, header promises {header.stored_len}")
    return header


def block_file_header(
    path: Path, expect: BlockKey | None = None, max_payload: int | None = None
) -> BlockHeader:
    """:func:`read_block_header` of the regular file at ``path`` (a symlink or FIFO there raises
    :class:`~ucm_server.store.posix.confined.NotRegularFile`)."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_regular(path.name, os.O_RDONLY, dir_fd=dfd, shown=str(path))
    finally:
        os.close(dfd)
    try:
        return read_block_header(fd, expect=expect, max_payload=max_payload)
    finally:
        os.close(fd)


def read_pack_job(disk: Disk, job: list[PackRead], checked: bool) -> list[list[Outcome]]:
    """The records of each pack of ``job`` read and checked: by the compiled helper where it can
    (:func:`~ucm_server.store.posix.packs.read_records`, pack by pack), else all at once
    (:class:`~ucm_server.store.posix.packs.RecordReads`); a pack that cannot be opened fails its blocks."""
    reads = None if natively_readable(job) else RecordReads(job)
    read: list[list[Outcome]] = []
    with DirCache() as dirs:
        for n, pack_read in enumerate(job):
            pack = pack_read[0]
            parts, name = pack.place
            try:
                fd, size = open_in(dirs, pack.root, parts, name)
            except OSError as exc:
                if isinstance(exc, NotRegularFile):
                    skip(disk, pack.root.joinpath(*parts, name), exc.kind)
                if reads is None:
                    read.append([exc] * len(pack_read[2]))
                else:
                    reads.fail(n, exc)
                continue
            try:
                if reads is None:
                    read.append(read_records(fd, size, pack_read, disk.max_block_bytes, checked))
                else:
                    reads.read(n, fd, size)
            finally:
                os.close(fd)
    return read if reads is None else reads.outcomes(disk.max_block_bytes, checked)


def probe_files(disk: Disk, keys: list[BlockKey]) -> list[tuple[int, float] | None]:
    """Size and store time of each key's block file if its header is whole and names it (a corrupt
    one is quarantined); None where there is none, not one this release reads, or it cannot be read."""
    found: list[tuple[int, float] | None] = []
    for key in keys:
        try:
            header = read_header(disk, disk.layout.path_of(key), key)
        except CorruptBlock as exc:
            quarantine_key(disk, key, str(exc))
            found.append(None)
        except (UnsupportedFormat, OSError):  # absent, not a regular file, unreadable
            found.append(None)
        else:
            found.append((header.payload_len, header.created_ns / 1e9))
    return found


# -- writes -----------------------------------------------------------------------------------------
def write_file(disk: Disk, key: BlockKey, src: IoVec) -> bool:
    """Write one block file durably (temporary file, fsync, rename, directory fsync); True if it
    went out with ``O_DIRECT``."""
    path = disk.layout.path_of(key)
    root = disk.layout.root_of(key)
    with parent(disk, path, create=True) as dfd:
        tmp = f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        direct = write_tmp(disk, dfd, tmp, root, key, src, fsync=disk.durable)
        try:
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            unlink_at(dfd, tmp)
            raise
        if disk.durable:
            os.fsync(dfd)
    return direct


def write_tmp(disk: Disk, dfd: int, tmp: str, root: Path, key: BlockKey, src: IoVec, *, fsync: bool) -> bool:
    """Create ``tmp`` in directory ``dfd`` and write the block (header and payload) into it,
    fsynced when ``fsync``; True if it went out with ``O_DIRECT``. On any error the file is
    removed again and the error raised, so no temporary file outlives a failed write."""
    size, checksum = iov_len(src), payload_checksum(src)
    want_direct = disk.direct_io and size >= disk.direct_min_bytes and _direct_ready(src)
    fd, direct = _create(disk, dfd, tmp, root, want_direct=want_direct)
    try:
        version = FLAT_LAYOUT_VERSION if disk.layout.flat else None
        if direct:
            header = encode_header(key, size, checksum, header_len=ALIGNED_HEADER_SIZE, version=version)
            direct = _write_direct(fd, header, src)
        if not direct:
            pwritev_all(fd, [memoryview(encode_header(key, size, checksum, version=version)), *src], 0)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_at(dfd, tmp)
        raise
    os.close(fd)
    return direct


def create_tmp(dfd: int, tmp: str) -> int:
    """A new temporary file ``tmp`` in directory ``dfd``, opened for writing."""
    return os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dfd)


def _create(disk: Disk, dfd: int, tmp: str, root: Path, *, want_direct: bool) -> tuple[int, bool]:
    """A new temporary file in ``dfd``, opened ``O_DIRECT`` if wanted and the root's filesystem
    allows it (``O_EXCL`` with ``O_NOFOLLOW``: never through a planted symlink)."""
    if want_direct and root not in disk.no_direct:
        try:
            return os.open(tmp, _CREATE_FLAGS | os.O_DIRECT, 0o600, dir_fd=dfd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            unlink_at(dfd, tmp)  # some filesystems create the file before refusing the flag
            disk.no_direct.add(root)
            log.info("posix tier %s: %s refuses O_DIRECT; writing buffered", disk.name, root)
    return create_tmp(dfd, tmp), False


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
            pwritev_all(fd, [head, *src], 0)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        os.ftruncate(fd, 0)
        return False
    finally:
        page.close()


# -- removal ----------------------------------------------------------------------------------------
def unlink_all(disk: Disk, paths: list[Path]) -> None:
    for p in paths:
        try:
            with parent(disk, p) as dfd:
                unlink_at(dfd, p.name)
        except FileNotFoundError:
            continue
        except OSError as exc:  # a symlinked directory: nothing outside the roots is touched
            log.warning("posix tier %s: not deleting %s: %s", disk.name, p, exc)


def unlink_at(dfd: int, name: str) -> None:
    """Remove ``name`` in directory ``dfd`` if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)


def move_to_quarantine(disk: Disk, path: Path, reason: str) -> bool:
    """Move a bad block file into ``<root>/.quarantine`` by directory descriptors: neither the
    file's directories nor the quarantine directory is followed if it is a symlink. False when
    there was no file at ``path``."""
    root = disk.layout.split(path)[0]
    target = f"{path.name}.{uuid.uuid4().hex[:8]}"
    try:
        with parent(disk, path) as src, parent(disk, root / QUARANTINE / target, create=True) as qdir:
            os.replace(path.name, target, src_dir_fd=src, dst_dir_fd=qdir)
            if disk.durable:
                os.fsync(qdir)
    except FileNotFoundError:
        return False
    except OSError as exc:
        disk.stats.errors += 1
        log.error("posix tier %s: cannot quarantine %s (%s): %s", disk.name, path, reason, exc)
        return True
    disk.stats.corrupt += 1
    target = str(root / QUARANTINE / target)
    log.error("posix tier %s: quarantined %s -> %s: %s", disk.name, path, target, reason)
    return True


def quarantine_key(disk: Disk, key: BlockKey, reason: str) -> None:
    """Quarantine ``key``'s file: the one at its path, else one the older layout left."""
    if not move_to_quarantine(disk, disk.layout.path_of(key), reason) and disk.layout.flat:
        move_to_quarantine(disk, disk.layout.legacy_path_of(key), reason)


def apply_retired(disk: Disk, work: list[Retire]) -> None:
    """The disk work of removed packed blocks: tombstones in their packs, unlinks of emptied packs."""
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
                log.warning("posix tier %s: pack %016x not updated: %s", disk.name, pack.id, exc)


def zero(dest: IoVec) -> None:
    for seg in dest:
        seg[:] = bytes(seg.nbytes)
