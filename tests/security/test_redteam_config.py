"""Red team: configuration files that are not what they claim to be.

Found: ``ucm-admin --config /dev/zero`` (and ``ucm-server --config /dev/zero``) read the file whole, a
MemoryError traceback under a memory limit and the host's memory without one; bytes that are not UTF-8
escaped as UnicodeDecodeError from the admin tool's reader; and the auth tokens file let PyYAML's
ValueError for an impossible date out of start-up. The three readers (daemon config, the admin tool's
socket lookup, the tokens file) now share one bounded reader: at most 16 MiB, every failure a
ConfigError naming the file. Pipes still work (``--config <(...)``): the control.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucm_client.admin.cli import main as admin_main
from ucm_protocol.errors import ConfigError
from ucm_protocol.paths import socket_from_config
from ucm_server.auth import Authenticator
from ucm_server.config_sources import load_config
from ucm_server.testing.daemon import DaemonProcess


def _readers() -> dict[str, object]:
    return {
        "daemon config": lambda p: load_config(p, environ={}),
        "admin socket lookup": lambda p: socket_from_config(p, environ={}),
        "auth tokens file": Authenticator.from_file,
    }


@pytest.mark.parametrize("reader", list(_readers()))
def test_an_endless_file_is_refused_after_the_cap(reader: str) -> None:
    with pytest.raises(ConfigError, match="/dev/zero: more than 16 MiB"):
        _readers()[reader](Path("/dev/zero"))  # type: ignore[operator]


@pytest.mark.parametrize("reader", list(_readers()))
def test_bytes_that_are_not_text_or_an_impossible_date_are_config_errors(reader: str, tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"socket: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text"):
        _readers()[reader](binary)  # type: ignore[operator]
    date = tmp_path / "date.yaml"
    date.write_text("tokens: 2001-02-30\nsocket: 2001-02-30\n")
    with pytest.raises(ConfigError, match=r"date.yaml: not valid YAML"):
        _readers()[reader](date)  # type: ignore[operator]


def test_a_pipe_is_still_read(tmp_path: Path) -> None:
    """Control: the bounded read is not a regular-file check; ``--config <(...)`` keeps working."""
    r, w = os.pipe()
    try:
        os.write(w, f"socket: {tmp_path / 'x.sock'}\n".encode())
        os.close(w)
        assert socket_from_config(Path(f"/dev/fd/{r}"), environ={}) == tmp_path / "x.sock"
    finally:
        os.close(r)


def test_the_tools_exit_2_naming_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin_main(["--config", "/dev/zero", "stats"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: config file /dev/zero: more than 16 MiB; is it the right file?"
    proc = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--config", "/dev/zero", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("UCM_")},
    )
    assert proc.returncode == 2 and "config file /dev/zero: more than 16 MiB" in proc.stderr
    assert "Traceback" not in proc.stderr


def _meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.mark.parametrize("capacity", ["99999999999999999999", "four times the host"])
@pytest.mark.slow
def test_a_cache_larger_than_the_host_is_refused_before_it_is_mapped(tmp_path: Path, capacity: str) -> None:
    """``cache_capacity`` past ssize_t was an OverflowError traceback; past the host's memory the arena
    was mapped and faulted in until the OOM killer came. Both are now a configuration error (exit 2)."""
    value = str(4 * _meminfo_total()) if capacity.startswith("four") else capacity
    d = DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", value])
    with pytest.raises(RuntimeError) as info:
        d.start(timeout_s=30)
    message = str(info.value)
    assert "setting cache_capacity) is more than the memory available" in message, message
    assert "Traceback" not in message
    with DaemonProcess(tmp_path / "ok", args=["--cache-capacity", "16MiB"]) as ok:  # control
        assert ok.healthy()
