"""Issue #11, section 8: files on disk are data, not instructions.

Whoever can write under the data directory plants things there, and a real ``ucm-server`` must
treat them as data: a FIFO where a block file should be is skipped (start-up does not hang, stats
count it); a block file replaced by a symlink is never followed (no foreign bytes served as OK); a
header with a valid CRC claiming 1 GiB on a sparse file is quarantined, never allocated for; a
namespace, shard or quarantine directory replaced by a symlink to a directory outside the data dir
makes those writes fail per block and nothing appears outside. The DS3FS tier goes through the same
helpers (checked on a tier built in-process). Durability of new directories is checked with an
``os.fsync`` spy on a Posix tier built in-process (a power loss cannot be caused for real).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockState, SharedBuffer, UcmClient, key_digest
from ucm_protocol.keys import BlockKey, Digest, Namespace
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.format import encode_header
from ucm_server.store.posix import PosixTier
from ucm_server.testing.daemon import DaemonProcess

SIZE = 64 << 10


def _posix_daemon(tmp_path: Path, *extra: str) -> DaemonProcess:
    """A daemon whose only tier is Posix (every load and dump touches the block files)."""
    return DaemonProcess(tmp_path / "ucm", args=["--store-pipeline", "Posix", *extra])


def _block_path(d: DaemonProcess, key: bytes, namespace: bytes = NS) -> Path:
    h = key.hex()
    return d.data_dir / "blocks" / namespace.hex() / h[:2] / f"{h}.blk"


def _tier_stats(c: UcmClient, kind: str = "Posix") -> dict[str, float]:
    tier = next(t for t in c.stats().tiers if t.kind == kind)
    return dict(tier.extra)


def _files_under(path: Path) -> list[Path]:
    return [Path(dp) / f for dp, _, fs in os.walk(path) for f in fs]


def _round_trip(c: UcmClient, first: int, namespace: bytes = NS) -> None:
    """A normal dump and load still work (the daemon is alive and serving)."""
    with SharedBuffer(2 * SIZE) as src, SharedBuffer(2 * SIZE) as dst:
        src.buf[:] = os.urandom(2 * SIZE)
        r = c.wait(c.dump(namespace, blocks_in(c.register(src), 2, SIZE, first=first), wait_durable=True), 20)
        assert r.ok, r.reasons
        assert c.wait(c.load(namespace, blocks_in(c.register(dst), 2, SIZE, first=first)), 20).ok
        assert bytes(dst.buf) == bytes(src.buf)


def _dump(c: UcmClient, first: int, count: int, fill: bytes | None = None) -> bytes:
    with SharedBuffer(count * SIZE) as src:
        data = fill * (count * SIZE // len(fill)) if fill else os.urandom(count * SIZE)
        src.buf[:] = data
        r = c.wait(c.dump(NS, blocks_in(c.register(src), count, SIZE, first=first), wait_durable=True), 20)
        assert r.ok, r.reasons
        return data


def test_fifo_and_symlinks_in_the_block_tree_do_not_hang_start_up(tmp_path: Path) -> None:
    d = _posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        data = _dump(c, 0, 4)
    fifo_key, link_key = key_digest("block", 100), key_digest("block", 101)
    fifo = _block_path(d, fifo_key)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes: forever
    link = _block_path(d, link_key)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to("/etc/passwd")
    os.mkfifo(d.data_dir / "blocks" / NS.hex() / "stray.blk")

    started = time.monotonic()
    d.start(timeout_s=15)  # with the old code this never became healthy
    assert time.monotonic() - started < 10
    with d, UcmClient(d.target) as c:
        assert _tier_stats(c)["skipped_files"] == 3
        assert c.lookup(NS, [fifo_key, link_key]).hits == 0
        with SharedBuffer(4 * SIZE) as dst:
            blocks = blocks_in(c.register(dst), 4, SIZE)
            assert c.lookup(NS, [b.key for b in blocks]).hit_prefix == 4
            assert c.wait(c.load(NS, blocks), 20).ok
            assert bytes(dst.buf) == data
        _round_trip(c, 10)
        assert d.healthy()
    log = d.log_path.read_text()
    assert "skipped 2 fifo file(s)" in log and "skipped 1 symlink file(s)" in log
    assert fifo.exists() and link.is_symlink()  # reported, not touched


def test_a_symlinked_block_file_is_never_followed_on_load(tmp_path: Path) -> None:
    """Replace an indexed block file with a symlink to a valid block of the same key holding other
    bytes: the load fails for that block instead of serving the foreign bytes as OK."""
    outside = tmp_path / "outside"
    outside.mkdir()
    d = _posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        key = blocks_in(0, 1, SIZE)[0].key
        _dump(c, 0, 1, fill=b"\xee")
        path = _block_path(d, key)
        shutil.copy(path, outside / "forged.blk")  # a well-formed block for this key, other bytes
        assert c.delete(NS, [key]) == 1
        _dump(c, 0, 1, fill=b"\x11")
        path.unlink()
        path.symlink_to(outside / "forged.blk")
        with SharedBuffer(SIZE) as dst:
            r = c.wait(c.load(NS, blocks_in(c.register(dst), 1, SIZE)), 20)
            assert r.states in ([BlockState.FAILED], [BlockState.MISSING])
            assert bytes(dst.buf) != b"\xee" * SIZE
        assert c.get_blocks(NS, [key]) in ([None], [b"\x11" * SIZE])
        assert _tier_stats(c).get("skipped_files", 0) >= 1  # the load and the read each met it
        assert (outside / "forged.blk").exists()
        _round_trip(c, 10)
        assert d.healthy()


def _rss_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


def test_a_forged_1gib_header_is_corrupt_and_never_allocated(tmp_path: Path) -> None:
    """Valid CRC, 1 GiB claimed, sparse file of the promised size: quarantined at start-up."""
    d = DaemonProcess(
        tmp_path / "ucm",
        args=["--store-pipeline", "Cache|Posix", "--cache-capacity", "1536MiB", "--no-cache-prefault"],
    )
    key = key_digest("forged", 1)
    path = _block_path(d, key)
    path.parent.mkdir(parents=True)
    claimed = 1 << 30
    with path.open("wb") as f:
        f.write(encode_header(BlockKey(Namespace(NS), Digest(key)), claimed, 0x1234))
        f.truncate(128 + claimed)  # sparse: costs no disk, passes the size check
    with d, UcmClient(d.target) as c:
        assert c.lookup(NS, [key]).hits == 0
        before = _rss_kib(d.proc.pid if d.proc else 0)
        r = c.wait(c.prefetch(NS, [key]), 30)
        assert r.done
        with SharedBuffer(SIZE) as dst:  # a load of it misses too
            from ucm_client import BlockIO, Segment

            r = c.wait(c.load(NS, [BlockIO(key, (Segment(c.register(dst), 0, SIZE),))]), 20)
            assert r.states != [BlockState.OK]
        after = _rss_kib(d.proc.pid if d.proc else 0)
        assert after["VmHWM"] - before["VmHWM"] < 256 << 10, (before, after)  # KiB: far below 1 GiB
        assert d.healthy()
        _round_trip(c, 10)
    assert not path.exists()
    quarantined = list((d.data_dir / "blocks" / ".quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(path.name)
    assert "more than max_block_bytes" in d.log_path.read_text()


@pytest.mark.parametrize("level", ["namespace", "shard"])
def test_a_symlinked_directory_never_leads_writes_outside(tmp_path: Path, level: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    d = _posix_daemon(tmp_path)
    blocks_root = d.data_dir / "blocks"
    keys = [b.key for b in blocks_in(0, 8, SIZE)]
    with d, UcmClient(d.target) as c:
        if level == "namespace":
            (blocks_root / NS.hex()).symlink_to(outside, target_is_directory=True)
            victims = list(range(8))
        else:  # the shard directory of block 0 only; the others land normally
            target = _block_path(d, keys[0]).parent
            target.parent.mkdir(parents=True)
            target.symlink_to(outside, target_is_directory=True)
            victims = [i for i, k in enumerate(keys) if k.hex()[:2] == keys[0].hex()[:2]]
        with SharedBuffer(8 * SIZE) as src:
            src.buf[:] = os.urandom(8 * SIZE)
            r = c.wait(c.dump(NS, blocks_in(c.register(src), 8, SIZE), wait_durable=True), 20)
        for i, state in enumerate(r.states):
            if i in victims:
                assert state is BlockState.FAILED, (i, r.states)
                assert "symlink" in r.reasons[i], r.reasons
            else:
                assert state is BlockState.OK, (i, r.reasons)
        assert _files_under(outside) == []  # nothing written outside the data directory
        assert c.lookup(NS, [keys[i] for i in victims]).hits == 0
        assert c.delete(NS, keys) == 8 - len(victims)
        _round_trip(c, 10, namespace=key_digest("other")[:16])
        assert d.healthy()
    assert _files_under(outside) == []


def test_a_symlinked_quarantine_directory_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    d = _posix_daemon(tmp_path)
    with d, UcmClient(d.target) as c:
        _dump(c, 0, 2)
    bad = _block_path(d, blocks_in(0, 1, SIZE)[0].key)
    with bad.open("r+b") as f:  # a flipped header byte: corrupt, to be quarantined at start-up
        f.seek(60)
        f.write(b"\xff")
    (d.data_dir / "blocks" / ".quarantine").symlink_to(outside, target_is_directory=True)
    with d.start(), UcmClient(d.target) as c:
        assert c.lookup(NS, [b.key for b in blocks_in(0, 2, SIZE)]).present == [False, True]
        _round_trip(c, 10)
        assert d.healthy()
    assert _files_under(outside) == []


def test_new_directories_are_fsynced_before_a_durable_write_returns_spy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss cannot be caused here: record which directories ``os.fsync`` saw (a spy)."""
    synced: list[str] = []
    """Directories fsynced, in order (files are fsynced too, and not recorded)."""
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(str(Path(f"/proc/self/fd/{fd}").readlink()))
        real_fsync(fd)

    async def main() -> None:
        root = tmp_path / "root"
        tier = PosixTier(roots=[root], direct_io=False)
        await tier.open()
        key = BlockKey(Namespace(NS), Digest(key_digest("durable", 0)))
        h = key.digest.hex()
        ns_dir, shard = root / NS.hex(), root / NS.hex() / h[:2]
        monkeypatch.setattr(os, "fsync", spy)
        data = memoryview(bytearray(os.urandom(4096)))
        assert (await tier.write_from(key, [data])).ok
        # the parent of each created directory, and the directory holding the renamed file
        assert synced == [str(root), str(ns_dir), str(shard)]
        synced.clear()
        sibling = BlockKey(Namespace(NS), Digest(bytes.fromhex(h[:2]) + os.urandom(31)))
        assert (await tier.write_from(sibling, [data])).ok
        assert synced == [str(shard)]  # no directory created: only the rename is made durable
        await tier.close()

    asyncio.run(main())


