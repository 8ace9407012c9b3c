"""Red team: ``ucm-admin`` given arguments a careless operator types.

Found: ``priority 99999999999999999999`` and ``evict --bytes 99999999999999999999999`` passed argparse
and died in protobuf ("unexpected ValueError ... a bug in ucm-admin"); ``--timeout inf`` raised
OverflowError; ``bench --block-size 0`` a ValueError; and ``bench --block-size 1TiB`` preallocated shared
memory until the kernel's OOM killer ended the bench, the daemon and unrelated processes on the host.
Now each is a usage error (exit 2) naming the input, or, for memory the host does not have, a clear
refusal before a page is allocated. The daemon stays up throughout.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ucm_client.admin.cli import main
from ucm_server.testing.daemon import DaemonProcess

ADMIN = [sys.executable, "-m", "ucm_client.admin"]
KEY = "ab" * 16 + "/" + "cd" * 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("rt-admin") / "ucm", args=["--cache-capacity", "16MiB"]) as d:
        yield d


BAD = {
    "priority past int32": (
        ["priority", "99999999999999999999", KEY],
        "priority must be between -100 and 100",
    ),
    "pin --priority past int32": (["pin", "--priority", "-2147483649", KEY], "priority must be between"),
    "priority out of range": (["priority", "101", KEY], "priority must be between -100 and 100, got 101"),
    "evict past uint64": (
        ["evict", "--tier", "Cache", "--bytes", "99999999999999999999999"],
        "size 99999999999999999999999 is more than 16 EiB",
    ),
    "infinite timeout": (["--timeout", "inf", "stats"], "argument --timeout: must be a finite number"),
    "infinite interval": (["watch", "--interval", "inf", "--count", "1"], "--interval: must be a finite"),
    "infinite ttl": (["ttl", "inf", KEY], "SECONDS: must be a finite number more than 0, got inf"),
    "ls past the page limit": (["ls", "--limit", "99999"], "argument --limit: at most 10000, got 99999"),
    "odd-length namespace": (["verify", "--namespace", "0"], "is not 32 hexadecimal digits (two per byte)"),
    "zero block size": (["bench", "--block-size", "0"], "--block-size: must be at least 1 byte, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_argument_is_a_usage_error_naming_it(
    daemon: DaemonProcess, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = BAD[case]
    assert main(["--socket", str(daemon.socket), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1], err
    assert "Traceback" not in err and "a bug in ucm-admin" not in err
    assert daemon.healthy()


def test_the_limits_themselves_are_accepted(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """Negative control: the edges of each range pass the checks and reach the daemon."""
    sock = ["--socket", str(daemon.socket), "--timeout", "30"]
    assert main([*sock, "priority", "--missing-ok", "--", "-100", KEY]) == 0
    assert main([*sock, "pin", "--missing-ok", "--priority", "100", KEY]) == 0
    assert main([*sock, "evict", "--tier", "Cache", "--bytes", str((1 << 64) - 1)]) == 0
    assert main([*sock, "ttl", "--missing-ok", "1e6", KEY]) == 0
    err = capsys.readouterr().err
    assert "error" not in err, err


def _fsize_guard() -> None:
    """In the bench child: should the memory check ever be skipped, a file-size limit stops the memfd
    at 64 MiB (SIGXFSZ) instead of letting the host run out of memory."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, resource.RLIM_INFINITY))


def test_bench_bigger_than_the_host_is_refused_before_allocating(daemon: DaemonProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    proc = subprocess.run(
        [
            *ADMIN,
            "--socket",
            str(daemon.socket),
            "bench",
            "--block-size",
            "1TiB",
            "--blocks",
            "1",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        preexec_fn=_fsize_guard,
    )
    assert proc.returncode not in (0, 2) and proc.returncode > 0, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not allocate 1099511627776 bytes" in lines[0], proc.stderr
    assert "of memory are available" in lines[0] and "Traceback" not in proc.stderr
    assert daemon.healthy()


@pytest.mark.slow
def test_a_connect_timeout_prints_one_line_and_no_thread_traceback(
    daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc's connectivity-polling thread raised when the timed-out channel was closed under it: about
    one run in three printed "Exception in thread ... (_run)" and a traceback beside the message."""
    import threading

    crashes: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda info: crashes.append(repr(info.exc_value)))
    for _ in range(8):
        assert main(["--socket", str(daemon.socket), "--timeout", "1e-9", "stats"]) == 3
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "no ucm-server answering" in lines[0], lines
    time.sleep(0.5)  # any polling thread still running has polled again by now
    assert crashes == []
    assert main(["--socket", str(daemon.socket), "stats"]) == 0  # control: a real timeout works
