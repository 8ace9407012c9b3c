"""Configuration: defaults < YAML < env < flags; unknown keys and bad values name the key."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ucm_protocol.errors import ConfigError
from ucm_protocol.settings import parse_size
from ucm_server.config_sources import load_config


def test_priority_env_over_yaml_over_defaults(tmp_path: Path) -> None:
    f = tmp_path / "ucm.yaml"
    f.write_text("cache_capacity: 2GiB\nstore_pipeline: Cache|Posix\nio_threads: 3\n")
    cfg, _ = load_config(f, environ={"UCM_CACHE_CAPACITY": "512MiB"})
    assert cfg.cache_capacity == 512 << 20  # env beats the file
    assert cfg.io_threads == 3  # the file beats the default
    cfg, _ = load_config(f, {"cache_capacity": "1GiB"}, environ={"UCM_CACHE_CAPACITY": "512MiB"})
    assert cfg.cache_capacity == 1 << 30  # flags beat env


def test_seed_format_yaml_and_log_level_aliases(tmp_path: Path) -> None:
    f = tmp_path / "seed.yaml"
    f.write_text(
        "ucm_connectors:\n- ucm_connector_name: UcmPipelineStore\n  ucm_connector_config:\n"
        "    store_pipeline: Cache|Posix\n    storage_backends: /tmp/a:/tmp/b\n"
    )
    cfg, _ = load_config(f, environ={"UNIFIED_CACHE_LOG_LEVEL": "DEBUG"})
    assert [str(p) for p in cfg.posix_roots] == ["/tmp/a", "/tmp/b"]
    assert cfg.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("cache_capacty: 1GiB\n", "unknown key 'cache_capacty'"),
        ("cache_capacity: lots\n", "cache_capacity"),
        ("store_pipeline: Cache|Floppy\n", "unknown tier 'Floppy'"),
        ("store_pipeline: Posix|Cache\n", "Cache must be the first tier"),
        ("write_mode: sometimes\n", "write_mode"),
        ("cache_eviction: lfu\n", "cache_eviction"),
        ("io_threads: -1\n", "io_threads: must be positive"),
        ("io_background_hold_s: 5\n", "io_background_hold_s: expected seconds in [0, 1], got 5"),
        ("io_background_hold_s: -0.1\n", "io_background_hold_s: expected seconds in [0, 1]"),
        ("posix_snapshot_interval_s: -5\n", "posix_snapshot_interval_s: must be 0 \\(off\\) or more seconds"),
        ("listen: 0.0.0.0:7000\n", "needs tls_cert and tls_key, or insecure"),
        ("listen: 0.0.0.0:7000\ninsecure: true\n", "set auth_tokens_file .* or allow_anonymous_tcp"),
        ("tls_client_ca: /ca.pem\n", "tls_client_ca: client certificates need TLS"),
        ("- a\n- b\n", "expected a mapping"),
        ("key: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, yaml_text: str, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message.replace("|", r"\|").replace("[", r"\[")):
        load_config(f, environ={})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="environment UCM_DURABLE"):
        load_config(environ={"UCM_DURABLE": "maybe"})


def test_unknown_env_variable_is_warned_about() -> None:
    _, warnings = load_config(environ={"UCM_CACHE_CAPACITTY": "1GiB"})
    assert any("UCM_CACHE_CAPACITTY" in w for w in warnings)


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512mb") == 512 << 20
    assert parse_size("1.5 G") == 3 << 29
    assert parse_size(123) == 123
    with pytest.raises(ConfigError):
        parse_size("-5")


def test_server_refuses_garbage_config_with_exit_code_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("store_pipeline: Cache|Nope\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--config", str(f), "--socket", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown tier 'Nope'" in proc.stderr
    assert not (tmp_path / "s").exists()


def test_print_config_shows_effective_values(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--print-config", "--cache-capacity", "3GiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert f"cache_capacity: {3 << 30}" in proc.stdout


@pytest.mark.slow
def test_second_daemon_on_same_socket_is_refused(tmp_path: Path) -> None:
    from ucm_server.testing.daemon import DaemonProcess

    with DaemonProcess(tmp_path / "a") as d:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ucm_server",
                "--socket",
                str(d.socket),
                "--data-dir",
                str(tmp_path / "b"),
                "--metrics-address",
                "off",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert "already listening" in proc.stderr
        assert d.healthy()


def test_socket_is_owner_only(tmp_path: Path) -> None:
    from ucm_server.testing.daemon import DaemonProcess

    with DaemonProcess(tmp_path / "a", socket=tmp_path / "run" / "ucm" / "ucm.sock") as d:
        assert d.socket.stat().st_mode & 0o777 == 0o600
        assert d.socket.parent.stat().st_mode & 0o777 == 0o700  # the daemon made its directory private


@pytest.mark.slow
def test_two_daemons_cannot_share_a_data_dir(tmp_path: Path) -> None:
    from ucm_server.testing.daemon import DaemonProcess

    with DaemonProcess(tmp_path / "a") as d:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ucm_server",
                "--socket",
                str(tmp_path / "b.sock"),
                "--data-dir",
                str(d.data_dir),
                "--metrics-address",
                "off",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert "is in use by another ucm-server" in proc.stderr
        assert d.healthy()


@pytest.mark.slow
def test_busy_metrics_port_fails_cleanly_before_serving(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ucm_server",
                "--socket",
                str(tmp_path / "s.sock"),
                "--data-dir",
                str(tmp_path / "data"),
                "--metrics-address",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"metrics_address 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.slow
def test_every_help_page_renders() -> None:
    """``ucm-server --help`` lists every setting (argparse formats help text with ``%``: a setting
    whose help says "6.25%" once crashed it), and every ``ucm-admin`` command's ``--help`` renders."""
    from ucm_client.admin.cli import build_parser
    from ucm_server.server_settings import FIELDS

    proc = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    flags = {"--" + name.replace("_", "-") for name in FIELDS if name != "tier_settings"}
    assert not {f for f in flags if f not in proc.stdout}, "settings missing from --help"
    assert "6.25%" in proc.stdout  # the codec's help, percent sign intact

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(commands.choices) >= 10
    for name, sub in commands.choices.items():
        text = sub.format_help()
        assert name in text and "examples:" in text, name
    assert "COMMAND" in parser.format_help()
