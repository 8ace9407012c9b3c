"""Prometheus metrics: the seed 001 set plus per-tier and task-queue figures.

Task metrics are observed as tasks finish; tier and queue figures are taken at scrape time by a
collector, from the engine's read-only :class:`~ucm_server.snapshot.EngineSnapshot` (the same figures
``Admin.Stats`` answers), so they cost nothing between scrapes. Each daemon has its own registry
(several daemons may share a test process' imports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ucm_server.snapshot import EngineSnapshot

log = logging.getLogger(__name__)

_MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookup_hit_rate = Gauge(
            "ucm_lookup_hit_rate", "Fraction of looked-up keys found (last lookup)", registry=r
        )
        self.lookup_keys = Counter("ucm_lookup_keys", "Keys looked up", registry=r)
        self.lookup_hits = Counter("ucm_lookup_hits", "Keys found by lookups", registry=r)
        self.load_duration = Histogram(
            "ucm_load_duration_ms", "Load task duration", buckets=_MS_BUCKETS, registry=r
        )
        self.load_speed = Gauge("ucm_load_speed_gbps", "Throughput of the last load task (GB/s)", registry=r)
        self.save_duration = Histogram(
            "ucm_save_duration_ms", "Dump task duration", buckets=_MS_BUCKETS, registry=r
        )
        self.save_speed = Gauge("ucm_save_speed_gbps", "Throughput of the last dump task (GB/s)", registry=r)
        self.blocks = Counter("ucm_task_blocks", "Blocks handled by tasks", ["kind", "status"], registry=r)
        self.rpc_errors = Counter(
            "ucm_rpc_errors", "RPCs answered with an error", ["method", "code"], registry=r
        )
        self._server: object | None = None

    def observe_task(self, kind: str, elapsed_s: float, nbytes: int) -> None:
        ms = elapsed_s * 1000
        gbps = nbytes / elapsed_s / 1e9 if elapsed_s > 0 else 0.0
        if kind == "LOAD":
            self.load_duration.observe(ms)
            self.load_speed.set(gbps)
        elif kind == "DUMP":
            self.save_duration.observe(ms)
            self.save_speed.set(gbps)

    def observe_lookup(self, keys: int, hits: int) -> None:
        self.lookup_keys.inc(keys)
        self.lookup_hits.inc(hits)
        if keys:
            self.lookup_hit_rate.set(hits / keys)

    def attach(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Scrape the figures ``snapshot()`` returns (the engine's, in the daemon)."""
        self.registry.register(_SnapshotCollector(snapshot))

    def serve(self, address: str) -> int:
        """Start the HTTP endpoint; returns the bound port (address port 0 = any free port)."""
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._server = server
        bound: int = server.server_address[1]
        log.info("metrics at http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server = None


INDEX_SNAPSHOT_GAUGES = (
    ("index_snapshot_at", "Unix time the last periodic index snapshot was written"),
    ("index_snapshot_age_s", "Seconds since the last periodic index snapshot"),
    ("index_snapshot_blocks", "Blocks in the last periodic index snapshot"),
    ("index_snapshot_duration_s", "Seconds the last periodic index snapshot took"),
    ("index_snapshot_stall_s", "Seconds the event loop spent collecting the last snapshot's keys"),
    ("index_snapshots_written", "Periodic index snapshots written since start"),
    ("index_snapshot_failures", "Periodic index snapshots that failed (disk full, ...) since start"),
)
"""The Posix tier's periodic-snapshot figures (tier stats ``extra``), exported where present."""


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        labels = ["tier", "kind"]
        gauges = {
            name: GaugeMetricFamily(f"ucm_tier_{name}", help_, labels=labels)
            for name, help_ in (
                ("blocks", "Blocks stored in the tier"),
                ("bytes", "Bytes stored in the tier"),
                ("capacity_bytes", "Tier capacity in bytes (0 = unlimited)"),
                ("hit_rate", "Reads served / reads asked of the tier"),
            )
        }
        counters = {
            name: CounterMetricFamily(f"ucm_tier_{name}", help_, labels=labels)
            for name, help_ in (
                ("evictions", "Blocks evicted"),
                ("read_bytes", "Bytes read"),
                ("write_bytes", "Bytes written"),
                ("errors", "I/O errors"),
                ("corrupt", "Corrupt blocks detected and quarantined"),
            )
        }
        snapshots = {
            name: GaugeMetricFamily(f"ucm_tier_{name}", help_, labels=labels)
            for name, help_ in INDEX_SNAPSHOT_GAUGES
        }
        for tier in snap.tiers:
            s = tier.stats
            lv = [s.name, s.kind]
            for name, snap_fam in snapshots.items():
                if name in s.extra:
                    snap_fam.add_metric(lv, s.extra[name])
            gauges["blocks"].add_metric(lv, s.blocks)
            gauges["bytes"].add_metric(lv, s.bytes)
            gauges["capacity_bytes"].add_metric(lv, s.capacity_bytes)
            gauges["hit_rate"].add_metric(lv, s.hit_rate)
            for name, fam in counters.items():
                fam.add_metric(lv, getattr(s, name))
        yield from gauges.values()
        yield from counters.values()
        yield from (fam for fam in snapshots.values() if fam.samples)
        q = GaugeMetricFamily("ucm_task_queue_depth", "Tasks by state", labels=["state"])
        q.add_metric(["running"], snap.tasks_running)
        q.add_metric(["queued"], snap.tasks_queued)
        yield q
        yield GaugeMetricFamily(
            "ucm_writeback_pending",
            "Blocks waiting to be written down",
            value=snap.pending_writeback,
        )
        yield from _writeback_metrics(snap)
        yield from _admission_metrics(snap)
        plain: tuple[tuple[Callable[..., Metric], str, str, float], ...] = (
            (GaugeMetricFamily, "ucm_pinned_blocks", "Blocks pinned now", snap.pinned_blocks),
            (
                GaugeMetricFamily,
                "ucm_retention_rules",
                "Blocks with a retention rule (pin, TTL or priority)",
                snap.retention_rules,
            ),
            (CounterMetricFamily, "ucm_expired_blocks", "Blocks removed by their TTL", snap.expired_blocks),
            (
                GaugeMetricFamily,
                "ucm_reply_bytes_held",
                "Block bytes held for GetBlocks replies being sent (bounded by reply_bytes)",
                snap.reply_bytes_held,
            ),
            (
                CounterMetricFamily,
                "ucm_reply_waits",
                "GetBlocks replies that waited for reply_bytes",
                snap.reply_waits,
            ),
            (GaugeMetricFamily, "ucm_sessions", "Attached client sessions", snap.sessions),
            (GaugeMetricFamily, "ucm_regions", "Registered memory regions", snap.regions),
        )
        for family, name, documentation, value in plain:
            yield family(name, documentation, value=value)


ADMISSION_COUNTERS = (
    ("offered", "Blocks offered at an admission boundary"),
    ("admitted", "Offered blocks an admission policy let through"),
    ("deferred", "Offered blocks an admission policy turned away (kept above, or not stored at the door)"),
    ("readmitted", "Turned-away blocks written down later, at a use that made the policy admit them"),
)


def _admission_metrics(snap: EngineSnapshot) -> Iterator[Metric]:
    """Back-pressure and admission: ``ucm_store_saturated``, ``ucm_admission_*{boundary}`` (``daemon``
    for the door, else the tier's name), present where a policy other than ``always`` is set."""
    yield GaugeMetricFamily(
        "ucm_store_saturated",
        "1 while the daemon cannot keep up with dumps (clients skip saves)",
        value=float(snap.store_saturated),
    )
    boundaries = [("daemon", snap.door_admission)] + [(t.stats.name, t.stats.extra) for t in snap.tiers]
    for name, help_ in ADMISSION_COUNTERS:
        fam = CounterMetricFamily(f"ucm_admission_{name}", help_, labels=["boundary"])
        for boundary, figures in boundaries:
            if f"admission_{name}" in figures:
                fam.add_metric([boundary], figures[f"admission_{name}"])
        if fam.samples:
            yield fam


def _writeback_metrics(snap: EngineSnapshot) -> Iterator[Metric]:
    """The bounded write-back queue: depth, bytes held, backpressure and admission decisions."""
    wb = snap.writeback
    gauges: tuple[tuple[str, str, float], ...] = (
        ("ucm_writeback_queue_depth", "Blocks queued or being written down", wb.queue_depth),
        ("ucm_writeback_bytes_pending", "Cache bytes held by blocks awaiting write-down", wb.bytes_pending),
        ("ucm_writeback_max_bytes", "Bound of the write-back backlog (0: write-back off)", wb.max_bytes),
        ("ucm_writeback_waiting", "Dumps waiting for room in the backlog now", wb.waiting),
    )
    for name, help_, value in gauges:
        yield GaugeMetricFamily(name, help_, value=value)
    counters: tuple[tuple[str, str, float], ...] = (
        (
            "ucm_writeback_backpressure_waits",
            "Blocks that waited for room in the backlog",
            wb.backpressure_waits,
        ),
        (
            "ucm_writeback_backpressure_wait_seconds",
            "Seconds dumps spent waiting for room",
            wb.backpressure_wait_s,
        ),
        ("ucm_writeback_skipped", "Blocks kept in the Cache only: the node was saturated", wb.skipped),
        (
            "ucm_writeback_written_through",
            "Blocks written down before their dump completed: the node was saturated",
            wb.written_through,
        ),
        ("ucm_writeback_written", "Blocks written down by write-back", wb.written),
        ("ucm_writeback_failed", "Write-backs that failed in a lower tier", wb.failed),
    )
    for name, help_, value in counters:
        yield CounterMetricFamily(name, help_, value=value)
