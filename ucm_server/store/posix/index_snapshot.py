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

Format (version 1, little endian), in columns so a million blocks load in C-level loops:
``b"UCMISNAP"``, u32 version, u32 key length (48), 16-byte epoch, u64 count; then ``count`` keys,
``count`` u64 sizes, ``count`` f64 store times (least recently used first); SHA-256 of all before.
Version 2 (written only when some block lives in a pack file, :mod:`ucm_server.store.posix.packs`) adds
two columns after the times: ``count`` u64 pack ids (0: a block file) and ``count`` u64 offsets of
the block's record in its pack. This release reads both; a release that reads only version 1
rejects a version-2 snapshot and re-reads the headers (it does not read packs either).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import struct
import sys
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ucm_server.api.paths import fsync_dir
from ucm_server.store.posix.confined import open_regular

MAGIC = b"UCMISNAP"
VERSION = 1
PACKED_VERSION = 2
"""Version 1 plus each block's pack id and offset."""
SNAPSHOT_NAME = "index.snapshot"
MARKER_NAME = "index.clean"
PERIODIC_MARKER = "index.periodic"
PERIODIC_PREFIX = "index.periodic."
_PERIODIC = struct.Struct("<16sQ")
TMP_MARK = ".tmp."
KEY_BYTES = 48
_HEAD = struct.Struct("<8sII16sQ")
_DIGEST = 32
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
    """A snapshot's blocks, least recently used first: keys, sizes and store times side by side."""

    keys: Sequence[bytes]
    sizes: Sequence[int]
    times: Sequence[float]
    packs: Sequence[int] | None = None
    """Each block's pack id (0: its own file); None: every block has its own file (version 1)."""
    offsets: Sequence[int] | None = None
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


def read_periodic(root: Path, max_size: int) -> Columns:
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
    return read_snapshot(root, epoch, max_size, name=f"{PERIODIC_PREFIX}{generation}")


def _read_regular(root: Path, name: str, *, limit: int = -1) -> bytes:
    """Up to ``limit`` bytes (all: -1) of ``root/name`` if it is a regular file: files under the
    data directory are not trusted, so no symlink is followed and a FIFO is refused, not waited on
    (``OSError``: ``FileNotFoundError``, :class:`~ucm_server.store.posix.confined.NotRegularFile`, ...)."""
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_regular(name, os.O_RDONLY, dir_fd=dfd, shown=str(root / name))
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as file:
        return file.read(limit)


def _drop_generations(root: Path, *, keep: int) -> None:
    """Remove the periodic generations of ``root`` other than ``keep`` (temporary files aside)."""
    for path in root.glob(f"{PERIODIC_PREFIX}*"):
        suffix = path.name[len(PERIODIC_PREFIX) :]
        if suffix.isdigit() and int(suffix) != keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _encode(blocks: Columns, epoch: bytes) -> list[bytes | bytearray]:
    """The file's parts (header, columns, SHA-256 of all before) for ``blocks`` under ``epoch``."""
    count = len(blocks.keys)
    keys, sizes, times = bytearray(), array("Q"), array("d")
    packed = blocks.packs is not None and blocks.offsets is not None
    ids, offsets = array("Q"), array("Q")
    for start in range(0, count, _STEP):  # C-level slices: another thread gets the GIL in between
        end = start + _STEP
        keys += b"".join(blocks.keys[start:end])
        sizes.extend(blocks.sizes[start:end])
        times.extend(blocks.times[start:end])
        if blocks.packs is not None and blocks.offsets is not None:
            ids.extend(blocks.packs[start:end])
            offsets.extend(blocks.offsets[start:end])
    if len(keys) != count * KEY_BYTES:
        raise ValueError("every key must be 48 bytes")
    columns: list[array[int] | array[float]] = [sizes, times, ids, offsets] if packed else [sizes, times]
    if sys.byteorder != "little":  # pragma: no cover (the format is little endian everywhere)
        for column in columns:
            column.byteswap()
    head = _HEAD.pack(MAGIC, PACKED_VERSION if packed else VERSION, KEY_BYTES, epoch, count)
    parts: list[bytes | bytearray] = [head, keys, *(column.tobytes() for column in columns)]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest()]


def read_snapshot(root: Path, epoch: bytes, max_size: int, *, name: str = SNAPSHOT_NAME) -> Columns:
    """The snapshot ``name`` of ``root``, checked whole: epoch, version, length, SHA-256, then every
    record (a size from 1 to ``max_size``, a finite time); :class:`SnapshotRejected` if any fails."""
    try:
        data = _read_regular(root, name)
    except OSError as exc:
        raise SnapshotRejected(f"cannot read {root / name}: {exc.strerror or exc}") from None
    if len(data) < _HEAD.size + _DIGEST:
        raise SnapshotRejected("shorter than its header")
    magic, version, key_bytes, file_epoch, count = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotRejected("not an index snapshot")
    if version not in (VERSION, PACKED_VERSION) or key_bytes != KEY_BYTES:
        raise SnapshotRejected(
            f"format version {version} (keys of {key_bytes} B); "
            f"this release reads {VERSION} and {PACKED_VERSION}"
        )
    if file_epoch != epoch:
        raise SnapshotRejected("its epoch is not its marker's (stale or foreign)")
    columns = 4 if version == PACKED_VERSION else 2
    end = _HEAD.size + count * (KEY_BYTES + 8 * columns)
    if len(data) != end + _DIGEST:
        raise SnapshotRejected(f"{len(data)} bytes where {count} records need {end + _DIGEST} (torn)")
    if hashlib.sha256(memoryview(data)[:end]).digest() != data[end:]:
        raise SnapshotRejected("checksum mismatch (torn or edited)")
    at = _HEAD.size + count * KEY_BYTES
    keys = [data[o : o + KEY_BYTES] for o in range(_HEAD.size, at, KEY_BYTES)]
    sizes, times, ids, offsets = array("Q"), array("d"), array("Q"), array("Q")
    sizes.frombytes(data[at : at + 8 * count])
    times.frombytes(data[at + 8 * count : at + 16 * count])
    if columns == 4:
        ids.frombytes(data[at + 16 * count : at + 24 * count])
        offsets.frombytes(data[at + 24 * count : end])
    if sys.byteorder != "little":  # pragma: no cover
        for column in (sizes, times, ids, offsets):
            column.byteswap()
    if count and (min(sizes) < 1 or max(sizes) > max_size):
        raise SnapshotRejected(f"a record claims {min(sizes)} or {max(sizes)} bytes (forged)")
    if not all(map(math.isfinite, times)) or (count and (min(times) < 0 or max(times) > 1e11)):
        raise SnapshotRejected("a record's time is not a time (forged)")
    if columns == 4:  # arrays, not lists: no million short-lived number objects
        return Columns(keys, sizes, times, ids, offsets)
    return Columns(keys, sizes, times)


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
