"""Where a Posix tier keeps a block on disk, in whichever layout wrote it, for tests that change it there.

A block lives in a file of its own (``<root>/<ns>/<k[0:2]>/<key>.blk``, or one directory deeper as
releases before format version 3 wrote it) or as a record of a pack file
(``<root>/pack/<id[0:2]>/<id>.pack``: small blocks of one dump, the default). Tests that flip a
stored byte or remove a block behind the daemon's back find it with :func:`find_block` and change it
with :func:`flip_payload_byte` / :func:`remove_block`, so they test the same thing in every layout;
:func:`write_older_snapshot` leaves an index snapshot in a format older releases wrote.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from ucm_server.store.format import ALIGNED_HEADER_SIZE, HEADER_SIZE, decode_header
from ucm_server.store.posix import QUARANTINE, SUFFIX
from ucm_server.store.posix.index_snapshot import MARKER_NAME, SNAPSHOT_NAME
from ucm_server.store.posix.packs import PACK_DIR, PACK_SUFFIX, decode_head


@dataclass(frozen=True)
class StoredBlock:
    """One block's bytes on disk: ``path``, where its header starts and its payload (at
    ``payload_at``, ``payload_len`` bytes)."""

    path: Path
    header_at: int
    payload_at: int
    payload_len: int

    @property
    def packed(self) -> bool:
        return self.path.name.endswith(PACK_SUFFIX)


def find_block(root: Path, namespace: bytes, digest: bytes) -> StoredBlock:
    """The block ``namespace + digest`` under the Posix root ``root``: its own file (either
    layout), else its live record in a pack; ``FileNotFoundError`` if it is in neither."""
    ns, key = bytes(namespace).hex(), bytes(digest).hex()
    for path in (root / ns / key[:2] / f"{key}{SUFFIX}", root / ns / key[:2] / key[2:4] / f"{key}{SUFFIX}"):
        if path.is_file():
            return _in_file(path)
    for block, found in _records(root):
        if found == bytes(namespace) + bytes(digest):
            return block
    raise FileNotFoundError(f"block {ns}/{key} is stored nowhere under {root}")


def stored_copies(root: Path, digest: bytes) -> list[StoredBlock]:
    """Every stored block whose key ends in ``digest``, in any namespace (one per namespace stored)."""
    files = [_in_file(p) for p in root.rglob(f"{bytes(digest).hex()}{SUFFIX}") if QUARANTINE not in p.parts]
    return files + [block for block, key in _records(root) if key.endswith(bytes(digest))]


def all_stored(root: Path) -> list[StoredBlock]:
    """Every block under the Posix root ``root``: block files outside the quarantine directory, and
    live records of pack files."""
    files = [_in_file(p) for p in sorted(root.rglob(f"*{SUFFIX}")) if QUARANTINE not in p.parts]
    return files + [block for block, _ in _records(root)]


def stored_blocks(root: Path) -> int:
    """How many blocks are on disk under the Posix root ``root`` (see :func:`all_stored`)."""
    return len(all_stored(root))


def read_payload(block: StoredBlock) -> bytes:
    with block.path.open("rb") as f:
        f.seek(block.payload_at)
        return f.read(block.payload_len)


def flip_payload_byte(block: StoredBlock, index: int = -1, mask: int = 0x01, count: int = 1) -> None:
    """XOR ``count`` bytes of the block's payload from byte ``index`` (negative: from its end) with
    ``mask``, in place."""
    at = block.payload_at + (index % block.payload_len)
    with block.path.open("r+b") as f:
        f.seek(at)
        data = f.read(count)
        f.seek(at)
        f.write(bytes(b ^ mask for b in data))


def _in_file(path: Path) -> StoredBlock:
    with path.open("rb") as f:
        header = decode_header(f.read(ALIGNED_HEADER_SIZE))
    return StoredBlock(path, 0, header.header_len, header.payload_len)


def _records(root: Path) -> list[tuple[StoredBlock, bytes]]:
    """Every live record of the pack files under ``root``, with the key its header names."""
    found = []
    for pack in sorted((root / PACK_DIR).rglob(f"*{PACK_SUFFIX}")):
        raw = pack.read_bytes()
        _, _, entries = decode_head(raw, len(raw))
        for offset, length in entries:
            head = raw[offset : offset + HEADER_SIZE]
            if head != bytes(HEADER_SIZE):
                found.append(
                    (StoredBlock(pack, offset, offset + HEADER_SIZE, length), bytes(decode_header(head).key))
                )
    return found


def remove_block(block: StoredBlock) -> None:
    """Take the block off the disk as the daemon's own delete does: its file unlinked, or its
    record's header zeroed in its pack (the neighbours stay)."""
    if not block.packed:
        block.path.unlink()
        return
    with block.path.open("r+b") as f:
        f.seek(block.header_at)
        f.write(bytes(HEADER_SIZE))


def write_older_snapshot(
    root: Path,
    keys: list[bytes],
    sizes: list[int],
    times: list[float],
    places: list[tuple[int, int]] | None = None,
    *,
    epoch: bytes = b"E" * 16,
) -> None:
    """The clean-shutdown snapshot of ``root`` as releases before version 3 wrote it, and its
    marker: version 1 (keys, sizes, times) or, with ``places`` (each block's pack id and record
    offset, 0 for a block file), version 2; SHA-256 of all before."""
    count = len(keys)
    body = struct.pack("<8sII16sQ", b"UCMISNAP", 2 if places is not None else 1, 48, epoch, count)
    body += b"".join(keys) + struct.pack(f"<{count}Q", *sizes) + struct.pack(f"<{count}d", *times)
    if places is not None:
        body += struct.pack(f"<{count}Q", *(p for p, _ in places)) + struct.pack(
            f"<{count}Q", *(o for _, o in places)
        )
    (root / SNAPSHOT_NAME).write_bytes(body + hashlib.sha256(body).digest())
    (root / MARKER_NAME).write_bytes(epoch)
