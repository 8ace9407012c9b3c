"""Sessions: a client that exits or is killed has its regions and tasks released; reconnects work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_server.testing.daemon import DaemonProcess


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_killed_client_releases_its_regions(daemon: DaemonProcess, client: UcmClient) -> None:
    script = textwrap.dedent(f"""
        import time
        from ucm_client import UcmClient, SharedBuffer
        c = UcmClient({daemon.target!r}).connect()
        bufs = [SharedBuffer(1 << 20) for _ in range(3)]
        for b in bufs:
            c.register(b)
        print("registered", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
    assert client.stats().regions == 3 and client.stats().sessions == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _wait_for(lambda: client.stats().regions == 0), "regions of a dead client were not released"
    assert client.stats().sessions == 1


@pytest.mark.slow
def test_client_reconnects_after_daemon_restart(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path / "ucm")
    with d, SharedBuffer(1 << 20) as buf:
        c = UcmClient(d.target).connect()
        region = c.register(buf)
        buf.buf[:4096] = os.urandom(4096)
        assert c.wait(c.dump(NS, blocks_in(region, 1, 4096), wait_durable=True), 10).ok
        d.stop()
        d.start()
        # Same client object, same region handle: it re-attaches and re-registers on its own.
        assert c.wait(c.load(NS, blocks_in(region, 1, 4096, offset=8192)), 10).ok
        assert bytes(buf.buf[8192 : 8192 + 4096]) == bytes(buf.buf[:4096])
        c.close()


def test_unavailable_when_no_daemon(tmp_path: Path) -> None:
    from ucm_client.errors import Unavailable

    c = UcmClient(str(tmp_path / "nothing.sock"), connect_timeout_s=0.5)
    try:
        c.connect()
    except Unavailable as exc:
        assert "no ucm-server socket at" in str(exc)
    else:
        raise AssertionError("connect() to a missing socket succeeded")
    finally:
        c.close()


@pytest.mark.slow
def test_cancel_stops_a_task_and_wait_times_out_cleanly(tmp_path: Path) -> None:
    """A big durable dump to disk is slow enough to time out a 1 ms wait and then be cancelled."""
    n, size = 512, 256 << 10
    args = ["--store-pipeline", "Posix"]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target) as c,
        SharedBuffer(n * size) as buf,
    ):
        task = c.dump(NS, blocks_in(c.register(buf), n, size))
        early = c.wait(task, 0.001)
        assert not early.done
        cancelled = c.cancel(task)
        assert cancelled.done
        done = sum(s.name == "OK" for s in cancelled.states)
        assert cancelled.cancelled or done == n
        assert all(s.name in ("OK", "CANCELLED") for s in cancelled.states)
        assert c.check(task).states == cancelled.states  # nothing moves after cancel returned
