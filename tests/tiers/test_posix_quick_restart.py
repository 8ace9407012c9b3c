"""A daemon stopped while it is still loading its index snapshot leaves one for the next start.

A clean start loads the snapshot the last clean stop wrote (the clean-shutdown marker vouches for
it, and is taken at start, so a crash afterwards re-reads the files). A daemon stopped again before
that load ended — a service manager restarting it twice in a row, an operator's quick config fix —
left no snapshot: the load had not been interrupted (it runs to its end in a thread) and the index
was whole, but the stop counted it as unfinished, so the next start re-read every block file's
header (20 s at a million blocks) instead of loading a snapshot (0.4 s). A real daemon over
block files planted on disk, serving before its index is complete (``--posix-index-wait-s 0``) and
stopped as soon as it answers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.posix_store import index_done, plant, posix_daemon

from ucm_client import UcmClient

pytestmark = pytest.mark.slow  # planting and three starts take seconds: not part of `make test-fast`

N = 150_000
"""Enough blocks that the snapshot load (tens of ms) is still running when the stop arrives."""


def _last_indexing(log: str) -> tuple[int, int]:
    """(blocks indexed, of which from snapshots) of the daemon's last start."""
    found = re.findall(r"(\d+) blocks \(\d+ bytes\) indexed from .* \((\d+) from snapshots\)", log)
    assert found, log[-4000:]
    blocks, from_snapshots = found[-1]
    return int(blocks), int(from_snapshots)


def test_a_stop_during_the_snapshot_load_leaves_a_snapshot(tmp_path: Path) -> None:
    d = posix_daemon(tmp_path, "--posix-index-wait-s", "0", "--posix-snapshot-interval-s", "0")
    plant(d, 0, N)
    with d, UcmClient(d.target) as c:
        assert index_done(c, timeout_s=300)["blocks"] == N  # stopped cleanly: a snapshot and its marker
    with d:  # loads that snapshot; stopped as soon as it answers, before the load can end
        pass
    with d, UcmClient(d.target) as c:
        assert index_done(c, timeout_s=300)["blocks"] == N
    blocks, from_snapshots = _last_indexing(d.log())
    assert (blocks, from_snapshots) == (N, N), "the quick stop left no snapshot: every header was read again"
