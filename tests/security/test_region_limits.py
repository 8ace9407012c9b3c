"""Regions: one session cannot exhaust the daemon by registering memory.

Against a real ``ucm-server``: one session registers the same small buffer 2,000 times. Before the
fix each registration kept a file descriptor open in the daemon and, at about 1,000, every client
got ``INTERNAL "Too many open files"``. Now a region holds a mapping but no descriptor, the daemon's
descriptor count stays flat, and the session is stopped by its own limits
(``max_session_regions``, ``max_session_region_bytes``) with ``RESOURCE_EXHAUSTED`` naming the
setting, while other clients keep working and the session's own budget comes back when it
unregisters or ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in

from ucm_client import SharedBuffer, UcmClient
from ucm_client.errors import ResourceExhausted
from ucm_server.testing.daemon import DaemonProcess


def _open_fds(d: DaemonProcess) -> int:
    assert d.proc is not None
    return sum(1 for _ in Path(f"/proc/{d.proc.pid}/fd").iterdir())


def _round_trip(d: DaemonProcess, name: str) -> None:
    with (
        UcmClient(d.target, client_name=name) as c,
        SharedBuffer(4 * 4096) as src,
        SharedBuffer(4 * 4096) as dst,
    ):
        src.buf[:] = os.urandom(src.size)
        assert c.wait(c.dump(NS, blocks_in(c.register(src), 4, 4096, first=hash(name) % 10**6)), 30).ok
        assert c.wait(c.load(NS, blocks_in(c.register(dst), 4, 4096, first=hash(name) % 10**6)), 30).ok
        assert bytes(dst.buf) == bytes(src.buf)


@pytest.mark.slow
def test_two_thousand_registrations_hold_no_descriptors(daemon: DaemonProcess) -> None:
    """Within the default limit (4,096 regions), 2,000 registrations all succeed and cost no fds."""
    with UcmClient(daemon.target, client_name="hoarder") as c, SharedBuffer(4096) as buf:
        c.register(buf)
        base = _open_fds(daemon)
        handles = [c.register(buf) for _ in range(2000)]
        assert len(set(handles)) == 2000
        assert _open_fds(daemon) <= base + 8, "each registered region keeps a descriptor open"
        assert c.stats().regions >= 2001
        _round_trip(daemon, "bystander")  # another client is not affected
        assert c.wait(c.dump(NS, blocks_in(handles[-1], 1, 4096)), 10).ok  # the last region works
    assert daemon.healthy()


@pytest.mark.slow
def test_region_count_limit(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm", args=["--max-session-regions", "100"]) as d:
        with UcmClient(d.target, client_name="hoarder") as c, SharedBuffer(4096) as buf:
            handles = [c.register(buf) for _ in range(100)]
            for _ in range(3):  # refused every time, never INTERNAL, nothing leaks
                with pytest.raises(ResourceExhausted, match=r"100 regions registered.*max_session_regions"):
                    c.register(buf)
            _round_trip(d, "bystander")  # other sessions have their own budget
            c.unregister(handles.pop())  # unregistering gives room back
            handles.append(c.register(buf))
            with pytest.raises(ResourceExhausted, match="max_session_regions"):
                c.register(buf)
        with UcmClient(d.target, client_name="next") as c, SharedBuffer(4096) as buf:
            c.register(buf)  # the ended session's regions were released
        assert d.healthy()


@pytest.mark.slow
def test_region_bytes_limit(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm", args=["--max-session-region-bytes", "1MiB"]) as d:
        with UcmClient(d.target) as c, SharedBuffer(768 << 10) as big, SharedBuffer(256 << 10) as small:
            c.register(big)
            c.register(small)  # exactly 1 MiB
            with pytest.raises(ResourceExhausted, match=r"max_session_region_bytes = 1048576"):
                c.register(small, 4096)
            _round_trip(d, "bystander")
        assert d.healthy()


def test_limits_are_settings(tmp_path: Path) -> None:
    """The limits are daemon settings like any other: flags, YAML keys, UCM_* variables."""
    from ucm_server.config_sources import load_config

    config, _ = load_config(environ={"UCM_MAX_SESSION_REGIONS": "7", "UCM_MAX_SESSION_REGION_BYTES": "2GiB"})
    assert (config.max_session_regions, config.max_session_region_bytes) == (7, 2 << 30)
    default, _ = load_config(environ={})
    assert default.max_session_regions == 4096 and default.max_session_region_bytes == 1 << 40
    assert default.max_pending_handovers == 256