def test_ds3fs_shares_the_protections(tmp_path: Path) -> None:
    """DS3FS reuses the Posix code: symlinked namespace dir, FIFO and forged length, in-process."""
    outside = tmp_path / "outside"
    outside.mkdir()
    mount = tmp_path / "mnt"
    mount.mkdir()

    async def main() -> None:
        tier = DS3FSTier("DS3FS", mount=mount)
        await tier.open()
        other = Namespace(key_digest("ns")[:16])
        (tier.roots[0] / other.hex()).symlink_to(outside, target_is_directory=True)
        data = memoryview(bytearray(os.urandom(4096)))
        key = BlockKey(other, Digest(key_digest("x")))
        assert not (await tier.write_from(key, [data])).ok
        assert _files_under(outside) == []
        fifo_key = BlockKey(Namespace(NS), Digest(key_digest("fifo")))
        fifo = tier.path_of(fifo_key)
        fifo.parent.mkdir(parents=True)
        os.mkfifo(fifo)
        forged_key = BlockKey(Namespace(NS), Digest(key_digest("forged")))
        forged = tier.path_of(forged_key)
        forged.parent.mkdir(parents=True, exist_ok=True)
        with forged.open("wb") as f:
            f.write(encode_header(forged_key, 1 << 30, 0))
            f.truncate(128 + (1 << 30))
        started = time.monotonic()
        assert await tier.lookup([fifo_key, forged_key]) == [None, None]
        assert time.monotonic() - started < 2
        assert tier.stats().extra.get("skipped_files") == 1
        assert not forged.exists()  # quarantined as corrupt
        await tier.close()

    asyncio.run(main())


