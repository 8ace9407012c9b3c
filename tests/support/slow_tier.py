"""A daemon whose only tier sleeps on every block read and write, so tasks run long enough to be
attacked (unregistered, truncated, killed) while they run. Shared by the tests that need one."""

from __future__ import annotations

import json
from pathlib import Path

from ucm_server.testing.daemon import DaemonProcess

SLOW_TIER = "ucm_server.testing.faults:LatencyInjectingTier"


def slow_daemon(root: Path, delay_s: float, *, write_delay_s: float | None = None) -> DaemonProcess:
    """An unstarted daemon under ``root`` whose only tier (Posix, not durable) sleeps ``delay_s`` per
    block read and written (``write_delay_s``, when given, per block written)."""
    settings = {
        SLOW_TIER: {
            "root": str(root / "blocks"),
            "durable": False,
            "read_delay_s": delay_s,
            "write_delay_s": delay_s if write_delay_s is None else write_delay_s,
        }
    }
    return DaemonProcess(
        root / "ucm", args=["--store-pipeline", SLOW_TIER], env={"UCM_TIER_SETTINGS": json.dumps(settings)}
    )
