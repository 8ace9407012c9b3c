"""The Posix tier's index snapshots: the whole index in one file, at clean shutdown and at intervals.

A clean shutdown writes, per root, ``<root>/index.snapshot`` (every block of that root, least
recently used first) and then ``<root>/index.clean`` (the marker), each through a
temporary file, ``fsync`` and ``rename``, the directory fsynced after. Both carry the same random
16-byte *epoch*. The next start reads the marker and removes it (durably) before it serves
anything, so:

* a crash or ``kill -9`` at any later point leaves no marker: the snapshot is never trusted and
  the tier re-adopts its files by reading their headers (in the background);
* a crash while the snapshot or marker is written leaves no marker, or a marker whose epoch is
  not the snapshot's;
* a torn, truncated or edited snapshot fails its SHA-256 or its length; an unknown version is
  not read (all of these fall back to the scan);
* a release without snapshots ignores both files (neither is a ``.blk`` file) and reads the
  block files as always. Should it run between two runs of this one, the snapshot it leaves
  stale is still used, and corrected as the tier goes: after every snapshot load the tier sweeps
  the files' headers in the background (adding blocks the snapshot lacks, dropping torn ones),
  and a block the snapshot lists whose file is gone is forgotten on its first read.

While the daemon runs it also writes *periodic* snapshots (``posix_snapshot_interval_s``), the base
a start after ``kill -9`` or a power loss loads at once instead of reading every header. Each is a
new generation: ``<root>/index.periodic.<generation>`` (same format, its own epoch), written whole
through a temporary file, then ``<root>/index.periodic`` (the periodic marker: the epoch and the
generation) replaced to name it, and only then the previous generation removed. So a crash at any
point leaves the marker naming a whole, checksummed file: the new one, or the old one (a torn new
file is a temporary one the next start's scan removes). Unlike the clean marker the periodic one is
not taken at start: it is never *trusted* as complete. After loading it the tier sweeps every header
(adding blocks written after it, dropping those removed or torn since), as after any snapshot. A
start that loads the clean snapshot makes it the next periodic generation (a rename, no copy), so
a crash soon after a clean restart still finds the newest index.

A snapshot written by someone else with a matching marker (forged) can at worst make Lookup
report blocks that are not there: every read still checks the file's header and checksum, so
nothing wrong is ever served; a missing file is forgotten on first read.

Format (little endian), in columns so a million blocks load in a few array operations:
``b"UCMISNAP"``, u32 version, u32 key length (48), 16-byte epoch, u64 count; then ``count`` keys,
``count`` u64 sizes, ``count`` f64 store times (least recently used first), ``count`` u64 pack ids
(0: a block file, :mod:`ucm_server.store.posix.packs`) and ``count`` u64 offsets of each block's
record in its pack; then the xxh3-128 checksum of all before (version 3, what this release writes).
Older versions are still read: version 1 (no pack columns) and version 2 (with them), each ending
in a SHA-256 instead, which cost a fifth of a million-block load; the checksum finds a torn or
edited file, it is no signature (whoever can write the file can compute either). A release that
knows only versions 1 and 2 rejects a version-3 snapshot and re-reads the files' headers; one that
knows only version 1 does that for versions 2 and 3 and does not read packs either.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from ucm_protocol.native import native
from ucm_server.directories import fsync_dir
from ucm_server.store.format import HEADER_SIZE
from ucm_server.store.posix.confined import open_regular
from ucm_server.store.posix.packs import MAX_MEMBERS

MAGIC = b"UCMISNAP"
VERSION = 1
PACKED_VERSION = 2
"""Version 1 plus each block's pack id and offset."""
XXH_VERSION = 3
"""Version 2's columns always, checked by xxh3-128 rather than SHA-256: the version written."""
_COLUMNS = {VERSION: 2, PACKED_VERSION: 4, XXH_VERSION: 4}
"""The 8-byte columns after the keys, by version."""
SNAPSHOT_NAME = "index.snapshot"
MARKER_NAME = "index.clean"
PERIODIC_MARKER = "index.periodic"
PERIODIC_PREFIX = "index.periodic."
_PERIODIC = struct.Struct("<16sQ")
TMP_MARK = ".tmp."
KEY_BYTES = 48
_KEY = np.dtype(f"V{KEY_BYTES}")
_HEAD = struct.Struct("<8sII16sQ")
_STEP = 65536
"""Records encoded per C-level step: a few ms each, so a write in a worker thread never holds the
interpreter for long (one ``join`` of a million keys holds it for about a second)."""


class SnapshotRejected(ValueError):
    """The snapshot is not to be trusted; the message says why (logged, then the tier scans)."""


