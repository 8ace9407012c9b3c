"""Issue #18, section 1: pin, TTL and priority, enforced in every tier, against real daemons.

Each rule is checked with a negative control beside it: the pinned blocks survive pressure that
evicts their unpinned neighbours of the same dump; an expired block leaves the Cache, the Posix
tier and its file on disk while a block without a TTL stays; a low-priority block goes before an
older one of default priority. A pin is held where the block durably lives: pins four times the
Cache hold on disk and read back whole, while a pinned block the Cache alone holds (its write-down
failed) never leaves it. Pins and TTLs outlive a restart (clean and ``kill -9``); a pin past a
tenant's quota is refused whole; contradictory or out-of-range changes get INVALID_ARGUMENT naming
the field; a tier that cannot hold a pin (a shared one) is named, and ``require_all_tiers`` refuses.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in, dump_random
from support.tokens import tokens_file
from test_admin import admin, json_of

from ucm_client import BlockIO, SharedBuffer, UcmClient
from ucm_client.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 64 << 10
SMALL = ["--cache-capacity", "1MiB", "--cache-page-size", "64KiB", "--posix-capacity", "2MiB"]
"""16 blocks fit the Cache, 32 the Posix tier."""


@pytest.fixture
def small(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "ucm", args=SMALL) as d:
        yield d


def dump(client: UcmClient, buf: SharedBuffer, first: int, count: int) -> list[BlockIO]:
    """``count`` blocks keyed ``first...``, written through to the Posix tier."""
    region = client.register(buf)
    blocks: list[BlockIO] = []
    for start in range(0, count, 8):  # a few at a time: pressure builds up as it would in service
        n = min(8, count - start)
        buf.buf[: n * BLOCK] = os.urandom(n * BLOCK)
        batch = blocks_in(region, n, BLOCK, first=first + start)
        assert client.wait(client.dump(NS, batch, wait_durable=True), 30).ok
        blocks += batch
    client.unregister(region)
    return blocks


def where(d: DaemonProcess, digest: bytes) -> tuple[list[str], pb.Retention | None]:
    """The tiers holding the block (admin Inspect) and its retention; ``([], None)`` when in none."""
    with grpc.insecure_channel(d.target) as channel:
        try:
            info = (
                rpc.AdminStub(channel).Inspect(pb.InspectRequest(namespace=NS, key=digest), timeout=10).block
            )
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.NOT_FOUND, exc
            return [], None
    return list(info.tiers), info.retention


def keys_of(blocks: list[BlockIO]) -> list[bytes]:
    return [b.key for b in blocks]


def test_pinned_blocks_survive_pressure_in_cache_and_posix(small: DaemonProcess) -> None:
    with UcmClient(small.target) as client, SharedBuffer(8 * BLOCK) as buf:
        first = dump(client, buf, 0, 8)
        pinned, plain = keys_of(first[:4]), keys_of(first[4:])
        r = client.set_retention(NS, pinned, pin=True)
        assert (r.applied, r.missing, r.not_enforced) == (4, 0, [])
        dump(client, buf, 100, 64)  # twice the Posix tier, four times the Cache
        for key in pinned:
            tiers, retention = where(small, key)
            assert tiers == ["Cache", "Posix"], "a pinned block was evicted"
            assert retention is not None and retention.pinned
        for key in plain:  # negative control: their unpinned neighbours of the same dump are gone
            assert where(small, key) == ([], None)
        assert client.lookup(NS, pinned).hits == 4
        # Unpinned, they are evicted like any other block.
        assert client.set_retention(NS, pinned, pin=False).applied == 4
        dump(client, buf, 200, 64)
        assert client.lookup(NS, pinned).hits == 0


def test_pins_fill_the_posix_tier_then_writes_are_refused_there_not_the_pins_evicted(tmp_path: Path) -> None:
    # Pins take a whole tier only where the operator lets them (no reserve, no per-principal share):
    # see tests/security/test_pin_fairness.py for the defaults, which keep room for everyone else.
    # The Cache is half the Posix tier: it holds a pin only until the block is safe on disk.
    args = [*SMALL, "--pin-reserve", "0", "--pin-share", "1"]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as small,
        UcmClient(small.target) as client,
        SharedBuffer(8 * BLOCK) as buf,
    ):
        keys: list[bytes] = []
        for first in range(0, 32, 8):
            keys += keys_of(dump(client, buf, first, 8))
        assert client.set_retention(NS, keys, pin=True).applied == 32  # the whole Posix tier
        region = client.register(buf)
        extra = blocks_in(region, 1, BLOCK, first=500)
        result = client.wait(client.dump(NS, extra, wait_durable=True), 30)
        assert not result.ok and "pinned" in result.reasons[0], result.reasons
        assert client.lookup(NS, keys).hits == 32


def test_pins_four_times_the_cache_are_held_on_disk_and_read_back_whole(tmp_path: Path) -> None:
    # A Cache of 16 blocks above a Posix tier with room: the pins live on disk, not in the Cache.
    args = ["--cache-capacity", "1MiB", "--cache-page-size", "64KiB"]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target) as client,
        SharedBuffer(8 * BLOCK) as buf,
    ):
        pinned = dump_random(client, 0, 64, BLOCK)
        r = client.set_retention(NS, list(pinned), pin=True)  # 4 MiB of pins, a 1 MiB Cache
        assert (r.applied, r.missing, r.not_enforced) == (64, 0, [])
        dump(client, buf, 100, 64)  # pressure: four times the Cache
        cached = [k for k in pinned if where(d, k)[0] == ["Cache", "Posix"]]
        assert len(cached) < 16, "the Cache kept pinned blocks safe on disk over newer unpinned ones"
        for key in pinned:
            tiers, retention = where(d, key)
            assert "Posix" in tiers and retention is not None and retention.pinned
        assert client.get_blocks(NS, list(pinned)) == list(pinned.values()), "a pinned block was lost"


def _pressure_not_written_down(client: UcmClient, buf: SharedBuffer) -> None:
    """64 new blocks, four times the Cache, whose write-downs fail (the Posix tier is full of pins)."""
    for first in range(1000, 1064, 8):
        region = client.register(buf)
        buf.buf[:] = os.urandom(8 * BLOCK)
        assert client.wait(client.dump(NS, blocks_in(region, 8, BLOCK, first=first)), 30).ok
        client.unregister(region)


def _cached(d: DaemonProcess, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if "Cache" in where(d, k)[0]]


def _write_backs_done(client: UcmClient) -> None:
    while client.stats().pending_writeback:
        time.sleep(0.01)


@pytest.fixture
def posix_full_of_pins(tmp_path: Path) -> Iterator[tuple[DaemonProcess, UcmClient, dict[bytes, bytes]]]:
    """A daemon whose Posix tier is full of pinned blocks (the operator let pins take it all), so
    no write-down succeeds there; its client and the pinned blocks' bytes."""
    args = [*SMALL, "--pin-reserve", "0", "--pin-share", "1"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target) as client:
        on_disk = dump_random(client, 0, 32, BLOCK)
        assert client.set_retention(NS, list(on_disk), pin=True).applied == 32  # the whole Posix tier
        yield d, client, on_disk


