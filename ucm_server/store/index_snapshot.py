"""The Posix tier's index snapshot: the whole index in one file, trusted only after a clean shutdown.

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

A snapshot written by someone else with a matching marker (forged) can at worst make Lookup
report blocks that are not there: every read still checks the file's header and checksum, so
nothing wrong is ever served; a missing file is forgotten on first read.

Format (version 1, little endian): ``b"UCMISNAP"``, u32 version, u32 record size, 16-byte epoch,
u64 count; ``count`` records of 48-byte key, u64 size, f64 stored_at; SHA-256 of all before it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import struct
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

MAGIC = b"UCMISNAP"
VERSION = 1
SNAPSHOT_NAME = "index.snapshot"
MARKER_NAME = "index.clean"
TMP_MARK = ".tmp."
_HEAD = struct.Struct("<8sII16sQ")
_RECORD = struct.Struct("<48sQd")
_DIGEST = 32
CHUNK = 8192
"""Records handed over at a time while a snapshot loads (the event loop merges them between calls)."""


class SnapshotRejected(ValueError):
    """The snapshot is not to be trusted; the message says why (logged, then the tier scans)."""


def take_marker(root: Path) -> bytes | None:
    """The epoch of the clean-shutdown marker under ``root`` (None if there is none or it is not
    16 bytes), removed durably: from now on nothing on disk claims the snapshot is current."""
    path = root / MARKER_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        epoch = None
    else:
        try:
            epoch = os.read(fd, 17)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _fsync_dir(root)
    return epoch if epoch is not None and len(epoch) == 16 else None


def write_snapshot(root: Path, records: Iterable[tuple[bytes, int, float]], *, durable: bool = True) -> None:
    """Write ``records`` (key, size, stored_at; least recently used first) as the snapshot of
    ``root``, then the marker that makes the next start trust it. Raises ``OSError`` (disk full,
    ...) with no marker left behind: the next start then scans."""
    epoch = os.urandom(16)
    body = b"".join(_RECORD.pack(bytes(k), size, stored) for k, size, stored in records)
    head = _HEAD.pack(MAGIC, VERSION, _RECORD.size, epoch, len(body) // _RECORD.size)
    digest = hashlib.sha256(head)
    digest.update(body)
    _replace(root, SNAPSHOT_NAME, [head, body, digest.digest()], durable=durable)
    _replace(root, MARKER_NAME, [epoch], durable=durable)


def read_snapshot(root: Path, epoch: bytes, max_size: int) -> list[list[tuple[bytes, int, float]]]:
    """The snapshot's records in chunks of :data:`CHUNK`, checked whole (epoch, version, length,
    SHA-256, then every record: a size from 1 to ``max_size``, a finite time);
    :class:`SnapshotRejected` if any check fails."""
    chunks = list(_chunks(root, epoch))
    for chunk in chunks:
        for _key, size, stored_at in chunk:
            if not 0 < size <= max_size or not math.isfinite(stored_at) or abs(stored_at) > 1e12:
                raise SnapshotRejected(f"a record claims {size} bytes stored at {stored_at} (forged)")
    return chunks


def _chunks(root: Path, epoch: bytes) -> Iterator[list[tuple[bytes, int, float]]]:
    try:
        data = (root / SNAPSHOT_NAME).read_bytes()
    except OSError as exc:
        raise SnapshotRejected(f"cannot read {root / SNAPSHOT_NAME}: {exc.strerror or exc}") from None
    if len(data) < _HEAD.size + _DIGEST:
        raise SnapshotRejected("shorter than its header")
    magic, version, record, file_epoch, count = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotRejected("not an index snapshot")
    if version != VERSION or record != _RECORD.size:
        raise SnapshotRejected(f"format version {version} (record {record} B); this release reads {VERSION}")
    if file_epoch != epoch:
        raise SnapshotRejected("its epoch is not the clean-shutdown marker's (stale or foreign)")
    end = _HEAD.size + count * _RECORD.size
    if len(data) != end + _DIGEST:
        raise SnapshotRejected(f"{len(data)} bytes where {count} records need {end + _DIGEST} (torn)")
    if hashlib.sha256(memoryview(data)[:end]).digest() != data[end:]:
        raise SnapshotRejected("checksum mismatch (torn or edited)")
    view = memoryview(data)[_HEAD.size : end]
    step = CHUNK * _RECORD.size
    for start in range(0, len(view), step):
        yield list(_RECORD.iter_unpack(view[start : start + step]))


def _replace(root: Path, name: str, parts: list[bytes], *, durable: bool) -> None:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
