"""No anonymous network admin.

Each test starts a real ``ucm-server`` with a TCP listener and calls it as a network peer would, over
real TLS (certificates made here with ``cryptography``): a listener that would let peers in without
a token or client certificate refuses to start (exit 2, naming the settings to add) unless
``allow_anonymous_tcp`` is given; with it, the daemon warns at start and an anonymous TCP peer still
gets PERMISSION_DENIED for every Admin call (Stats, Evict, Verify) while its KVStore calls work. With
tokens, only an admin token may call Admin over TCP; over the Unix socket admin works as before.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS
from support.tls import self_signed, tcp_port
from support.tokens import tokens_file

from ucm_client import UcmClient, key_digest
from ucm_client.errors import PermissionDenied
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

ADMIN_TOKEN, TENANT_TOKEN = "tok-ops-net-1", "tok-team-net-2"


def _server_cmd(tmp_path: Path, *args: str, **ucm_env: str) -> subprocess.CompletedProcess[str]:
    """``ucm-server`` run to completion (refusing to start, or with ``--print-config``)."""
    cmd = [sys.executable, "-m", "ucm_server", "--socket", str(tmp_path / "s" / "ucm.sock")]
    cmd += ["--data-dir", str(tmp_path / "data"), "--metrics-address", "off", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")} | ucm_env
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def tls(tmp_path: Path) -> tuple[Path, Path]:
    return self_signed(tmp_path)


@pytest.fixture
def anonymous_tls(tmp_path: Path, tls: tuple[Path, Path]) -> Iterator[tuple[DaemonProcess, str]]:
    """A TLS listener with neither tokens nor a client CA, explicitly allowed."""
    cert, key = tls
    args = [
        "--listen",
        "localhost:0",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--allow-anonymous-tcp",
    ]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d, f"localhost:{tcp_port(d)}"


def _admin_calls(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()
) -> dict[str, grpc.RpcError | None]:
    """Stats, Evict everything, Verify: the error each one got (None = it was allowed)."""
    admin = rpc.AdminStub(channel)
    calls = {
        "Stats": lambda: admin.Stats(pb.StatsRequest(), metadata=metadata, timeout=10),
        "Evict": lambda: admin.Evict(pb.EvictRequest(tier="Cache", all=True), metadata=metadata, timeout=10),
        "Verify": lambda: list(admin.Verify(pb.VerifyRequest(), metadata=metadata, timeout=10)),
    }
    out: dict[str, grpc.RpcError | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except grpc.RpcError as exc:
            out[name] = exc
    return out


def test_tls_listener_without_credentials_refuses_to_start(tmp_path: Path, tls: tuple[Path, Path]) -> None:
    cert, key = tls
    proc = _server_cmd(tmp_path, "--listen", "localhost:0", "--tls-cert", str(cert), "--tls-key", str(key))
    assert proc.returncode == 2, proc.stderr
    for setting in ("auth_tokens_file", "tls_client_ca", "allow_anonymous_tcp"):
        assert setting in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s" / "ucm.sock").exists()  # nothing was served, not even the Unix socket


def test_plaintext_tcp_without_credentials_needs_the_anonymous_opt_in_too(tmp_path: Path) -> None:
    proc = _server_cmd(tmp_path, "--listen", "127.0.0.1:0", "--insecure")
    assert proc.returncode == 2, proc.stderr
    assert "allow_anonymous_tcp" in proc.stderr and "Traceback" not in proc.stderr
    # The opt-in is a setting like any other: also a UCM_* variable (and a YAML key).
    opted_in = _server_cmd(
        tmp_path, "--listen", "127.0.0.1:0", "--insecure", "--print-config", UCM_ALLOW_ANONYMOUS_TCP="1"
    )
    assert opted_in.returncode == 0, opted_in.stderr
    assert "allow_anonymous_tcp: true" in opted_in.stdout


@pytest.mark.slow
def test_anonymous_tcp_peer_is_never_admin(
    anonymous_tls: tuple[DaemonProcess, str], tls: tuple[Path, Path]
) -> None:
    d, target = anonymous_tls
    assert re.search(r"WARNING .*accepts anonymous peers \(allow_anonymous_tcp: true\)", d.log())
    creds = grpc.ssl_channel_credentials(tls[0].read_bytes())
    with UcmClient(d.target) as local:  # a local block the anonymous peer will try to evict
        local.put_blocks(NS, [(key_digest("keep", 0), b"k" * 4096)])
    with grpc.secure_channel(target, creds) as channel:
        results = _admin_calls(channel)
    for name, err in results.items():
        assert err is not None, f"{name} was allowed to an anonymous TCP peer"
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (name, err)
        assert "anonymous TCP peer" in (err.details() or "")
    # The KVStore works for it (default tenant), over the streaming-bytes path.
    with UcmClient(target, tls_ca=tls[0]) as remote:
        data = os.urandom(8192)
        assert remote.put_blocks(NS, [(key_digest("net", 1), data)]).ok
        assert remote.get_blocks(NS, [key_digest("net", 1)]) == [data]
        assert remote.lookup(NS, [key_digest("keep", 0)]).hit_prefix == 1  # nothing was evicted
        with pytest.raises(PermissionDenied):
            remote.stats()
    # Over the Unix socket the same daemon still answers Admin calls.
    with grpc.insecure_channel(d.target) as channel:
        local_results = _admin_calls(channel)
    assert local_results == {"Stats": None, "Evict": None, "Verify": None}
    assert d.healthy()


def _tokens(path: Path) -> Path:
    return tokens_file(path, [(ADMIN_TOKEN, "", {"admin": True}), (TENANT_TOKEN, "team", {})])


@pytest.mark.slow
def test_with_tokens_only_an_admin_token_is_admin_over_tcp(tmp_path: Path, tls: tuple[Path, Path]) -> None:
    cert, key = tls
    tokens = _tokens(tmp_path / "tokens.yaml")
    args = ["--listen", "localhost:0", "--tls-cert", str(cert), "--tls-key", str(key)]
    args += ["--auth-tokens-file", str(tokens)]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:  # no opt-in needed: tokens are credentials
        assert "accepts anonymous peers" not in d.log()
        target = f"localhost:{tcp_port(d)}"
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(target, creds) as channel:
            nobody = _admin_calls(channel)
            tenant = _admin_calls(channel, (("authorization", f"Bearer {TENANT_TOKEN}"),))
            admin = _admin_calls(channel, (("authorization", f"Bearer {ADMIN_TOKEN}"),))
        assert {n: e.code() if e else None for n, e in nobody.items()} == dict.fromkeys(
            nobody, grpc.StatusCode.UNAUTHENTICATED
        )
        assert {n: e.code() if e else None for n, e in tenant.items()} == dict.fromkeys(
            tenant, grpc.StatusCode.PERMISSION_DENIED
        )
        assert admin == {"Stats": None, "Evict": None, "Verify": None}
        with UcmClient(target, tls_ca=cert, token=TENANT_TOKEN) as team:
            assert team.put_blocks(NS, [(key_digest("t", 0), b"t" * 4096)]).ok
        with UcmClient(d.target, token=ADMIN_TOKEN) as ops:  # and over the Unix socket
            assert ops.stats().store_pipeline == "Cache|Posix"
        assert d.healthy()
