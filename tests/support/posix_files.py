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
            with path.open("rb") as f:
                header = decode_header(f.read(ALIGNED_HEADER_SIZE))
            return StoredBlock(path, 0, header.header_len, header.payload_len)
    for pack in sorted((root / PACK_DIR).rglob(f"*{PACK_SUFFIX}")):
        raw = pack.read_bytes()
        _, _, entries = decode_head(raw, len(raw))
        for offset, length in entries:
            head = raw[offset : offset + HEADER_SIZE]
            if head != bytes(HEADER_SIZE) and decode_header(head).key == bytes(namespace) + bytes(digest):
                return StoredBlock(pack, offset, offset + HEADER_SIZE, length)
    raise FileNotFoundError(f"block {ns}/{key} is stored nowhere under {root}")


def flip_payload_byte(block: StoredBlock, index: int = -1, mask: int = 0x01) -> None:
    """XOR byte ``index`` of the block's payload (negative: from its end) with ``mask``, in place."""
    at = block.payload_at + (index % block.payload_len)
    with block.path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def remove_block(block: StoredBlock) -> None:
    """Take the block off the disk as the daemon's own delete does: its file unlinked, or its
    record's header zeroed in its pack (the neighbours stay)."""
    if not block.packed:
        block.path.unlink()
        return
    with block.path.open("r+b") as f:
        f.seek(block.header_at)
        f.write(bytes(HEADER_SIZE))


def stored_blocks(root: Path) -> int:
    """How many blocks are on disk under the Posix root ``root``: block files outside the
    quarantine directory, and live records of pack files."""
    files = sum(1 for p in root.rglob(f"*{SUFFIX}") if QUARANTINE not in p.parts)
    records = 0
    for pack in (root / PACK_DIR).rglob(f"*{PACK_SUFFIX}"):
        raw = pack.read_bytes()
        _, _, entries = decode_head(raw, len(raw))
        records += sum(1 for offset, _ in entries if raw[offset : offset + HEADER_SIZE] != bytes(HEADER_SIZE))
    return files + records


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
