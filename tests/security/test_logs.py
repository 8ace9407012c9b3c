"""Logs cannot be forged or flooded.

A client attaches to a real daemon with a name built to forge a log line (a newline followed by a
line in the daemon's own format), to drive an operator's terminal (ANSI escapes) and to flood the
log (two 16 MiB names). The log must keep one line per record, carry the name escaped and capped,
and grow by a bounded amount; the same holds for the JSON log format. Error details that echo client
input come back capped and on one line, and ``ucm-admin`` (run as a real subprocess) prints no
control characters from the daemon. After each attack the daemon is still healthy and serves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS

from ucm_client import UcmClient, key_digest
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

FORGED = "2026-12-01 09:00:00,000 INFO    ucm_server.engine: forged line: tokens rotated, all clear"
HOSTILE = f"vllm-worker\n{FORGED}\r\x1b[2J\x1b[31mred\x1b[0m\u202eevil\u2028next\x00end"
HUGE = 16 << 20


@pytest.fixture(params=["text", "json"])
def daemon_fmt(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "ucm", args=["--log-format", request.param]) as d:
        yield d


def _full_log(d: DaemonProcess) -> str:
    return d.log_path.read_text(errors="replace")


def _attach(d: DaemonProcess, name: str) -> None:
    with UcmClient(d.target, client_name=name) as c:
        assert c.lookup(NS, []).hit_prefix == 0


def _alive(d: DaemonProcess) -> None:
    assert d.healthy()
    data = os.urandom(4096)
    with UcmClient(d.target, client_name="after") as c:
        assert c.put_blocks(NS, [(key_digest("after", 0), data)]).ok
        assert c.get_blocks(NS, [key_digest("after", 0)]) == [data]


def _attach_line(d: DaemonProcess, lines: list[str]) -> str:
    """The log line of the session attached with the hostile name."""
    found = [line for line in lines if "attached (vllm-worker" in line]
    assert len(found) == 1, _full_log(d)[-4000:]
    return found[0]


@pytest.mark.slow
def test_a_client_name_cannot_forge_a_log_line(daemon_fmt: DaemonProcess) -> None:
    d = daemon_fmt
    _attach(d, HOSTILE)
    text = _full_log(d)
    lines = text.splitlines()
    assert not any(line.startswith("2026-12-01 09:00:00,000") for line in lines), "a forged line"
    for ch in ("\x1b", "\r", "\x00", "\u202e", "\u2028"):
        assert ch not in text, f"{ch!r} reached the log"
    line = _attach_line(d, lines)
    msg = json.loads(line)["msg"] if line.startswith("{") else line  # json: one object per line
    assert "vllm-worker\\n2026-12-01 09:00:00,000 INFO" in msg
    assert "\\x1b[2J\\x1b[31mred" in msg and "\\u202eevil\\u2028next\\x00end" in msg
    _alive(d)


@pytest.mark.slow
def test_huge_client_names_do_not_flood_the_log(daemon_fmt: DaemonProcess) -> None:
    d = daemon_fmt
    before = d.log_path.stat().st_size
    for tag in ("a", "b"):
        _attach(d, "vllm-worker" + tag * HUGE)
    grown = d.log_path.stat().st_size - before
    assert grown < 8 << 10, f"two 16 MiB names grew the log by {grown} bytes"
    line = _attach_line(d, [ln for ln in _full_log(d).splitlines() if "workera" in ln])
    assert re.search(r"\.\.\.\[\d+ more characters\]", line)
    _alive(d)


@pytest.mark.slow
def test_admin_output_shows_no_control_characters(daemon_fmt: DaemonProcess) -> None:
    d = daemon_fmt
    with UcmClient(d.target, client_name=HOSTILE):  # a hostile session is attached while we look
        for mode in ([], ["--json"]):
            proc = subprocess.run(
                [sys.executable, "-m", "ucm_client.admin", "--target", d.target, *mode, "stats"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert proc.returncode == 0, proc.stderr
            out = proc.stdout + proc.stderr
            assert "\x1b" not in out and "\u202e" not in out and "\x00" not in out
            assert not any(line.startswith(FORGED) for line in out.splitlines()), "a forged line"
            # The hostile session is listed, its name escaped: its newline is the two characters
            # backslash-n, so the forged text stays on the client's own line.
            if mode:
                (listed,) = json.loads(proc.stdout)["session_list"]
                assert listed["client_name"].startswith("vllm-worker\\n2026-12-01"), listed
            else:
                assert "vllm-worker\\n2026-12-01" in out, out
    _alive(d)


@pytest.mark.slow
def test_error_details_echoing_client_input_are_one_capped_line(daemon_fmt: DaemonProcess) -> None:
    d = daemon_fmt
    token = "x" * (1 << 20) + "\n" + FORGED + "\x1b[2J"
    with grpc.insecure_channel(d.target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            rpc.AdminStub(ch).ListBlocks(pb.ListBlocksRequest(page_token=token), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert "bad page_token" in details
    assert len(details) < 5000 and "\n" not in details and "\x1b" not in details
    _alive(d)
