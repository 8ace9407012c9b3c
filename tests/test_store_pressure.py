"""Back-pressure: the daemon says when it cannot keep up with dumps, on what clients read anyway.

A real daemon whose lower tier is slow (``LatencyInjectingTier``, a test double for a slow disk:
each block write takes 50 ms) and whose write-back backlog is small is flooded with dumps. The
``store_saturated`` flag must turn on in the Dump answers and on the session stream of a client that
sends nothing (pushed at once, not at the next heartbeat, which is set far away), show in the
operator's stats, and turn off again, pushed, once the backlog has drained.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_server.pressure import StorePressure
from ucm_server.store.writeback import WriteBackFigures
from ucm_server.testing.daemon import DaemonProcess

SLOW = "ucm_server.testing.faults:LatencyInjectingTier"
NS = namespace_id(test="store-pressure")
SIZE = 64 << 10  # one Cache page


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"{what} did not happen within {timeout_s}s"
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_saturated_daemon_says_so_and_says_when_it_keeps_up_again(tmp_path: Path) -> None:
    settings = {"root": str(tmp_path / "blocks"), "durable": False, "write_delay_s": 0.05}
    args = ["--store-pipeline", f"Cache|{SLOW}", "--cache-capacity", "8MiB"]
    args += ["--writeback-max-bytes", "1MiB", "--writeback-wait-s", "0.01"]
    args += ["--writeback-overflow", "cache-only", "--heartbeat-interval-s", "60"]
    env = {"UCM_TIER_SETTINGS": json.dumps({SLOW: settings})}
    with (
        DaemonProcess(tmp_path / "ucm", args=args, env=env) as d,
        UcmClient(d.target, client_name="dumper") as dumper,
        UcmClient(d.target, client_name="bystander") as bystander,
        SharedBuffer(16 * SIZE) as buf,
    ):
        bystander.stats()  # attached: its session stream is open
        assert not dumper.store_saturated and not bystander.store_saturated
        region = dumper.register(buf)
        stop = threading.Event()
        saw_in_reply = threading.Event()

        def flood() -> None:
            batch = 0
            while not stop.is_set():
                blocks = [
                    BlockIO(key_digest("pressure", batch, i), (Segment(region, i * SIZE, SIZE),))
                    for i in range(16)
                ]
                dumper.wait(dumper.dump(NS, blocks), 30)
                if dumper.store_saturated:
                    saw_in_reply.set()
                batch += 1

        flooding = threading.Thread(target=flood)
        flooding.start()
        try:
            _until(saw_in_reply.is_set, 30, "a Dump answer saying store_saturated")
            _until(lambda: bystander.store_saturated, 5, "the flag pushed to a client that sends nothing")
            top = bystander.stats().tiers[0]
            assert top.extra["store_saturated"] == 1.0
        finally:
            stop.set()
            flooding.join(60)
        # 60 s heartbeats: only a pushed event can tell the bystander within the timeout
        _until(lambda: not bystander.store_saturated, 30, "the all-clear pushed once the backlog drained")
        assert bystander.stats().tiers[0].extra["store_saturated"] == 0.0


class _Figures:
    """Write-back figures set by the test (the flag's input, nothing of the daemon faked)."""

    def __init__(self) -> None:
        self.pending, self.waiting = 0, 0

    def writeback_figures(self) -> WriteBackFigures:
        return WriteBackFigures(
            queue_depth=0,
            bytes_pending=self.pending,
            max_bytes=100,
            waiting=self.waiting,
            backpressure_waits=0,
            backpressure_wait_s=0.0,
            skipped=0,
            written_through=0,
            written=0,
            failed=0,
        )


def test_the_flag_turns_on_near_the_bound_and_off_only_once_half_drained() -> None:
    figures, flips = _Figures(), []
    pressure = StorePressure(figures, flips.append)
    for pending, waiting, expected in [
        (50, 0, False),
        (89, 0, False),
        (90, 0, True),  # at 90% of the bound
        (60, 0, True),  # still above half: no flapping
        (50, 0, False),
        (10, 1, True),  # a dump waits for room, whatever the bytes
        (10, 0, False),
    ]:
        figures.pending, figures.waiting = pending, waiting
        assert pressure.poll() is expected, (pending, waiting)
    assert flips == [True, False, True, False] and pressure.flips == 2