def take_marker(root: Path) -> bytes | None:
    """The epoch of the clean-shutdown marker under ``root`` (None if there is none or it is not
    16 bytes), removed durably: from now on nothing on disk claims the snapshot is current."""
    path = root / MARKER_NAME
    try:
        epoch: bytes | None = _read_regular(root, MARKER_NAME, limit=17)
    except FileNotFoundError:
        return None
    except OSError:
        epoch = None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fsync_dir(root)
    return epoch if epoch is not None and len(epoch) == 16 else None


@dataclass(frozen=True, slots=True)
class Columns:
    """A snapshot's blocks, least recently used first: keys, sizes and store times side by side
    (as read: numpy arrays, each pack column too, zero for a block file; as written: any sequences)."""

    keys: Sequence[bytes]
    sizes: Sequence[int] | np.ndarray
    times: Sequence[float] | np.ndarray
    packs: Sequence[int] | np.ndarray | None = None
    """Each block's pack id (0: its own file); None: every block has its own file (version 1)."""
    offsets: Sequence[int] | np.ndarray | None = None
    """Each packed block's record offset in its pack."""


def write_snapshot(root: Path, blocks: Columns, *, durable: bool = True) -> None:
    """Write ``blocks`` as the snapshot of ``root``, then the marker that makes the next start trust
    it. Raises ``OSError`` (disk full, ...) with no marker left behind: the next start then scans."""
    epoch = os.urandom(16)
    _replace(root, SNAPSHOT_NAME, _encode(blocks, epoch), durable=durable)
    _replace(root, MARKER_NAME, [epoch], durable=durable)


def write_periodic(root: Path, blocks: Columns, *, durable: bool = True) -> None:
    """Write ``blocks`` as a new periodic generation of ``root``, point the periodic marker at it,
    then remove older generations. Raises ``OSError`` (disk full, ...) with the marker still naming
    the previous generation (whole), or none."""
    epoch, generation = os.urandom(16), time.time_ns()
    _replace(root, f"{PERIODIC_PREFIX}{generation}", _encode(blocks, epoch), durable=durable)
    _replace(root, PERIODIC_MARKER, [_PERIODIC.pack(epoch, generation)], durable=durable)
    _drop_generations(root, keep=generation)


def promote_clean(root: Path, epoch: bytes, *, durable: bool = True) -> None:
    """Make the clean snapshot just loaded (``epoch``, its marker already taken) the newest periodic
    generation: renamed, not copied. On ``OSError`` the previous generation stays named."""
    generation = time.time_ns()
    os.replace(root / SNAPSHOT_NAME, root / f"{PERIODIC_PREFIX}{generation}")
    if durable:
        fsync_dir(root)
    _replace(root, PERIODIC_MARKER, [_PERIODIC.pack(epoch, generation)], durable=durable)
    _drop_generations(root, keep=generation)


def read_periodic(root: Path, max_size: int, *, capacity: int = 0) -> Columns:
    """The periodic generation the periodic marker of ``root`` names, checked as
    :func:`read_snapshot` checks the clean one; :class:`SnapshotRejected` if there is none or a check
    fails."""
    try:
        mark = _read_regular(root, PERIODIC_MARKER, limit=_PERIODIC.size + 1)
    except FileNotFoundError:
        raise SnapshotRejected("no periodic snapshot") from None
    except OSError as exc:
        raise SnapshotRejected(f"cannot read {root / PERIODIC_MARKER}: {exc.strerror or exc}") from None
    if len(mark) != _PERIODIC.size:
        raise SnapshotRejected(f"periodic marker of {len(mark)} bytes, not {_PERIODIC.size} (torn)")
    epoch, generation = _PERIODIC.unpack(mark)
    return read_snapshot(root, epoch, max_size, name=f"{PERIODIC_PREFIX}{generation}", capacity=capacity)


def _read_regular(root: Path, name: str, *, limit: int = -1) -> bytes:
    """Up to ``limit`` bytes (all: -1) of ``root/name`` if it is a regular file: files under the
    data directory are not trusted, so no symlink is followed and a FIFO is refused, not waited on
    (``OSError``: ``FileNotFoundError``, :class:`~ucm_server.store.posix.confined.NotRegularFile`, ...)."""
    with os.fdopen(_open_regular(root, name), "rb") as file:
        return file.read(limit)


