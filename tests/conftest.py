"""Shared fixtures: a real ucm-server process per test (or module), with its own socket and data dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_client import SharedBuffer, UcmClient
from ucm_server.testing.daemon import DaemonProcess


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon on defaults but with a small Cache (64 MiB) and a private socket and data dir."""
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "64MiB"]) as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[UcmClient]:
    with UcmClient(daemon.target, client_name="pytest") as c:
        yield c


@pytest.fixture
def shm() -> Iterator[SharedBuffer]:
    with SharedBuffer(16 << 20, label="test") as buf:
        yield buf