def test_a_pinned_block_the_cache_alone_holds_is_never_evicted_from_it(
    posix_full_of_pins: tuple[DaemonProcess, UcmClient, dict[bytes, bytes]],
) -> None:
    # A new block's write-down fails in the Posix tier full of pins: once pinned, the Cache is
    # the block's only home.
    d, client, on_disk = posix_full_of_pins
    with SharedBuffer(8 * BLOCK) as buf:
        region = client.register(buf)
        buf.buf[:BLOCK] = only = os.urandom(BLOCK)
        (block,) = blocks_in(region, 1, BLOCK, first=500)
        assert client.wait(client.dump(NS, [block]), 30).ok  # in the Cache; its write-down fails
        client.unregister(region)
        _write_backs_done(client)
        assert where(d, block.key)[0] == ["Cache"]
        first = next(iter(on_disk))
        assert client.set_retention(NS, [first], pin=False).applied == 1  # room in the budget
        assert client.set_retention(NS, [block.key], pin=True).applied == 1
        still = [k for k in on_disk if k != first]
        cached = _cached(d, still)
        client.get_blocks(NS, cached)  # used after it: the block is the least recently used pin
        _pressure_not_written_down(client, buf)
        assert where(d, block.key)[0] == ["Cache"], "the Cache evicted the only copy of a pinned block"
        assert client.get_blocks(NS, [block.key]) == [only]
        # Negative control: pinned blocks safe on disk did leave the Cache for the new ones.
        assert len(_cached(d, still)) < len(cached)
        assert all("Posix" in where(d, k)[0] for k in still)
        assert client.get_blocks(NS, still) == [on_disk[k] for k in still]


