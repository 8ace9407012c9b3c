"""The Posix tier's batched read (issue #13, item 2): one tight loop per group of blocks, with every
unusual file handed to the careful per-block path. Each kind of damage or trickery planted among
good blocks: the good ones load byte-exact, the planted one gets the answer the one-block read
gives (its bytes never served, the caller's memory zeroed where the tier read into it), in both
modes (``read_many`` into daemon memory, ``read_checked_many`` into a client's)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support.blocks import NS

from ucm_client import key_digest
from ucm_protocol.keys import BlockKey
from ucm_server.store.base import BlockState
from ucm_server.store.format import encode_header, payload_checksum
from ucm_server.store.posix import PosixTier, files

SIZE = 4096
COUNT = 8
BAD = 3


def _key(i: int) -> BlockKey:
    return BlockKey(NS, key_digest("batched", i))


def _payload(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() * (SIZE // 32)


def _flip_payload(path: Path, outside: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)


def _flip_header(path: Path, outside: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[70] ^= 0x01  # inside payload_len: the header's CRC no longer matches
    path.write_bytes(raw)


def _truncate(path: Path, outside: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _other_key(path: Path, outside: Path) -> None:
    """A valid block of another key copied over this one (same size, other name in its header)."""
    data = _payload(BAD)
    header = encode_header(_key(99), SIZE, payload_checksum([memoryview(data)]))
    path.write_bytes(header + data)


def _symlink(path: Path, outside: Path) -> None:
    """A well-formed block of this key with foreign bytes, outside the root, linked in its place."""
    forged = outside / "forged.blk"
    data = b"\xee" * SIZE
    forged.write_bytes(encode_header(_key(BAD), SIZE, payload_checksum([memoryview(data)])) + data)
    path.unlink()
    path.symlink_to(forged)


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path, outside: Path) -> None:
    path.unlink()
    path.mkdir()


def _removed(path: Path, outside: Path) -> None:
    path.unlink()


DAMAGE: dict[str, tuple[Callable[[Path, Path], None], BlockState]] = {
    "payload flipped": (_flip_payload, BlockState.FAILED),
    "header flipped": (_flip_header, BlockState.FAILED),
    "truncated": (_truncate, BlockState.FAILED),
    "another key's block": (_other_key, BlockState.FAILED),
    "symlink": (_symlink, BlockState.FAILED),
    "fifo": (_fifo, BlockState.FAILED),
    "directory": (_directory, BlockState.FAILED),
    "removed": (_removed, BlockState.MISSING),
}


async def _stored(root: Path) -> PosixTier:
    t = PosixTier(roots=[root], durable=False)
    await t.open()
    await t.indexed()
    got = await t.write_many([(_key(i), [memoryview(_payload(i))]) for i in range(COUNT)])
    assert all(r.ok for r in got)
    return t


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("checked", [False, True], ids=["daemon-memory", "client-memory"])
def test_damage_among_good_blocks(tmp_path: Path, damage: str, checked: bool) -> None:
    plant, state = DAMAGE[damage]
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"

    async def main() -> None:
        t = await _stored(root)
        plant(t.path_of(_key(BAD)), outside)
        dest = [bytearray(b"\x55" * SIZE) for _ in range(COUNT)]
        items = [(_key(i), [memoryview(dest[i])]) for i in range(COUNT)]
        got = await (t.read_checked_many(items) if checked else t.read_many(items))
        for i in range(COUNT):
            if i == BAD:
                continue
            r = got[i]
            assert r is not None and r.ok, (i, r)
            assert bytes(dest[i]) == _payload(i)
        bad = got[BAD]
        if checked and damage == "payload flipped":
            # Read into client memory that does not match: "read it again through daemon memory".
            assert bad is None
        else:
            assert bad is not None and bad.state is state, bad
            assert bytes(dest[BAD]) in (bytes(SIZE), b"\x55" * SIZE)  # zeroed, or never written
        assert b"\xee" * 16 not in bytes(dest[BAD])  # the symlink's target was never read
        if damage in ("symlink", "fifo", "directory"):
            assert t.stats().extra.get("skipped_files", 0) >= 1
        if damage == "symlink":
            assert (outside / "forged.blk").exists()  # refused, not moved or removed
        await t.close()

    asyncio.run(asyncio.wait_for(main(), 30))  # a FIFO opened blocking would hang here


def test_a_good_batch_takes_only_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the tests above: with nothing unusual on disk no block goes the careful
    way (the fast loop is what the batches above tested), and with one removed file exactly one does."""
    careful: list[bytes] = []
    original = files.read_careful

    def spy(disk: files.Disk, key: BlockKey, *args: object) -> bool:
        careful.append(key)
        return original(disk, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "read_careful", spy)

    async def main() -> None:
        t = await _stored(tmp_path)
        dest = [bytearray(SIZE) for _ in range(COUNT)]
        items = [(_key(i), [memoryview(dest[i])]) for i in range(COUNT)]
        assert all(r is not None and r.ok for r in await t.read_checked_many(items))
        assert careful == []
        t.path_of(_key(BAD)).unlink()
        got = await t.read_many(items)
        assert careful == [_key(BAD)] and got[BAD].state is BlockState.MISSING
        await t.close()

    asyncio.run(main())


def test_a_4k_header_file_and_an_older_layout_file_in_one_batch(tmp_path: Path) -> None:
    """An ``O_DIRECT`` file (4 KiB header) reads on the fast path; a file one directory deeper
    (versions 1 and 2) through the careful path's fallback; both byte-exact in one batch."""

    async def main() -> None:
        t = await _stored(tmp_path)
        # Block 1 rewritten as an O_DIRECT file would be: a 4 KiB header, version 2.
        data1 = _payload(1)
        t.path_of(_key(1)).write_bytes(
            encode_header(_key(1), SIZE, payload_checksum([memoryview(data1)]), header_len=4096) + data1
        )
        # Block 2 moved to where releases before the flat layout kept it.
        legacy = t.legacy_path_of(_key(2))
        legacy.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(t.path_of(_key(2)), legacy)
        dest = [bytearray(SIZE) for _ in range(COUNT)]
        got = await t.read_many([(_key(i), [memoryview(dest[i])]) for i in range(COUNT)])
        assert all(r.ok for r in got)
        assert [bytes(d) for d in dest] == [_payload(i) for i in range(COUNT)]
        await t.close()

    asyncio.run(main())
