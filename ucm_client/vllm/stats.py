"""Connector metrics through vLLM's own channels: ``KVConnectorStats`` and Prometheus.

Both halves count into one flat dict of counters; vLLM ships the worker's dict to the scheduler
process every step, sums it with the scheduler's (``aggregate``), logs a summary (``reduce``) and
feeds Prometheus (``UcmPromMetrics``), so users see hit tokens, load/save bytes and times where they
already look for vLLM's metrics (``/metrics``, ``LLM.get_metrics()``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "UcmConnectorStats", "UcmPromMetrics"]

COUNTERS: dict[str, str] = {
    "lookups": "Lookup RPCs sent by the scheduler (one per request and TP rank).",
    "lookup_seconds": "Time spent in lookups.",
    "query_tokens": "Prompt tokens asked about beyond vLLM's own prefix cache.",
    "hit_tokens": "Tokens granted to vLLM as external hits.",
    "load_blocks": "Blocks loaded from the daemon.",
    "load_bytes": "Bytes loaded from the daemon into vLLM's KV cache.",
    "load_seconds": "Time from load submission to completion.",
    "load_wait_seconds": "Time the forward waited for this step's loads (layerwise: summed over layers).",
    "load_layers_ahead": (
        "Attention layers that started on their own pages of a whole-block load while the daemon was "
        "still copying later layers (its progress word, ucm_client.load_progress)."
    ),
    "load_failed_blocks": "Blocks whose load failed (missing, corrupt, timeout); vLLM recomputes them.",
    "save_blocks": "Blocks stored in the daemon.",
    "save_bytes": "Bytes stored in the daemon.",
    "save_seconds": "Time from dump submission to completion.",
    "save_failed_blocks": "Blocks whose save failed or was dropped.",
    "save_replica_skipped_blocks": (
        "Blocks a TP rank other than 0 did not store because their KV is the same on every rank (MLA): "
        "rank 0 stores the one copy every rank loads."
    ),
    "save_skipped_blocks": (
        "Blocks not saved because the daemon said it could not keep up with dumps (store_saturated): "
        "skipped rather than stall a step; a later request recomputes them."
    ),
    "save_declined_blocks": 'Blocks not saved because their request asked so ({"ucm": {"store": false}}).',
    "daemon_unavailable": "Calls skipped or failed because the daemon was down.",
    "hook_seconds": "Time vLLM's scheduler and workers spent inside connector calls (its direct cost).",
}


@dataclass
class UcmConnectorStats(KVConnectorStats):
    """Counters summed over an interval and over workers."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **increments: float) -> None:
        for name, value in increments.items():
            if name not in COUNTERS:
                raise KeyError(f"unknown UCM connector counter {name!r}")
            self.data[name] += value

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time spent in the block as ``hook_seconds``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.data["hook_seconds"] += time.perf_counter() - started

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: round(v, 6) for k, v in self.data.items() if v}
        for op in ("load", "save"):
            seconds = self.data.get(f"{op}_seconds", 0)
            if seconds:
                out[f"{op}_gb_per_s"] = round(self.data[f"{op}_bytes"] / seconds / 1e9, 3)
        return out

    def take(self) -> UcmConnectorStats | None:
        """This interval's counters (or None if nothing happened), leaving zeros behind."""
        if self.is_empty():
            return None
        snapshot = UcmConnectorStats(data=dict(self.data))
        self.reset()
        return snapshot


class UcmPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ``COUNTERS`` entry, named ``vllm:ucm_<name>_total``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:ucm_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
