"""Issue #18, section 3: blocks encrypted at rest per tenant, against real daemons.

Two tenants with their own key files, ``encrypt_tiers: Posix``: a tenant's block round-trips through
the disk (Cache evicted) while its file holds no byte of the plaintext; the default tenant's block
is stored in clear beside it (the negative control). Then as an attacker with the disk would: an
envelope moved under another block's name, another tenant's or the same tenant's (its outer header
rewritten so the tier's own checks pass), fails authentication and is never served; a restart with
another key, or without the key, makes the tenant's blocks missing, never garbage. Bad key files stop
start-up naming the file, never showing the key; the key appears in no log.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, blocks_in
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.store.format import HEADER_SIZE, decode_header, encode_header
from ucm_server.store.posix import read_block_header  # noqa: F401 (the format's reader, for reference)
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 64 << 10
ALICE, BOB, ADMIN = "tok-alice", "tok-bob", "tok-admin"
KEY_A, KEY_B, KEY_C = os.urandom(32), os.urandom(32), os.urandom(32)
PLAIN = b"the system prompt of a tenant!! " * (BLOCK // 32)  # recognisable on disk


def _key_file(path: Path, key: bytes, *, hex_form: bool = False) -> Path:
    path.write_bytes(key.hex().encode() + b"\n" if hex_form else key)
    path.chmod(0o600)
    return path


def _daemon(tmp_path: Path, alice_key: Path | None, bob_key: Path) -> DaemonProcess:
    alice_extra: dict[str, object] = {"key_file": str(alice_key)} if alice_key else {}
    tokens = tokens_file(
        tmp_path / "tokens.yaml",
        [
            (ALICE, "alice", alice_extra),
            (BOB, "bob", {"key_file": str(bob_key)}),
            (ADMIN, "", {"admin": True}),
        ],
    )
    args = ["--auth-tokens-file", str(tokens), "--encrypt-tiers", "Posix", "--cache-capacity", "8MiB"]
    return DaemonProcess(tmp_path / "ucm", args=args)


def _dump(client: UcmClient, data: bytes, first: int = 0) -> bytes:
    with SharedBuffer(BLOCK) as buf:
        region = client.register(buf)
        buf.buf[:BLOCK] = data
        (block,) = blocks_in(region, 1, BLOCK, first=first)
        assert client.wait(client.dump(NS, [block], wait_durable=True), 30).ok
        client.unregister(region)
    return block.key


def _load(client: UcmClient, digest: bytes) -> tuple[bool, bytes]:
    """(ok, bytes) of one block loaded into fresh shared memory (zeros where nothing was copied)."""
    with SharedBuffer(BLOCK) as buf:
        region = client.register(buf)
        buf.buf[:BLOCK] = bytes(BLOCK)
        from ucm_client import BlockIO, Segment

        result = client.wait(client.load(NS, [BlockIO(digest, (Segment(region, 0, BLOCK),))]), 30)
        data = bytes(buf.buf[:BLOCK])
        client.unregister(region)
    return result.ok, data


def _evict_cache(d: DaemonProcess) -> None:
    with grpc.insecure_channel(d.target) as channel:
        rpc.AdminStub(channel).Evict(
            pb.EvictRequest(tier="Cache", all=True),
            metadata=[("authorization", f"Bearer {ADMIN}")],
            timeout=10,
        )


def _files(d: DaemonProcess) -> dict[bytes, Path]:
    """Every block file by the (namespace, digest) its header names."""
    out = {}
    for path in d.data_dir.rglob("*.blk"):
        header = decode_header(path.read_bytes()[:HEADER_SIZE])
        out[bytes(header.key)] = path
    return out


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield _key_file(tmp_path / "alice.key", KEY_A), _key_file(tmp_path / "bob.key", KEY_B, hex_form=True)


def test_encrypted_blocks_round_trip_and_hold_no_plaintext_on_disk(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    with _daemon(tmp_path, *keys) as d:
        with UcmClient(d.target, token=ALICE) as alice:
            digest = _dump(alice, PLAIN)
            _evict_cache(d)
            assert _load(alice, digest) == (True, PLAIN)  # decrypted from the Posix tier
        with UcmClient(d.target, token=ADMIN) as admin:  # the default tenant: no key, in clear
            _dump(admin, PLAIN, first=7)
        stored = [p.read_bytes() for p in d.data_dir.rglob("*.blk")]
        assert len(stored) == 2
        sealed = [s for s in stored if b"UCMAEAD1" in s[: HEADER_SIZE + 8]]
        assert len(sealed) == 1 and PLAIN[:64] not in sealed[0], "alice's block is on disk in clear"
        assert any(PLAIN[:64] in s for s in stored), "negative control: the default tenant's is in clear"
        log = d.log()
        assert KEY_A.hex() not in log and KEY_B.hex() not in log


def _move_envelope(d: DaemonProcess, source: bytes, target: bytes) -> None:
    """As an attacker with the disk: copy ``source``'s block file over ``target``'s and fix the outer
    header to name ``target`` (no secret is needed: the tier's own header and checksum then pass)."""
    files = _files(d)
    (source_key,) = [k for k in files if k.endswith(source)]
    (target_key,) = [k for k in files if k.endswith(target)]
    raw = files[source_key].read_bytes()
    old = decode_header(raw[:HEADER_SIZE])
    header = encode_header(
        decode_header(files[target_key].read_bytes()[:HEADER_SIZE]).key,
        old.payload_len,
        old.checksum,
        old.created_ns,
        header_len=old.header_len,
    )
    files[target_key].write_bytes(header + raw[old.header_len :])


@pytest.mark.parametrize("victim", ["another tenant", "the same tenant"])
def test_an_envelope_moved_under_another_block_is_never_served(
    tmp_path: Path, keys: tuple[Path, Path], victim: str
) -> None:
    """The envelope binds the block's own namespace and key: moved under another tenant's block, or
    under another block of the same tenant (same key, same namespace), it fails authentication."""
    with _daemon(tmp_path, *keys) as d:
        with UcmClient(d.target, token=ALICE) as alice, UcmClient(d.target, token=BOB) as bob:
            owner, reader = (alice, bob) if victim == "another tenant" else (alice, alice)
            a = _dump(owner, PLAIN)
            other = os.urandom(BLOCK)
            b = _dump(reader, other, first=1)
            _move_envelope(d, a, b)
            _evict_cache(d)
            ok, data = _load(reader, b)
            assert not ok and data == bytes(BLOCK), f"an envelope moved under {victim}'s block was served"
            assert PLAIN[:64] not in data
            assert _load(alice, a) == (True, PLAIN)  # negative control: the original still opens


@pytest.mark.parametrize("restart_with", ["another key", "no key"])
def test_a_wrong_or_missing_key_makes_blocks_missing_not_garbage(
    tmp_path: Path, keys: tuple[Path, Path], restart_with: str
) -> None:
    with _daemon(tmp_path, *keys) as d, UcmClient(d.target, token=ALICE) as alice:
        digest = _dump(alice, PLAIN)
    other = _key_file(tmp_path / "other.key", KEY_C) if restart_with == "another key" else None
    with _daemon(tmp_path, other, keys[1]) as d, UcmClient(d.target, token=ALICE) as alice:
        ok, data = _load(alice, digest)
        assert not ok and data == bytes(BLOCK), f"{restart_with}: the block was served"
        if restart_with == "no key":  # locked: nothing of alice's is written in clear either
            with SharedBuffer(BLOCK) as buf:
                region = alice.register(buf)
                buf.buf[:BLOCK] = PLAIN
                result = alice.wait(
                    alice.dump(NS, blocks_in(region, 1, BLOCK, first=9), wait_durable=True), 30
                )
                assert not result.ok and "key_file is not configured" in result.reasons[0], result
            assert not any(PLAIN[:64] in p.read_bytes() for p in d.data_dir.rglob("*.blk"))
        with UcmClient(d.target, token=BOB) as bob:  # bob's key is unchanged: his blocks still load
            theirs = _dump(bob, PLAIN, first=3)
            _evict_cache(d)
            assert _load(bob, theirs) == (True, PLAIN)


NOBODY = 65534
BAD_KEYS = {
    "short": (b"\x01" * 31, 0o600, "expected 32 bytes or 64 hex digits"),
    "bad hex": (b"zz" * 32, 0o600, "expected 32 bytes or 64 hex digits"),
    "world readable": (os.urandom(32), 0o644, "readable by others"),
    "group writable": (os.urandom(32), 0o620, "writable by group or others"),
    "owned by another user": (os.urandom(32), 0o600, f"owned by uid {NOBODY}, not by the daemon's uid"),
    "in a directory others can write": (os.urandom(32), 0o600, "is writable by group or others"),
    "in a directory of another user": (os.urandom(32), 0o600, f"is owned by uid {NOBODY}"),
}
NEEDS_ROOT = {"owned by another user", "in a directory of another user"}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_a_bad_key_file_stops_start_up_naming_the_file(tmp_path: Path, case: str) -> None:
    """Whoever can write the key file or its directory chooses the tenant's key: such a file (and a
    short, malformed or readable one) stops start-up naming the file, never showing the key."""
    if case in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("giving a file to another uid (os.chown) needs root; CI runs as root")
    content, mode, words = BAD_KEYS[case]
    where = tmp_path / "keys"
    where.mkdir(mode=0o700)
    bad = where / "alice.key"
    bad.write_bytes(content)
    bad.chmod(mode)
    if case == "owned by another user":
        os.chown(bad, NOBODY, NOBODY)
    elif case == "in a directory others can write":
        where.chmod(0o1777)  # even sticky, like /tmp: another user could have put the file there
    elif case == "in a directory of another user":
        os.chown(where, NOBODY, NOBODY)
    d = _daemon(tmp_path, bad, _key_file(tmp_path / "bob.key", KEY_B))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    proc = subprocess.run(d.command(), capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"key_file {bad}" in proc.stderr and words in proc.stderr, proc.stderr
    assert content.hex() not in proc.stderr and "Traceback" not in proc.stderr
    # Negative control: the same key, fixed, starts.
    where.chmod(0o700)
    os.chown(where, os.geteuid(), os.getegid())
    os.chown(bad, os.geteuid(), os.getegid())
    if case in ("short", "bad hex"):
        return
    bad.chmod(0o600)
    with _daemon(tmp_path, bad, _key_file(tmp_path / "bob.key", KEY_B)) as d:
        assert d.healthy()


def test_turning_encryption_off_over_sealed_blocks_is_refused(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    with _daemon(tmp_path, *keys) as d, UcmClient(d.target, token=ALICE) as alice:
        _dump(alice, PLAIN)
    tokens = tokens_file(tmp_path / "plain.yaml", [(ALICE, "alice", {}), (ADMIN, "", {"admin": True})])
    cmd = [a for a in d.command() if a not in ("--encrypt-tiers", "Posix")]
    cmd[cmd.index("--auth-tokens-file") + 1] = str(tokens)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "sealed_tenants.json lists tenants" in proc.stderr, proc.stderr


def test_encrypt_tiers_without_keys_or_keys_without_tiers_are_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    d = _daemon(tmp_path, _key_file(tmp_path / "a.key", KEY_A), _key_file(tmp_path / "b.key", KEY_B))
    no_tiers = [a for a in d.command() if a not in ("--encrypt-tiers", "Posix")]
    proc = subprocess.run(no_tiers, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "encrypt_tiers is empty" in proc.stderr, proc.stderr
    cache = [*d.command()[:-2], "--encrypt-tiers", "Cache"]
    proc = subprocess.run(cache, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "encrypt_tiers: 'Cache' is not a tier below" in proc.stderr, proc.stderr