def test_a_pinned_block_rewritten_but_not_written_down_stays_in_the_cache(
    posix_full_of_pins: tuple[DaemonProcess, UcmClient, dict[bytes, bytes]],
) -> None:
    # The pinned block's new version cannot reach the Posix tier (full of pins): the older version
    # stays there, and the Cache's copy is the block. Evicting it would serve the old bytes.
    d, client, on_disk = posix_full_of_pins
    with SharedBuffer(8 * BLOCK) as buf:
        key = next(iter(on_disk))
        assert client.put_blocks(NS, [(key, new := os.urandom(BLOCK))]).ok  # its write-down fails
        _write_backs_done(client)
        others = [k for k in on_disk if k != key]
        cached = _cached(d, others)
        client.get_blocks(NS, cached)  # used after it: the block is the least recently used pin
        _pressure_not_written_down(client, buf)
        assert where(d, key)[0] == ["Cache", "Posix"], "the Cache evicted a pinned block's only new copy"
        assert client.get_blocks(NS, [key]) == [new]
        assert len(_cached(d, others)) < len(cached)  # negative control: pins safe on disk left it


def test_ttl_expiry_removes_blocks_from_every_tier_and_disk(small: DaemonProcess) -> None:
    with UcmClient(small.target) as client, SharedBuffer(8 * BLOCK) as buf:
        blocks = keys_of(dump(client, buf, 0, 4))
        files_before = sorted(p.name for p in small.data_dir.rglob("*.blk"))
        assert len(files_before) == 4
        r = client.set_retention(NS, blocks[:2], ttl_s=1.0)
        assert r.applied == 2
        _, retention = where(small, blocks[0])
        assert retention is not None and time.time() < retention.expires_at < time.time() + 1.5
        time.sleep(1.3)
        assert client.lookup(NS, blocks).present == [False, False, True, True]  # at once, not next sweep
        for key in blocks[:2]:
            assert where(small, key) == ([], None)
        assert where(small, blocks[2])[0] == ["Cache", "Posix"]  # negative control: no TTL, kept
        assert len(list(small.data_dir.rglob("*.blk"))) == 2
        # The background sweep expires blocks nobody asks about.
        client.set_retention(NS, [blocks[2]], ttl_s=0.5)
        time.sleep(2.0)
        assert where(small, blocks[2]) == ([], None)
        assert client.stats().expired_blocks == 3
        # A TTL cleared in time keeps the block.
        client.set_retention(NS, [blocks[3]], ttl_s=0.5)
        client.set_retention(NS, [blocks[3]], ttl_s=0)
        time.sleep(1.5)
        assert where(small, blocks[3])[0] == ["Cache", "Posix"]


@pytest.mark.parametrize("how", ["clean", "kill"])
def test_pins_and_ttls_survive_a_restart(tmp_path: Path, how: str) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=SMALL).start()
    try:
        with UcmClient(d.target) as client, SharedBuffer(8 * BLOCK) as buf:
            blocks = keys_of(dump(client, buf, 0, 8))
            client.set_retention(NS, blocks[:2], pin=True, priority=7)
            client.set_retention(NS, blocks[2:4], ttl_s=3.0)
        if how == "kill":
            d.kill()
        else:
            d.stop()
        d.start()
        assert where(d, blocks[0])[1] == pb.Retention(pinned=True, priority=7)
        assert where(d, blocks[2])[1].expires_at > 0  # type: ignore[union-attr]
        with UcmClient(d.target) as client, SharedBuffer(8 * BLOCK) as buf:
            dump(client, buf, 100, 64)  # pressure after the restart
            assert client.lookup(NS, blocks[:2]).hits == 2, "a pin was lost in the restart"
            assert client.lookup(NS, blocks[4:8]).hits == 0  # negative control
            time.sleep(max(0.0, 3.5 - 0.0))
            assert client.lookup(NS, blocks[2:4]).hits == 0  # expired (evicted too, by now)
    finally:
        d.stop()


