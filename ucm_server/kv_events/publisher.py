"""The ZeroMQ side of KV events: a PUB socket with sequence numbers and a ROUTER for replay.

Same sockets and frames as vLLM's ``ZmqEventPublisher``, so an indexer written for vLLM (or vLLM's
own ``kv_events_subscriber`` example) subscribes unchanged. One difference a router can rely on:
vLLM answers a replay request only from its ring of past batches, so a subscriber that fell further
behind has lost state for good; here a replay request whose start is no longer in the ring (or is
ahead of it: the daemon restarted and counts from 0 again) is answered with a **snapshot** of the
present index (``AllBlocksCleared`` then ``BlockStored`` for everything held), labelled with the
sequence number of the last batch it includes. A subscriber applies it and then every streamed
batch with a larger number. Numbers start at the daemon's start time in microseconds rather than 0,
so they grow across restarts and a subscriber that outlived a daemon sees a gap, never a repeat.

Everything runs on the daemon's event loop: the ledger's changes are flushed once per loop turn
(``call_soon``), so a snapshot built on the loop is consistent with the numbers already sent.
Sending never blocks (PUB drops at the high-water mark, as in vLLM; replay repairs the gap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from ucm_protocol.errors import ConfigError
from ucm_server.kv_events.ledger import Ledger
from ucm_server.kv_events.wire import END_SEQ, Cleared, Event, HashFormat, encode_batch, seq_bytes
from ucm_server.store.base import Tier
from ucm_server.store.watch import Watchable, add_watch

if TYPE_CHECKING:
    from ucm_server.config import ServerConfig
    from ucm_server.store.pipeline import Pipeline

__all__ = ["EventsSettings", "KvEventPublisher", "kv_event_publisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventsSettings:
    endpoint: str
    """PUB address: ``tcp://*:5557`` (bind), ``ipc:///path`` (bind), ``tcp://host:port`` (connect)."""
    replay_endpoint: str = ""
    """ROUTER address for replay and snapshots (always bound); empty: no replay."""
    topic: str = ""
    hash_format: HashFormat = "int64"
    """``int64`` (vLLM's default event hashes) or ``bytes`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    buffer_batches: int = 10_000
    hwm: int = 100_000


class KvEventPublisher:
    """Publishes the ledger's transitions; attach it to the tiers before they open (every tier must be
    :class:`~ucm_server.store.watch.Watchable`: :meth:`Pipeline.make_watchable` sees to it)."""

    def __init__(self, settings: EventsSettings, tiers: Sequence[Tier]) -> None:
        self.settings = settings
        self.ledger = Ledger(self._schedule, settings.hash_format)
        self._topic = settings.topic.encode()
        # Numbers start at the start time in microseconds, so they keep growing across restarts: a
        # subscriber that outlived a daemon sees a gap (and replays), never numbers it has seen.
        self._seq = time.time_ns() // 1000 - 1
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, settings.buffer_batches))
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None  # a plain socket: sends never await (NOBLOCK)
        self._replay: zmq.asyncio.Socket | None = None
        self._replayer: asyncio.Task[None] | None = None
        self._scheduled = False
        self.dropped = 0
        for tier in tiers:
            if not isinstance(tier, Watchable):
                raise TypeError(f"tier {tier.name!r}: no watchable index (Pipeline.make_watchable wraps it)")
            add_watch(tier, self.ledger.watch(tier))  # beside the data plane's watch

    @property
    def seq(self) -> int:
        """The number of the last batch sent."""
        return self._seq

    def start(self) -> None:
        """Bind (or connect) the sockets and announce a fresh start (``AllBlocksCleared``)."""
        s = self.settings
        self._ctx = zmq.asyncio.Context()
        try:
            self._pub = zmq.Socket(self._ctx, zmq.PUB)
            self._pub.set_hwm(s.hwm)
            self._pub.setsockopt(zmq.LINGER, 500)
            if "*" in s.endpoint or s.endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(s.endpoint)
            else:
                self._pub.connect(s.endpoint)
            if s.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(s.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"kv_events_endpoint / kv_events_replay_endpoint: {exc}") from exc
        if self._replay is not None:
            self._replayer = asyncio.get_running_loop().create_task(self._serve_replay())
        # A subscriber that outlived the previous daemon forgets what it said; the re-adopted index
        # follows as BlockStored (the pending transitions of the tiers opened so far, if any).
        self._send([Cleared(), *self.ledger.take()])
        log.info("KV events on %s (replay %s, topic %r)", s.endpoint, s.replay_endpoint or "off", s.topic)

    async def close(self) -> None:
        """Send what is pending (the Cache's contents going away), then close the sockets."""
        self.flush()
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
            self._replayer = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- publishing ------------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if self._scheduled or self._pub is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a tier changed outside the daemon): sent with the next flush
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the transitions pending since the last flush as one batch."""
        self._scheduled = False
        if self._pub is None:
            return
        events = self.ledger.take()
        if events:
            self._send(events)

    def _send(self, events: Sequence[Event]) -> None:
        assert self._pub is not None
        self._seq += 1
        payload = encode_batch(time.time(), events)
        self._buffer.append((self._seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq_bytes(self._seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # high-water mark: the subscriber recovers by replay
            self.dropped += 1

    # -- replay ----------------------------------------------------------------------------------------
    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for frame in self._replay_frames(start):
                await self._replay.send_multipart([identity, b"", *frame])

    def _replay_frames(self, start: int) -> list[list[bytes]]:
        """What a subscriber asking for batches from ``start`` on gets (built without awaiting)."""
        self.flush()  # so the ring and the snapshot include every change made so far
        oldest = self._buffer[0][0] if self._buffer else self._seq + 1
        if oldest <= start <= self._seq + 1:
            frames = [[self._topic, seq_bytes(seq), payload] for seq, payload in self._buffer if seq >= start]
        else:
            snapshot = encode_batch(time.time(), self.ledger.snapshot())
            frames = [[self._topic, seq_bytes(self._seq), snapshot]]
        return [*frames, [b"", END_SEQ, b""]]


def kv_event_publisher(config: ServerConfig, pipeline: Pipeline) -> KvEventPublisher | None:
    """The daemon's publisher when ``kv_events_endpoint`` is set (watching every tier of
    ``pipeline``, tiers without a watchable index through :class:`~ucm_server.store.observed.
    ObservedTier`), else None. Call it before the pipeline opens."""
    if not config.kv_events_endpoint:
        return None
    pipeline.make_watchable()
    settings = EventsSettings(
        endpoint=config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic=config.kv_events_topic_name,
        hash_format=config.kv_events_hash_format,
        buffer_batches=config.kv_events_buffer_batches,
    )
    return KvEventPublisher(settings, pipeline.tiers)
