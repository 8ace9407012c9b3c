"""The Posix tier's blocking checks of files at start-up, run in threads by
:mod:`~ucm_server.store.posix.recovery`: the full scan before serving, one file's check, which place
still holds a block, and the removal of interrupted writes."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from ucm_protocol.keys import BlockKey
from ucm_server.directories import make_private_dirs
from ucm_server.store.format import CorruptBlock, UnsupportedFormat
from ucm_server.store.posix.block_index import Stamp
from ucm_server.store.posix.confined import NotRegularFile
from ucm_server.store.posix.files import (
    Disk,
    move_to_quarantine,
    read_header,
    read_packed_header,
)
from ucm_server.store.posix.layout import QUARANTINE, SUFFIX, TMP_MARK, block_key
from ucm_server.store.posix.packs import (
    PackedStamp,
)

log = logging.getLogger(__name__)


def places_hold(disk: Disk, entries: list[tuple[bytes, Stamp | None]]) -> list[float | None]:
    """For each key, when the block in the place its index entry names was stored (its header's
    time), or None where that place no longer holds it (gone, another key's, torn)."""
    out: list[float | None] = []
    for key, stamp in entries:
        try:
            if isinstance(stamp, PackedStamp):
                offset = stamp.pack.offset_of(key)
                if offset is None:
                    raise FileNotFoundError(key.hex())
                header = read_packed_header(disk, stamp.pack, offset, block_key(key))
            else:
                header = read_header(disk, disk.layout.path_of(block_key(key)), block_key(key))
        except (OSError, CorruptBlock):
            out.append(None)
        else:
            out.append(header.created_ns / 1e9)
    return out


def scan_tree(disk: Disk, temp_grace_s: float) -> list[tuple[BlockKey, int, float]]:
    """Every block file under the roots whose header checks out (key, size, store time); corrupt
    ones quarantined, temporary files older than ``temp_grace_s`` removed (interrupted writes)."""
    found: list[tuple[BlockKey, int, float]] = []
    cutoff = time.time() - temp_grace_s
    for root in disk.layout.roots:
        make_private_dirs(root)
        for dirpath, dirnames, filenames in os.walk(root):
            if Path(dirpath) == root and QUARANTINE in dirnames:
                dirnames.remove(QUARANTINE)
            for fname in filenames:
                path = Path(dirpath) / fname
                if TMP_MARK in fname:
                    with contextlib.suppress(FileNotFoundError):
                        if temp_grace_s <= 0 or path.stat().st_mtime < cutoff:
                            path.unlink(missing_ok=True)  # an interrupted write: never visible, now gone
                    continue
                if fname.endswith(SUFFIX):
                    item = check_file(disk, path)
                    if item is not None:
                        found.append(item)
    return found


def check_file(disk: Disk, path: Path) -> tuple[BlockKey, int, float] | None:
    """The block in the file at ``path`` if its header checks out and names this path."""
    try:
        header = read_header(disk, path)
        if disk.layout.expected_path(header) != os.fspath(path):
            raise CorruptBlock(f"header names {header.key.hex()}, which does not live at this path")
    except UnsupportedFormat as exc:
        log.warning("posix tier %s: skipping %s: %s", disk.name, path, exc)
        return None
    except CorruptBlock as exc:
        move_to_quarantine(disk, path, str(exc))
        return None
    except NotRegularFile:
        return None  # counted and reported by files.open_block_file
    except OSError as exc:
        log.warning("posix tier %s: cannot read %s: %s", disk.name, path, exc)
        return None
    return header.key, header.payload_len, header.created_ns / 1e9


def drop_stale(dirfd: int, name: str, cutoff: float) -> None:
    """Remove the temporary file ``name`` if it was last written before ``cutoff`` (an interrupted
    write of an earlier run); a newer one belongs to a write in flight."""
    try:
        if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mtime < cutoff:
            os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