def test_low_priority_goes_first_high_priority_last(small: DaemonProcess) -> None:
    with UcmClient(small.target) as client, SharedBuffer(8 * BLOCK) as buf:
        blocks = keys_of(dump(client, buf, 0, 16))  # the Posix tier half full, the Cache full
        oldest, newest = blocks[0], blocks[15]
        client.set_retention(NS, [newest], priority=-5)  # newest, but evicted before older ones
        client.set_retention(NS, [oldest], priority=5)  # oldest, but kept over newer ones
        dump(client, buf, 100, 20)  # overflows the Posix tier by 4 blocks
        assert where(small, newest) == ([], None), "a low-priority block outlived default ones"
        assert "Posix" in where(small, oldest)[0], "a high-priority block went before default ones"
        # Default blocks newer than the high-priority one went instead of it (which ones follows the
        # write-back's order, and write-back writes a batch's files in parallel).
        assert client.lookup(NS, blocks[1:15]).hits < 14


def test_bad_changes_are_refused_with_the_field_named(small: DaemonProcess) -> None:
    with grpc.insecure_channel(small.target) as channel:
        stub = rpc.KVStoreStub(channel)
        key = b"\x01" * 32
        cases = [
            (pb.SetRetentionRequest(namespace=NS, keys=[key], pin=True, unpin=True), "pin and unpin"),
            (
                pb.SetRetentionRequest(namespace=NS, keys=[key], ttl_s=5, clear_ttl=True),
                "ttl_s and clear_ttl",
            ),
            (pb.SetRetentionRequest(namespace=NS, keys=[key], ttl_s=-1), "ttl_s"),
            (pb.SetRetentionRequest(namespace=NS, keys=[key], ttl_s=1e12), "ttl_s"),
            (pb.SetRetentionRequest(namespace=NS, keys=[key], set_priority=True, priority=500), "priority"),
            (pb.SetRetentionRequest(namespace=NS, keys=[key]), "nothing to change"),
            (pb.SetRetentionRequest(namespace=NS, keys=[], pin=True), "empty batch"),
            (pb.SetRetentionRequest(namespace=b"x", keys=[key], pin=True), "namespace"),
            (pb.SetRetentionRequest(namespace=NS, keys=[b"short"], pin=True), "32 bytes"),
        ]
        for request, words in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.SetRetention(request, timeout=10)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (request, err.value)
            assert words in (err.value.details() or ""), (words, err.value.details())
    assert small.healthy()
    with UcmClient(small.target) as client:  # keys stored nowhere: counted, nothing recorded
        r = client.set_retention(NS, [b"\x02" * 32], pin=True)
        assert (r.applied, r.missing) == (0, 1)
        with pytest.raises(InvalidArgument, match="priority"):
            client.set_retention(NS, [b"\x02" * 32], priority=-101)


def test_a_shared_tier_is_named_and_require_all_tiers_refuses(tmp_path: Path) -> None:
    config = tmp_path / "ucm.yaml"
    mount = tmp_path / "3fs"
    mount.mkdir()
    config.write_text(
        f"store_pipeline: Cache|DS3FS\ntier_settings:\n  DS3FS: {{mount: {mount}, usrbio: 'off'}}\n"
    )
    with (
        DaemonProcess(tmp_path / "ucm", args=["--config", str(config), "--cache-capacity", "4MiB"]) as d,
        UcmClient(d.target) as client,
        SharedBuffer(8 * BLOCK) as buf,
    ):
        blocks = keys_of(dump(client, buf, 0, 2))
        r = client.set_retention(NS, blocks, pin=True)
        assert r.applied == 2 and len(r.not_enforced) == 1 and r.not_enforced[0].startswith("DS3FS: a shared")
        with pytest.raises(FailedPrecondition, match="DS3FS"):
            client.set_retention(NS, blocks, pin=True, require_all_tiers=True)
        r = client.set_retention(NS, blocks, ttl_s=0.5)  # a TTL holds everywhere: deleting is ours
        assert r.not_enforced == []
        time.sleep(1.0)
        assert client.lookup(NS, blocks).hits == 0
        assert not list(mount.rglob("*.blk")), "the expired block stayed on the shared tier"


