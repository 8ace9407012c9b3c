"""Helpers for tests of the local data plane: skipping without the compiled helper, raw channels,
whether a compiled call lets other threads run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ucm_client import UcmClient
from ucm_client.dataplane.channel import Mapped, open_channel
from ucm_client.trust import trusted_uids
from ucm_protocol import dataplane as dp
from ucm_protocol.native import MISSING, native

needs_native = pytest.mark.skipif(native is None, reason=f"the local data plane is not built here: {MISSING}")


def raw_channel(client: UcmClient, token: str | None = None) -> tuple[object, Mapped, Mapped]:
    """A second channel handshake for ``client``'s session, done by hand (the attacker's view):
    the connection, the ring mapped read-write, the table mapped read-only."""
    path = client.aio.socket_path
    assert path is not None and client.aio._session_id is not None
    return open_channel(dp.dataplane_socket_path(path), trusted_uids(), client.aio._session_id, token, 5.0)


def ran_meanwhile(fn: Callable[[], object]) -> int:
    """How often another thread ran Python while this thread was inside ``fn()`` (a call that holds
    the GIL throughout lets it run not once; 2 ms at each end are left out: the switch in and out)."""
    stamps: list[float] = []
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    fn()
    end = time.perf_counter()
    stop.set()
    t.join()
    return sum(1 for s in stamps if start + 0.002 < s < end - 0.002)
