"""The engine's figures at one instant, read-only: what ``Admin.Stats`` answers and Prometheus scrapes.

One place computes them (:meth:`ucm_server.engine.Engine.snapshot`), so the admin answer and the
metrics never disagree about how a figure is derived, and the metrics module needs nothing of the
engine but a function that returns this. Taking one is cheap and awaits nothing: the scrape thread
calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ucm_server.store.base import TierStats
from ucm_server.store.writeback import WriteBackFigures


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One tier of the pipeline: its counters and what kind of store it is."""

    stats: TierStats
    persistent: bool
    shared: bool


@dataclass(frozen=True, slots=True)
class SessionFigures:
    """One attached session as ``Admin.Stats`` lists it (its client name escaped and capped)."""

    client_name: str
    pid: int
    tenant: str
    attached_at: float


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    version: str
    uptime_s: float
    tiers: tuple[TierFigures, ...]
    """Top tier first, as in the pipeline."""
    sessions: int
    regions: int
    region_bytes: int
    tasks_running: int
    """Running now (not counting the queued ones)."""
    tasks_queued: int
    lookups: int
    lookup_keys: int
    lookup_hits: int
    pending_writeback: int
    store_pipeline: str
    writeback: WriteBackFigures
    """The bounded write-back queue (Admin stats: the top tier's ``writeback_*`` extra figures)."""
    pinned_blocks: int = 0
    retention_rules: int = 0
    expired_blocks: int = 0
    """Retention: blocks pinned now, blocks with any rule, blocks removed by their TTL since start."""
    reply_bytes_held: int = 0
    reply_waits: int = 0
    """``GetBlocks`` replies: block bytes held now for replies being sent, replies that waited."""
    store_saturated: bool = False
    """The daemon cannot keep up with dumps now (:mod:`ucm_server.pressure`)."""
    door_admission: Mapping[str, float] = field(default_factory=dict)
    """The admission policy at the daemon's door, its ``admission_*`` figures (empty: ``always``);
    the boundaries below the Cache report theirs in their tier's ``extra``."""