ADMIN, ALICE = "tok-admin", "tok-alice"


def _tenant_daemon(tmp_path: Path, quota: str) -> DaemonProcess:
    tokens = tokens_file(
        tmp_path / "tokens.yaml", [(ADMIN, "", {"admin": True}), (ALICE, "alice", {"quota": quota})]
    )
    return DaemonProcess(
        tmp_path / "ucm", args=["--auth-tokens-file", str(tokens), "--cache-capacity", "64MiB"]
    )


def test_pins_count_against_the_quota_and_survive_quota_pressure(tmp_path: Path) -> None:
    d = _tenant_daemon(tmp_path, "1MiB").start()
    try:
        with UcmClient(d.target, token=ALICE) as alice, SharedBuffer(8 * BLOCK) as buf:
            first = keys_of(dump(alice, buf, 0, 8))  # 512 KiB of a 1 MiB quota
            assert alice.set_retention(NS, first[:6], pin=True).applied == 6  # 384 KiB pinned
            dump(alice, buf, 100, 64)  # 4 MiB through the 1 MiB quota
            assert alice.lookup(NS, first[:6]).hits == 6, "quota eviction took a pinned block"
            assert alice.lookup(NS, first[6:]).hits == 0  # negative control
            recent = keys_of(blocks_in(0, 1, BLOCK, first=163))
            assert alice.lookup(NS, recent).hits == 1
        d.stop()
        # The operator lowers the quota below what is pinned: pins stay, but no more pins and no
        # block that does not fit beside them.
        d = _tenant_daemon(tmp_path, "256KiB").start()
        with UcmClient(d.target, token=ALICE) as alice, SharedBuffer(8 * BLOCK) as buf:
            assert alice.lookup(NS, first[:6]).hits == 6
            with pytest.raises(
                ResourceExhausted, match=r"would pin 458752 bytes of tenant alice, above its quota"
            ):
                alice.set_retention(NS, recent, pin=True)
            region = alice.register(buf)
            with pytest.raises(ResourceExhausted, match="pinned"):
                alice.dump(NS, blocks_in(region, 1, BLOCK, first=900))
            assert alice.set_retention(NS, first[:6], pin=False).applied == 6
            assert alice.wait(alice.dump(NS, blocks_in(region, 1, BLOCK, first=900)), 30).ok
            assert alice.set_retention(NS, recent, pin=True).applied == 1  # within the quota now
    finally:
        d.stop()


