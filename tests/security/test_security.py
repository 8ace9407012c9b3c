"""Security: token auth, tenant isolation, admin rights, per-tenant quotas, TLS, no secrets in logs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.tls import self_signed, tcp_port
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient
from ucm_client.errors import PermissionDenied, Unauthenticated, Unavailable
from ucm_server.testing.daemon import DaemonProcess

TOKENS = {"alice": "tok-alice-5b2f", "bob": "tok-bob-91c3", "ops": "tok-ops-77aa"}


def _tokens_file(path: Path, quota: str | int = 0) -> Path:
    return tokens_file(
        path,
        [
            (TOKENS["alice"], "alice", {"quota": quota}),
            (TOKENS["bob"], "bob", {}),
            (TOKENS["ops"], "", {"admin": True}),
        ],
    )


@pytest.fixture
def secured(tmp_path: Path):  # type: ignore[no-untyped-def]
    tokens = _tokens_file(tmp_path / "tokens.yaml", quota="1MiB")
    args = ["--auth-tokens-file", str(tokens), "--log-level", "DEBUG"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d


def test_tokens_are_required_and_checked(secured: DaemonProcess) -> None:
    with pytest.raises(Unauthenticated, match="requires a token"):
        UcmClient(secured.target, token="").connect()
    with pytest.raises(Unauthenticated, match="unknown token"):
        UcmClient(secured.target, token="guess").connect()
    with UcmClient(secured.target, token=TOKENS["alice"]) as c:
        assert c.lookup(NS, []).hit_prefix == 0
    assert secured.healthy()  # health stays open for probes


@pytest.mark.slow
def test_tenants_never_see_each_other(secured: DaemonProcess) -> None:
    size = 64 << 10
    with (
        UcmClient(secured.target, token=TOKENS["alice"]) as alice,
        UcmClient(secured.target, token=TOKENS["bob"]) as bob,
        SharedBuffer(4 * size) as abuf,
        SharedBuffer(4 * size) as bbuf,
    ):
        abuf.buf[:] = os.urandom(4 * size)
        a_blocks = blocks_in(alice.register(abuf), 4, size)
        assert alice.wait(alice.dump(NS, a_blocks), 10).ok
        keys = [b.key for b in a_blocks]
        assert alice.lookup(NS, keys).hit_prefix == 4
        # Same namespace, same keys: bob sees nothing and loads nothing.
        assert bob.lookup(NS, keys).hit_prefix == 0
        b_blocks = blocks_in(bob.register(bbuf), 4, size)
        result = bob.wait(bob.load(NS, b_blocks), 10)
        assert [s.name for s in result.states] == ["MISSING"] * 4
        assert bytes(bbuf.buf) == bytes(4 * size)
        assert bob.delete(NS, keys) == 0
        assert alice.lookup(NS, keys).hit_prefix == 4
        # Bob cannot use alice's session, even knowing its id.
        bob.aio._session_id = alice.aio._session_id
        with pytest.raises(PermissionDenied, match="another tenant"):
            bob.check(1)


@pytest.mark.slow
def test_admin_calls_need_an_admin_token(secured: DaemonProcess) -> None:
    with UcmClient(secured.target, token=TOKENS["alice"]) as alice:
        with pytest.raises(PermissionDenied, match="Stats needs an admin token"):
            alice.stats()
    with UcmClient(secured.target, token=TOKENS["ops"]) as ops:
        assert ops.stats().store_pipeline == "Cache|Posix"


@pytest.mark.slow
def test_quota_evicts_only_the_tenants_own_oldest_blocks(secured: DaemonProcess) -> None:
    size = 64 << 10
    with (
        UcmClient(secured.target, token=TOKENS["alice"]) as alice,
        UcmClient(secured.target, token=TOKENS["bob"]) as bob,
        SharedBuffer(32 * size) as buf,
        SharedBuffer(32 * size) as bbuf,
    ):
        bob_blocks = blocks_in(bob.register(bbuf), 8, size, first=1000)
        assert bob.wait(bob.dump(NS, bob_blocks), 10).ok
        region = alice.register(buf)
        for first in range(0, 32, 4):  # 2 MiB in 256 KiB dumps against a 1 MiB quota
            assert alice.wait(
                alice.dump(NS, blocks_in(region, 4, size, first=first, offset=first * size)), 10
            ).ok
        present = alice.lookup(NS, [b.key for b in blocks_in(region, 32, size)]).present
        assert sum(present) == 16  # 1 MiB worth kept
        assert present[-16:] == [True] * 16 and not any(present[:16])  # the newest ones
        assert bob.lookup(NS, [b.key for b in bob_blocks]).hit_prefix == 8  # bob untouched


@pytest.mark.slow
def test_no_tokens_or_payload_in_logs(secured: DaemonProcess) -> None:
    marker = b"PAYLOAD-MARKER-" * 100
    with UcmClient(secured.target, token=TOKENS["alice"]) as alice, SharedBuffer(len(marker)) as buf:
        buf.buf[:] = marker
        assert alice.wait(alice.dump(NS, blocks_in(alice.register(buf), 1, len(marker))), 10).ok
    log = secured.log()
    assert "DEBUG" in log  # the most verbose level was on
    for token in TOKENS.values():
        assert token not in log
    assert "PAYLOAD-MARKER" not in log


def test_bad_tokens_file_stops_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.yaml"
    bad.write_text("tokens:\n  - {tenant: x}\n")
    with pytest.raises(RuntimeError, match=r"tokens\[0\]: needs token_sha256"):
        DaemonProcess(tmp_path / "ucm", args=["--auth-tokens-file", str(bad)]).start(timeout_s=20)


@pytest.mark.slow
def test_tls_listener(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    args = ["--listen", "localhost:0", "--tls-cert", str(cert), "--tls-key", str(key)]
    args.append("--allow-anonymous-tcp")  # no tokens, no client CA: see tests/security/test_network_admin.py
    with DaemonProcess(tmp_path / "ucm", args=args) as d, SharedBuffer(4096) as buf:
        target = f"localhost:{tcp_port(d)}"
        with UcmClient(target, tls_ca=cert) as c:
            with pytest.raises(PermissionDenied, match="local Unix-socket"):  # memory is local-only
                c.register(buf)
            data = os.urandom(4096)
            assert c.put_blocks(NS, [(b"\1" * 32, data)]).ok  # the streaming path works over TLS
            assert c.get_blocks(NS, [b"\1" * 32]) == [data]
        with pytest.raises(Unavailable):
            UcmClient(target, connect_timeout_s=1).connect()  # plaintext against TLS: refused


def test_tcp_without_tls_needs_explicit_insecure(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="needs tls_cert and tls_key, or insecure"):
        DaemonProcess(tmp_path / "a", args=["--listen", "127.0.0.1:0"]).start(timeout_s=20)
    args = ["--listen", "127.0.0.1:0", "--insecure", "--allow-anonymous-tcp"]
    with DaemonProcess(tmp_path / "b", args=args) as d:
        assert "has no TLS" in d.log()
        with UcmClient(f"127.0.0.1:{tcp_port(d)}") as c:
            assert c.lookup(NS, []).hit_prefix == 0
