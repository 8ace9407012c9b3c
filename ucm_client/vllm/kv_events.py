"""Forward the daemon's KV events through vLLM's own publisher (``take_events``).

vLLM publishes its GPU prefix cache's events when ``kv_events_config`` is on, and adds whatever the
connector's ``take_events()`` returns to the same batch. The forwarder subscribes to ``ucm-server``'s
stream (:mod:`ucm_server.kv_events`) and hands its ``BlockStored`` / ``BlockRemoved`` to vLLM, so
one stream carries the GPU and every UCM tier. Its block hashes are vLLM's own: the daemon's keys
are ``request.block_hashes`` (:mod:`ucm_client.vllm.identity`) whenever they are 32-byte sha256
hashes of whole blocks, vLLM's default, and the daemon sends them the way vLLM's events do (the
low 64 bits as an integer by default, ``kv_events_hash_format``).

The daemon's ``AllBlocksCleared`` (a restart, a snapshot) must not be forwarded as is: in vLLM's
stream it would also wipe the GPU blocks a router knows of. So the forwarder keeps what the daemon
holds per medium and turns a snapshot into the difference (``BlockStored`` for what is new,
``BlockRemoved`` for what is gone). Sockets are polled without waiting, once per scheduler step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig

__all__ = ["EventForwarder", "forwarder_for"]

logger = logging.getLogger(LOGGER_NAME)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCHES_PER_STEP = 1000
"""Batches taken from the socket in one scheduler step (the rest wait for the next step)."""


class EventForwarder:
    """A SUB socket on the daemon's events (and its replay socket); :meth:`take` per step."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int) -> None:
        self.block_size = block_size
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.seq = -1
        self.held: dict[str, set[bytes | int]] = {}
        """What the daemon holds per medium, as far as forwarded: turns a snapshot into a diff."""
        self._out: list[KVCacheEvent] = []
        self._replay_pending = False
        self._request_replay()  # from a snapshot: what the daemon held before vLLM started

    # -- the scheduler's side -------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """Everything received since the last call, in vLLM's event classes."""
        self._drain_replay()
        for _ in range(MAX_BATCHES_PER_STEP):
            try:
                _topic, seq_bytes, payload = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq <= self.seq:
                continue
            if seq != self.seq + 1 and self._replay is not None and not self._replay_pending:
                self._request_replay(self.seq + 1)  # a gap: the replay brings it (and this batch)
            if self._replay_pending:
                continue
            self._apply(self._decoder.decode(payload), snapshot=False)
            self.seq = seq
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        self._sub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- replay ---------------------------------------------------------------------------------------
    def _request_replay(self, start: int = -1) -> None:
        if self._replay is None:
            return
        self._replay.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        self._replay_pending = True

    def _drain_replay(self) -> None:
        while self._replay is not None and self._replay_pending:
            try:
                _, _topic, seq_bytes, payload = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if seq_bytes == END_SEQ:
                self._replay_pending = False
                return
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            batch = self._decoder.decode(payload)
            snapshot = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
            if seq > self.seq or snapshot:
                self._apply(batch, snapshot=snapshot)
                self.seq = seq

    # -- events ---------------------------------------------------------------------------------------
    def _apply(self, batch: KVEventBatch, *, snapshot: bool) -> None:
        before = {m: set(h) for m, h in self.held.items()} if snapshot else None
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                if before is None:  # a restarted daemon: remove what it held, it re-announces the rest
                    before = {m: set(h) for m, h in self.held.items()}
                self.held = {}
            elif isinstance(event, BlockStored):
                fresh = list(map(_external, event.block_hashes))
                self.held.setdefault(event.medium or "", set()).update(fresh)
                if before is None:
                    self._emit(True, event.medium, fresh)
            elif isinstance(event, BlockRemoved):
                gone = list(map(_external, event.block_hashes))
                self.held.get(event.medium or "", set()).difference_update(gone)
                if before is None:
                    self._emit(False, event.medium, gone)
        if before is not None:  # forward the difference, never AllBlocksCleared
            for medium in sorted(set(before) | set(self.held)):
                old, new = before.get(medium, set()), self.held.get(medium, set())
                self._emit(False, medium, old - new)
                self._emit(True, medium, new - old)

    def _emit(self, stored: bool, medium: str | None, hashes: Iterable[bytes | int]) -> None:
        converted: list[Any] = list(hashes)
        if not converted:
            return
        if stored:
            self._out.append(
                BlockStored(
                    block_hashes=converted,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )
        else:
            self._out.append(BlockRemoved(block_hashes=converted, medium=medium))


def _external(value: bytes | int) -> bytes | int:
    """A hash as this vLLM's own events carry it: a daemon publishing whole keys (``bytes``) is
    converted the way vLLM converts its own (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); integers
    (the daemon's default ``kv_events_hash_format: int64``) already are."""
    return maybe_convert_block_hash(BlockHash(value)) if isinstance(value, bytes) else value


def forwarder_for(vllm_config: Any, config: ConnectorConfig) -> EventForwarder | None:
    """The scheduler's forwarder when both vLLM's events and the daemon's endpoint are configured."""
    if not config.kv_events_endpoint:
        return None
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events:
        logger.warning(
            "UCMConnector: kv_events_endpoint is set but vLLM's kv_events_config is off: "
            "the daemon's KV events are not forwarded"
        )
        return None
    if config.use_layerwise:
        logger.warning(
            "UCMConnector: with use_layerwise the daemon's keys are per-layer keys, not vLLM's block "
            "hashes: its KV events are not forwarded"
        )
        return None
    return EventForwarder(
        config.kv_events_endpoint, config.kv_events_replay_endpoint, int(vllm_config.cache_config.block_size)
    )