def test_a_torn_last_rule_is_skipped_and_other_damage_stops_start_up(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "ucm", args=SMALL)
    with d, UcmClient(d.target) as client, SharedBuffer(8 * BLOCK) as buf:
        blocks = keys_of(dump(client, buf, 0, 2))
        client.set_retention(NS, blocks[:1], pin=True)
    rules = d.data_dir / "retention.json"
    with rules.open("ab") as f:
        f.write(b'{"set": {"00ff')  # an append cut by a crash
    with d:
        assert "skipping a torn last line" in d.log()
        assert where(d, blocks[0])[1] == pb.Retention(pinned=True)
    assert b"00ff" not in rules.read_bytes()  # compacted at start-up
    rules.write_text(rules.read_text() + "not json\n" + rules.read_text())
    proc = subprocess.run(
        [*d.command()],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("UCM_")},
    )
    assert proc.returncode == 2, proc.stderr
    assert f"retention rules {rules}, line 2" in proc.stderr and "move it aside" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ucm_admin_pin_unpin_ttl_priority_and_ls_inspect_show_them(small: DaemonProcess) -> None:
    with UcmClient(small.target) as client, SharedBuffer(8 * BLOCK) as buf:
        blocks = [f"{NS.hex()}/{k.hex()}" for k in keys_of(dump(client, buf, 0, 3))]
    proc = admin(small, "--json", "pin", "--priority", "9", blocks[0])
    assert proc.returncode == 0, proc.stderr
    assert json_of(proc) == {"requested": 1, "applied": 1, "not_found": 0, "not_enforced": []}
    assert admin(small, "ttl", "600", blocks[1]).returncode == 0
    stats = json_of(admin(small, "--json", "stats"))
    assert (stats["pinned_blocks"], stats["retention_rules"], stats["expired_blocks"]) == (1, 2, 0)
    assert admin(small, "priority", "--", "-3", blocks[2]).returncode == 0
    listed = {b["key"]: b for b in json_of(admin(small, "--json", "ls"))["blocks"]}
    assert (listed[blocks[0]]["pinned"], listed[blocks[0]]["priority"]) == (True, 9)
    assert listed[blocks[0]]["expires_at"] is None
    assert time.time() + 590 < listed[blocks[1]]["expires_at"] < time.time() + 610
    assert (listed[blocks[1]]["pinned"], listed[blocks[2]]["priority"]) == (False, -3)
    human = admin(small, "inspect", blocks[0]).stdout
    assert "pinned, priority 9" in human
    assert "expires" in admin(small, "ls").stdout
    # unpin and never: back to plain
    assert admin(small, "unpin", blocks[0]).returncode == 0
    assert admin(small, "ttl", "never", blocks[1]).returncode == 0
    listed = {b["key"]: b for b in json_of(admin(small, "--json", "ls"))["blocks"]}
    assert not listed[blocks[0]]["pinned"] and listed[blocks[1]]["expires_at"] is None
    # a key stored nowhere: exit 1, unless --missing-ok; a bad priority: the daemon's reason
    absent = f"{NS.hex()}/{'ab' * 32}"
    proc = admin(small, "pin", absent)
    assert proc.returncode == 1 and "not stored" in proc.stderr
    assert admin(small, "pin", "--missing-ok", absent).returncode == 0
    proc = admin(small, "priority", "500", blocks[0])
    assert proc.returncode != 0 and "priority must be between -100 and 100" in proc.stderr
    proc = admin(small, "ttl", "soon", blocks[0])
    assert proc.returncode != 0 and "soon" in proc.stderr


def test_a_daemon_with_the_arc_cache_keeps_pins_and_serves(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "ucm", args=[*SMALL, "--cache-eviction", "arc"]) as d,
        UcmClient(d.target) as client,
        SharedBuffer(8 * BLOCK) as buf,
    ):
        pinned = keys_of(dump(client, buf, 0, 4))
        client.set_retention(NS, pinned, pin=True)
        dump(client, buf, 100, 64)
        assert where(d, pinned[0])[0] == ["Cache", "Posix"]


def test_a_tenant_cannot_pin_or_expire_another_tenants_blocks(tmp_path: Path) -> None:
    tokens = tokens_file(
        tmp_path / "tokens.yaml",
        [(ADMIN, "", {"admin": True}), (ALICE, "alice", {}), ("tok-mallory", "mallory", {})],
    )
    args = ["--auth-tokens-file", str(tokens), *SMALL]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target, token=ALICE) as alice,
        UcmClient(d.target, token="tok-mallory") as mallory,
        SharedBuffer(8 * BLOCK) as buf,
    ):
        theirs = keys_of(dump(alice, buf, 0, 2))
        # Mallory names alice's digests in alice's namespace: they resolve to mallory's own (empty)
        # namespace, so nothing is found, nothing recorded, and alice's blocks keep their state.
        r = mallory.set_retention(NS, theirs, ttl_s=0.1)
        assert (r.applied, r.missing) == (0, 2)
        time.sleep(1.5)
        assert alice.lookup(NS, theirs).hits == 2
        assert alice.set_retention(NS, theirs, pin=True).applied == 2  # negative control: the owner can
