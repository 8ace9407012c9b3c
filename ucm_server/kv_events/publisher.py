"""The ZeroMQ side of KV events: an XPUB socket with sequence numbers and a ROUTER for replay.

Same frames as vLLM's ``ZmqEventPublisher`` (``topic, seq, payload``; replay ``[identity, b"",
start]`` answered batch by batch and ended by ``seq = -1``), so an indexer written for vLLM (or
vLLM's own ``kv_events_subscriber`` example) subscribes unchanged. Differences a router can rely on:

* A replay request whose start is no longer in the ring (or ahead of it: the daemon restarted) is
  answered with a **snapshot** of the present index (``AllBlocksCleared`` then ``BlockStored`` for
  everything held), numbered as the last batch it includes. Numbers start at the daemon's start
  time in microseconds, so they grow across restarts: a subscriber that outlived a daemon sees a
  gap, never a repeat.
* **Heartbeats**: every ``kv_events_heartbeat_s`` without a batch, the last number is sent again
  with no events. A subscriber that stayed connected while the daemon was killed and restarted
  missed the restart's announcement (ZeroMQ drops what is sent before a subscriber reconnects);
  the first heartbeat shows it a number past its own, it asks for the gap and gets the snapshot.
* Each connection sees only its **audience's** stream (:mod:`.audience`, :mod:`.access`): the XPUB
  socket decides every subscription itself (``ZMQ_XPUB_MANUAL``), whatever topic a subscriber asks
  for, and a replay request is answered from the requester's audience.

Everything runs on the daemon's event loop: the ledgers' changes are flushed once per loop turn
(``call_soon``), so a snapshot built on the loop is consistent with the numbers already sent.
Sending never blocks (XPUB drops at the high-water mark, as vLLM's PUB; replay repairs the gap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ucm_protocol.errors import ConfigError
from ucm_server.kv_events.access import AccessPlan, EndpointGuard, bind_private, plan_access
from ucm_server.kv_events.audience import AudienceRouter, Stream
from ucm_server.kv_events.ledger import MediumNames, TierWatch, medium_of
from ucm_server.kv_events.replay import MAX_FRAME_BYTES, LogLimit, ReplayRequest, read_request
from ucm_server.kv_events.wire import END_SEQ, Cleared, Event, HashFormat, seq_bytes
from ucm_server.kv_events.zap import ZAP_DOMAIN, ZapHandler, pump
from ucm_server.store.base import Tier
from ucm_server.store.watch import Watchable

if TYPE_CHECKING:
    from ucm_server.config import ServerConfig
    from ucm_server.store.pipeline import Pipeline

__all__ = ["EventsSettings", "KvEventPublisher", "kv_event_publisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventsSettings:
    topic: str = ""
    """The topic of a stream seen by a fixed audience; under CURVE each audience's topic is
    ``<topic>/<audience label>/`` (no audience's topic is a prefix of another's)."""
    hash_format: HashFormat = "int64"
    """``int64`` (vLLM's default event hashes) or ``bytes`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    buffer_batches: int = 10_000
    hwm: int = 100_000
    heartbeat_s: float = 1.0
    media: MediumNames = field(default_factory=MediumNames)


class KvEventPublisher:
    """Publishes each audience's transitions; attach it to the tiers before they open (every tier must
    be :class:`~ucm_server.store.watch.Watchable`: the store assembly's observation layer sees to it)."""

    def __init__(
        self,
        settings: EventsSettings,
        plan: AccessPlan,
        tiers: Sequence[Tier],
        owner_of: Callable[[bytes], str | None] = lambda namespace: None,
    ) -> None:
        self.settings = settings
        self.plan = plan
        base = settings.topic
        self.streams = {
            a.label: Stream(
                a,
                (base if plan.fixed is not None else f"{base}/{a.label}/").encode(),
                on_change=self._schedule,
                hash_format=settings.hash_format,
                media=settings.media,
                buffer_batches=settings.buffer_batches,
            )
            for a in plan.audiences
        }
        self.router = AudienceRouter(list(self.streams.values()), owner_of)
        self._guard = EndpointGuard()
        self._ctx: zmq.Context[Any] | None = None
        self._zap: ZapHandler | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._scheduled = False
        self._malformed = LogLimit(log)
        self.dropped = 0
        for tier in tiers:
            if not isinstance(tier, Watchable):
                raise TypeError(f"tier {tier.name!r}: no watchable index (the store assembly wraps it)")
            tier.watch_index(self._watch(tier))

    def _watch(self, tier: Tier) -> TierWatch:
        return TierWatch(self.router, tier.name, medium_of(tier, self.settings.media))

    @property
    def seq(self) -> int:
        """The number of the last batch sent (of the only stream, or the highest of all)."""
        return max(s.seq for s in self.streams.values())

    # -- sockets ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Check the endpoints (nothing is bound unless every check passes), bind, and announce a
        fresh start (``AllBlocksCleared`` and what the tiers opened so far hold) on every stream."""
        self._guard.claim(self.plan.endpoints)  # ConfigError: nothing bound, nothing held
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        try:
            if self.plan.curve_audiences is not None:
                self._zap = ZapHandler(self._ctx, self.plan.curve_audiences)
            pub_ep, *replay_ep = self.plan.endpoints
            self._pub = self._socket(zmq.XPUB)
            self._pub.set_hwm(self.settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 500)
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            bind_private(self._pub, pub_ep)
            if replay_ep:
                self._replay = self._socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                bind_private(self._replay, replay_ep[0])
        except (zmq.ZMQError, OSError) as exc:
            self._close_sockets()
            raise ConfigError(f"kv_events_endpoint / kv_events_replay_endpoint: {exc}") from exc
        self._loop.add_reader(self._pub.fileno(), self._pump_subscriptions)
        if self._replay is not None:
            self._loop.add_reader(self._replay.fileno(), self._pump_replay)
        # A subscriber that outlived the previous daemon forgets what it said; the re-adopted index
        # follows as BlockStored (the pending transitions of the tiers opened so far, if any).
        for stream in self.streams.values():
            self._send(stream, [Cleared(), *stream.ledger.take()])
        if self.settings.heartbeat_s > 0:
            self._heartbeats = self._loop.create_task(self._beat())
        fixed = self.plan.fixed
        log.info(
            "KV events on %s (replay %s, %s)",
            pub_ep.address,
            replay_ep[0].address if replay_ep else "off",
            f"audience {fixed.label}" if fixed is not None else "CURVE, audiences " + ", ".join(self.streams),
        )

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        assert self._ctx is not None
        sock: zmq.Socket[Any] = self._ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer announcing more is dropped unread
        if self.plan.curve_secret_key:
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.curve_server = True
            sock.curve_secretkey = self.plan.curve_secret_key
        return sock

    async def close(self) -> None:
        """Send what is pending (the Cache's contents going away), then close the sockets."""
        self.flush()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
            self._heartbeats = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                if self._loop is not None:
                    self._loop.remove_reader(sock.fileno())
                sock.close()
        self._pub = self._replay = None
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._guard.release()

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
        """Send the transitions pending since the last flush, one batch per stream."""
        self._scheduled = False
        if self._pub is None:
            return
        for stream in self.streams.values():
            events = stream.ledger.take()
            if events:
                self._send(stream, events)

    def _send(self, stream: Stream, events: Sequence[Event]) -> None:
        seq, payload = stream.next_batch(events)
        self._publish(stream, seq, payload)

    def _publish(self, stream: Stream, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        try:
            self._pub.send_multipart([stream.topic, seq_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # high-water mark: the subscriber recovers by replay
            self.dropped += 1
        self._pump_subscriptions()  # a send may have taken the descriptor's wake-up for a subscription

    async def _beat(self) -> None:
        """Send each stream's heartbeat when it has been quiet for ``heartbeat_s``."""
        interval = self.settings.heartbeat_s
        while True:
            due = min(s.last_sent for s in self.streams.values()) + interval
            await asyncio.sleep(max(0.01, due - time.monotonic()))
            for stream in self.streams.values():
                if time.monotonic() - stream.last_sent >= interval and self._pub is not None:
                    self._publish(stream, stream.seq, stream.heartbeat())
            self._pump_replay()  # a safety net for a lost descriptor wake-up

    # -- subscriptions ---------------------------------------------------------------------------------
    def _pump_subscriptions(self) -> None:
        if self._pub is not None and self._loop is not None:
            pump(self._loop, self._pub, self._subscription)

    def _subscription(self) -> None:
        """Whatever a peer subscribes to, it is subscribed to its audience's topic, nothing else.
        Unsubscriptions change nothing (a peer that leaves is dropped by ZeroMQ)."""
        assert self._pub is not None
        frame = self._pub.recv(zmq.NOBLOCK, copy=False)
        if frame.bytes[:1] != b"\x01":
            return
        stream = self._stream_of(frame)
        if stream is not None:
            self._pub.setsockopt(zmq.SUBSCRIBE, stream.topic)  # applies to the peer just read

    def _stream_of(self, frame: zmq.Frame) -> Stream | None:
        if self.plan.fixed is not None:
            return self.streams[self.plan.fixed.label]
        try:
            label = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        return self.streams.get(str(label))

    # -- replay ----------------------------------------------------------------------------------------
    def _pump_replay(self) -> None:
        if self._replay is not None and self._loop is not None:
            pump(self._loop, self._replay, self._serve_replay)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        request = read_request(self._replay)
        if isinstance(request, str):
            self._malformed.warning("KV events: ignoring a malformed replay request (%s)", request)
            return
        stream = self._replay_stream(request)
        if stream is None:
            return
        self.flush()  # so the ring and the snapshot include every change made so far
        for seq, payload in stream.replay(request.start):
            frames = [request.identity, b"", stream.topic, seq_bytes(seq), payload]
            self._replay.send_multipart(frames, copy=False)  # the ring's bytes, not a copy per request
        self._replay.send_multipart([request.identity, b"", b"", END_SEQ, b""])

    def _replay_stream(self, request: ReplayRequest) -> Stream | None:
        if self.plan.fixed is not None:
            return self.streams[self.plan.fixed.label]
        return self.streams.get(request.user_id or "")


def kv_event_publisher(
    config: ServerConfig,
    pipeline: Pipeline,
    tenants: set[str] | None = None,
    owner_of: Callable[[bytes], str | None] = lambda namespace: None,
) -> KvEventPublisher | None:
    """The daemon's publisher when ``kv_events_endpoint`` is set (watching every tier of
    ``pipeline``, which the store assembly built with tiers without a watchable index wrapped in
    :class:`~ucm_server.store.observed.ObservedTier`), else None. Call it before the pipeline opens:
    it checks the settings (a bad key or subscribers file, an open TCP bind) but binds nothing until
    :meth:`KvEventPublisher.start`. ``tenants``: those of ``auth_tokens_file``; ``owner_of``: a
    namespace's tenant (None: none)."""
    if not config.kv_events_endpoint:
        return None
    plan = plan_access(config, tenants)
    settings = EventsSettings(
        topic=config.kv_events_topic_name,
        hash_format=config.kv_events_hash_format,
        buffer_batches=config.kv_events_buffer_batches,
        heartbeat_s=config.kv_events_heartbeat_s,
        media=MediumNames(
            persistent=config.kv_events_persistent_medium, shared=config.kv_events_shared_medium
        ),
    )
    return KvEventPublisher(settings, plan, pipeline.tiers, owner_of)