def _drop_generations(root: Path, *, keep: int) -> None:
    """Remove the periodic generations of ``root`` other than ``keep`` (temporary files aside)."""
    for path in root.glob(f"{PERIODIC_PREFIX}*"):
        suffix = path.name[len(PERIODIC_PREFIX) :]
        if suffix.isdigit() and int(suffix) != keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _encode(blocks: Columns, epoch: bytes) -> list[bytes | bytearray]:
    """The file's parts (header, columns, checksum of all before) for ``blocks`` under ``epoch``:
    version 3, the pack columns zero where ``blocks`` has none."""
    count = len(blocks.keys)
    keys = bytearray()
    for start in range(0, count, _STEP):  # C-level slices: another thread gets the GIL in between
        keys += b"".join(blocks.keys[start : start + _STEP])
    if len(keys) != count * KEY_BYTES:
        raise ValueError("every key must be 48 bytes")
    zeros = np.zeros(count, dtype="<u8")
    columns = [
        _column(blocks.sizes, "<u8"),
        _column(blocks.times, "<f8"),
        zeros if blocks.packs is None else _column(blocks.packs, "<u8"),
        zeros if blocks.offsets is None else _column(blocks.offsets, "<u8"),
    ]
    head = _HEAD.pack(MAGIC, XXH_VERSION, KEY_BYTES, epoch, count)
    parts: list[bytes | bytearray] = [head, keys, *(column.tobytes() for column in columns)]
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest()]


def _column(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: str) -> np.ndarray:
    """``values`` as a little-endian array (numbers from a list: converted in C, a slice at a time)."""
    if isinstance(values, np.ndarray):
        return values.astype(dtype, copy=False)
    out = np.empty(len(values), dtype=dtype)
    for start in range(0, len(values), _STEP):
        out[start : start + _STEP] = values[start : start + _STEP]
    return out


def read_snapshot(
    root: Path, epoch: bytes, max_size: int, *, name: str = SNAPSHOT_NAME, capacity: int = 0
) -> Columns:
    """The snapshot ``name`` of ``root``, checked before anything in it is trusted, in bounded memory
    (the daemon writes the file, but anything can be planted in its place):

    1. its head alone (40 bytes): magic, version, epoch, and its ``count`` against what can be
       known without reading on: the file's size must be what ``count`` records take (a lying
       count is refused unread), and ``count`` no more than the root could hold (:func:`most_blocks`);
    2. one pass over the file in chunks of :data:`CHUNK` bytes: its checksum, and every record's
       size (1 to ``max_size``; with ``capacity``, all together at most that) and time;
    3. only then the columns are built (a second pass, the values checked again: the file may
       have changed since): the index's own memory, for records that passed, each column in a few
       array operations (a million keys in one ``tolist`` of 48-byte records, not a slice each).

    :class:`SnapshotRejected` if any check fails."""
    try:
        fd = _open_regular(root, name)
    except OSError as exc:
        raise SnapshotRejected(f"cannot read {root / name}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb", buffering=0) as file:
        try:
            version, count = _check_head(file, epoch, os.fstat(fd).st_size, root, capacity)
            layout = _layout(count, _COLUMNS[version])
            end = layout[-1] + count * 8
            digest = hashlib.sha256() if version < XXH_VERSION else xxhash.xxh3_128()
            values = _Values(max_size, capacity)
            digest.update(_read(file, 0, layout[0]))
            for column, start in enumerate(layout):
                width = KEY_BYTES if column == 0 else 8
                for chunk in _chunks(file, start, count * width, width):
                    if column in (1, 2):  # sizes, times
                        values.check(column, chunk)
                    digest.update(chunk)
            if digest.digest() != _read(file, end, digest.digest_size):
                raise SnapshotRejected("checksum mismatch (torn or edited)")
            return _build(file, count, layout, _Values(max_size, capacity))
        except OSError as exc:
            raise SnapshotRejected(f"cannot read {root / name}: {exc.strerror or exc}") from None


CHUNK = 4 << 20
"""Bytes a snapshot is read in at a time while it is checked (a multiple of every column's width)."""


def most_blocks(root: Path, capacity: int, *, packed: bool) -> int:
    """The most blocks a snapshot of ``root`` may list: each takes at least one byte of the tier's
    ``capacity`` (when it has one), a header and a byte of the filesystem's space, and a file of
    its own (``packed``: or a record of a pack) on it, where the filesystem counts its files."""
    st = os.statvfs(root)
    limit = st.f_blocks * st.f_frsize // (HEADER_SIZE + 1)
    if st.f_files:
        limit = min(limit, (st.f_files - st.f_ffree) * (MAX_MEMBERS if packed else 1))
    return min(limit, capacity) if capacity else limit


def _check_head(file: BinaryIO, epoch: bytes, size: int, root: Path, capacity: int) -> tuple[int, int]:
    """The format version and the record count of a snapshot's head."""
    head = _read(file, 0, _HEAD.size) if size >= _HEAD.size else b""
    if not head:
        raise SnapshotRejected("shorter than its header")
    magic, version, key_bytes, file_epoch, count = _HEAD.unpack(head)
    if magic != MAGIC:
        raise SnapshotRejected("not an index snapshot")
    if version not in _COLUMNS or key_bytes != KEY_BYTES:
        readable = ", ".join(map(str, _COLUMNS))
        raise SnapshotRejected(
            f"format version {version} (keys of {key_bytes} B); this release reads {readable}"
        )
    if file_epoch != epoch:
        raise SnapshotRejected("its epoch is not its marker's (stale or foreign)")
    want = _HEAD.size + count * (KEY_BYTES + 8 * _COLUMNS[version]) + (16 if version == XXH_VERSION else 32)
    if size != want:
        raise SnapshotRejected(f"{size} bytes where {count} records need {want} (torn)")  # or a lying count
    most = most_blocks(root, capacity, packed=version != VERSION)
    if count > most:
        raise SnapshotRejected(f"claims {count} blocks; this root can hold at most {most} (forged)")
    return version, count