@pytest.mark.parametrize("resolver", ["openat2", "component_walk_fault_injected"])
def test_posix_tier_refuses_planted_files_with_either_resolver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resolver: str
) -> None:
    """The same refusals whether paths resolve by ``openat2`` or, on kernels without it (simulated
    here by hiding it), by walking components: symlinked file, symlinked directory, FIFO."""
    from ucm_server.store.posix import confined

    if resolver != "openat2":
        monkeypatch.setattr(confined, "_syscall", None)
    elif confined._syscall is None:
        pytest.skip("this kernel has no openat2")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 4096)

    async def main() -> None:
        root = tmp_path / "root"
        tier = PosixTier(roots=[root], direct_io=False)
        await tier.open()
        data = memoryview(bytearray(os.urandom(4096)))
        good, link, fifo = (BlockKey(Namespace(NS), Digest(key_digest("r", i))) for i in range(3))
        for k in (good, link, fifo):
            assert (await tier.write_from(k, [data])).ok
        tier.path_of(link).unlink()
        tier.path_of(link).symlink_to(outside / "secret")
        tier.path_of(fifo).unlink()
        os.mkfifo(tier.path_of(fifo))
        dest = memoryview(bytearray(4096))
        assert (await tier.read_into(good, [dest])).ok and bytes(dest) == bytes(data)
        for k in (link, fifo):
            r = await tier.read_into(k, [dest])
            assert not r.ok and "not a regular file" in r.reason, r
        assert tier.stats().extra["skipped_files"] == 2
        evil_ns = Namespace(key_digest("evil")[:16])
        (root / evil_ns.hex()).symlink_to(outside, target_is_directory=True)
        r = await tier.write_from(BlockKey(evil_ns, Digest(key_digest("w"))), [data])
        assert not r.ok and "symlink" in r.reason, r
        assert sorted(p.name for p in outside.iterdir()) == ["secret"]
        await tier.close()

    asyncio.run(main())