class _Values:
    """The checks of a snapshot's sizes (column 1) and times (column 2), a chunk at a time."""

    def __init__(self, max_size: int, capacity: int) -> None:
        self.max_size, self.capacity, self.total = max_size, capacity, 0

    def check(self, column: int, chunk: bytes | np.ndarray) -> None:
        values = np.frombuffer(chunk, dtype="<u8" if column == 1 else "<f8")
        if not values.size:
            return
        if column == 2:
            if not np.isfinite(values).all() or values.min() < 0 or values.max() > 1e11:
                raise SnapshotRejected("a record's time is not a time (forged)")
            return
        least, most = int(values.min()), int(values.max())
        if least < 1 or most > self.max_size:
            raise SnapshotRejected(f"a record claims {least} or {most} bytes (forged)")
        self.total += int(values.sum(dtype=np.uint64))  # each at most max_size: no overflow
        if self.capacity and self.total > self.capacity:
            raise SnapshotRejected(
                f"its blocks add up to more than the tier's capacity of {self.capacity} bytes"
            )


def _build(file: BinaryIO, count: int, layout: list[int], values: _Values) -> Columns:
    """The columns of a snapshot whose every check passed, read again (sizes and times checked
    again: the file may have been changed since): keys as ``bytes``, the rest as arrays."""
    keys: list[bytes] = []
    for chunk in _chunks(file, layout[0], count * KEY_BYTES, KEY_BYTES):
        if native is not None:  # with each hash computed while the key is in cache (the index needs it)
            keys += native.index_keys(chunk, KEY_BYTES)
        else:
            keys += np.frombuffer(chunk, dtype=_KEY).tolist()  # C-level: a bytes object per 48 bytes
    out: list[np.ndarray] = []
    for column, start in enumerate(layout[1:], 1):
        column_values = np.empty(count, dtype="<f8" if column == 2 else "<u8")
        _read_into(file, start, column_values.data.cast("B"))
        if column in (1, 2):
            values.check(column, column_values)
        out.append(column_values)
    if len(out) == 4:
        return Columns(keys, out[0], out[1], out[2], out[3])
    return Columns(keys, out[0], out[1])


def _layout(count: int, columns: int) -> list[int]:
    """Where each column of a snapshot of ``count`` records starts: the keys, then ``columns`` of
    8 bytes a record (sizes, times, and with packs their ids and offsets)."""
    return [_HEAD.size, *(_HEAD.size + count * (KEY_BYTES + 8 * n) for n in range(columns))]


def _chunks(file: BinaryIO, start: int, length: int, width: int) -> Iterator[bytes]:
    """``length`` bytes of ``file`` from ``start``, in whole records of ``width`` bytes."""
    step = CHUNK // width * width
    for at in range(start, start + length, step):
        yield _read(file, at, min(step, start + length - at))


def _read_into(file: BinaryIO, at: int, view: memoryview) -> None:
    """Fill ``view`` from ``file`` at ``at``; a file that ends first is torn."""
    done = 0
    while done < view.nbytes:
        got = os.preadv(file.fileno(), [view[done:]], at + done)
        if not got:
            raise SnapshotRejected("shorter than its header promises (torn)")
        done += got


def _read(file: BinaryIO, at: int, n: int) -> bytes:
    data = os.pread(file.fileno(), n, at)
    while len(data) < n:
        more = os.pread(file.fileno(), n - len(data), at + len(data))
        if not more:
            raise SnapshotRejected("shorter than its header promises (torn)")
        data += more
    return data


def _open_regular(root: Path, name: str) -> int:
    """``root/name`` opened read-only if it is a regular file (no symlink followed, a FIFO refused)."""
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_regular(name, os.O_RDONLY, dir_fd=dfd, shown=str(root / name))
    finally:
        os.close(dfd)


def _replace(root: Path, name: str, parts: Sequence[bytes | bytearray], *, durable: bool) -> None:
    """Write ``root/name`` whole through a temporary file and ``rename``, or leave it as it was."""
    tmp = f"{name}{TMP_MARK}{uuid.uuid4().hex[:12]}"  # a crash leaves it to the next start's scan
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
        )
        try:
            try:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)
