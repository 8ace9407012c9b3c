"""Scheduler half of the connector: decide what to load and what to save, from block hashes alone.

Runs once, in vLLM's EngineCore process. For each new request it asks the daemon, in one batched
``Lookup`` per TP rank, how long a prefix of the request's blocks is stored for *every* rank's shard
(a block missing on one rank is a miss for all), caches the answer (vLLM may ask again while the
request waits for memory), and grants vLLM the part beyond its own prefix cache. Each step it turns
the scheduler output into the worker metadata: the granted hits to load into the blocks vLLM just
allocated, and the full blocks the step completes, to save.

With ``use_layerwise`` a block is one object per attention layer, and the lookup asks for all of
them (still one batched ``Lookup`` per rank, the keys block by block, layer by layer): a block is
granted only if every layer of it is stored, so a missing layer shortens the hit instead of
failing a load. A layer that disappears between lookup and load is a load error like any other.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ucm_client import UcmClient
from ucm_client.errors import UcmError
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.identity import KeySpace, block_keys, layer_key
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.retention import Retention, retention_of
from ucm_client.vllm.stats import UcmConnectorStats

__all__ = ["MAX_LOOKUP_KEYS", "UcmScheduler", "hit_tokens"]

logger = logging.getLogger(LOGGER_NAME)

MAX_LOOKUP_KEYS = 65536
_SAVED_MEMORY = 4096
"""Keys in one Lookup at most (the daemon's default ``max_batch_blocks``). Only layerwise lookups
(blocks x layers keys) come near it: a longer prefix is asked in several Lookups, in order, stopping
at the first one that does not hit in full."""


def hit_tokens(stored_blocks: int, block_size: int, num_tokens: int, num_computed_tokens: int) -> int:
    """External tokens to grant: the stored prefix beyond vLLM's own, never the whole request.

    vLLM must compute at least one token to sample the next, so a prefix covering the whole request
    is cut to ``num_tokens - 1``: the last block is still loaded, its last token recomputed.
    """
    stored = min(stored_blocks * block_size, num_tokens - 1)
    return max(stored - num_computed_tokens, 0)


@dataclass(slots=True)
class _Request:
    """What the scheduler half remembers about one live request."""

    request: Any
    stored_blocks: int | None = None
    """Length of the stored prefix, in blocks, from the (cached) lookup; None = not asked yet."""
    local_tokens: int = 0
    """vLLM's own prefix-cache hit at the last ``get_num_new_matched_tokens`` call."""
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    """Blocks below this index are stored or already handed to a worker to save."""
    had_save: bool = False
    keys: list[bytes] = field(default_factory=list)
    hashed: int = -1
    """``len(request.block_hashes)`` when ``keys`` was derived (hashes only ever grow)."""
    retention: Retention | None = None
    """The request's ``kv_transfer_params["ucm"]`` entry (:mod:`ucm_client.vllm.retention`)."""


class UcmScheduler:
    """The scheduler role: lookups, load grants, save scheduling, delayed frees."""

    def __init__(self, vllm_config: Any, keyspace: KeySpace, config: ConnectorConfig):
        self._config = config
        self._keyspace = keyspace
        cache_config = vllm_config.cache_config
        self._block_size = int(cache_config.block_size)
        self._hash_block_size = int(getattr(cache_config, "hash_block_size", None) or self._block_size)
        self._namespaces = [keyspace.namespace(rank) for rank in range(keyspace.tp_size)]
        self._link = DaemonLink(
            config.target,
            reconnect_interval_s=config.reconnect_interval_s,
            connect_timeout_s=config.connect_timeout_s,
            rpc_timeout_s=config.rpc_timeout_s,
            role="scheduler",
        )
        self._requests: dict[str, _Request] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._retain_after_save: dict[str, tuple[Retention, list[bytes]]] = {}
        """Requests whose retention applies once the workers report their saves done."""
        self._saved: OrderedDict[str, None] = OrderedDict()
        """Requests the workers reported saved before vLLM finished them here (the two reports of
        one step can come in either order); bounded."""
        self._stats = UcmConnectorStats()

    # ------------------------------------------------------------------ lookups

    def _keys(self, state: _Request) -> list[bytes]:
        """The request's block keys, re-derived only when vLLM hashed new blocks."""
        hashes = state.request.block_hashes
        if len(hashes) != state.hashed:
            state.keys = block_keys(hashes, self._block_size, self._hash_block_size)
            state.hashed = len(hashes)
        return state.keys

    def _stored_keys(self, keys: list[bytes]) -> tuple[list[bytes], int]:
        """The keys the blocks are stored under, and how many of them make one block."""
        layers = self._keyspace.num_layers if self._keyspace.layerwise else 0
        if not layers:
            return keys, 1
        return [layer_key(key, layer) for key in keys for layer in range(layers)], layers

    def _stored_prefix(self, client: UcmClient, namespace: bytes, keys: list[bytes], per_block: int) -> int:
        """How many whole blocks of ``keys`` are stored as a prefix, asked in Lookups of at most
        ``MAX_LOOKUP_KEYS`` keys (whole blocks each), in order, until one does not hit in full."""
        step = max(MAX_LOOKUP_KEYS // per_block, 1) * per_block
        found = 0
        for start in range(0, len(keys), step):
            part = keys[start : start + step]
            hit = client.lookup(namespace, part).hit_prefix
            self._stats.add(lookups=1)
            found += hit
            if hit < len(part):
                break
        return found // per_block

    def _lookup(self, keys: list[bytes]) -> int:
        """Stored prefix length (blocks) present for every TP rank; 0 when the daemon is down."""
        if not keys:
            return 0
        client = self._link.client()
        if client is None:
            self._stats.add(daemon_unavailable=1)
            return 0
        started = time.monotonic()
        stored, per_block = self._stored_keys(keys)
        prefix = len(stored) // per_block
        try:
            for namespace in self._namespaces:
                prefix = self._stored_prefix(client, namespace, stored[: prefix * per_block], per_block)
                if prefix == 0:
                    break
        except UcmError as exc:
            if self._link.failed(exc):
                self._stats.add(daemon_unavailable=1)
            else:
                logger.warning("UCM scheduler: lookup failed: %s", exc)
            return 0
        finally:
            self._stats.add(lookup_seconds=time.monotonic() - started)
        self._link.succeeded()
        return prefix

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request, retention=retention_of(request))
        state.request = request
        state.local_tokens = num_computed_tokens
        if not self._config.enable_load:
            return 0, False
        if state.stored_blocks is None:
            state.stored_blocks = self._lookup(self._keys(state))
            self._stats.add(query_tokens=max(request.num_tokens - num_computed_tokens, 0))
        granted = hit_tokens(state.stored_blocks, self._block_size, request.num_tokens, num_computed_tokens)
        return granted, bool(granted) and self._config.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._requests[request.request_id]
        block_ids = list(blocks.get_block_ids()[0])
        first = state.local_tokens // self._block_size
        end = -(-(state.local_tokens + num_external_tokens) // self._block_size)
        keys = self._keys(state)[first:end]
        self._pending_loads.append(
            BlockTransfer(
                request.request_id,
                tuple(block_ids[first:end]),
                tuple(keys),
                is_async=self._config.load_async,
            )
        )
        self._stats.add(hit_tokens=num_external_tokens)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> UcmConnectorMetadata:
        meta = UcmConnectorMetadata(
            loads=self._pending_loads,
            preempted_req_ids=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        )
        self._pending_loads = []
        num_scheduled = scheduler_output.num_scheduled_tokens

        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens + num_scheduled[new.req_id])

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: UcmConnectorMetadata, req_id: str, state: _Request, computed: int) -> None:
        """Save the blocks that become full (and hashed) once this step's tokens are computed."""
        if not self._config.enable_save:
            return
        keys = self._keys(state)
        full = min(computed // self._block_size, len(keys), len(state.block_ids))
        start = max(state.saved_blocks, state.stored_blocks or 0)
        if full <= start:
            return
        meta.saves.append(BlockTransfer(req_id, tuple(state.block_ids[start:full]), tuple(keys[start:full])))
        state.saved_blocks = full
        state.had_save = True

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request with saves until the workers report them stored."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.retention is not None:
            stored = max(state.saved_blocks, state.stored_blocks or 0)
            keys = self._keys(state)[:stored]
            saved = request.request_id in self._saved
            self._saved.pop(request.request_id, None)
            if state.had_save and not saved:
                self._retain_after_save[request.request_id] = (state.retention, keys)
            else:
                self._retain(request.request_id, state.retention, keys)
        return (state is not None and state.had_save), None

    def saves_done(self, req_ids: set[str]) -> None:
        """The workers stored these requests' blocks: apply the retention they asked for."""
        for req_id in req_ids:
            parked = self._retain_after_save.pop(req_id, None)
            if parked is not None:
                self._retain(req_id, *parked)
            else:  # reported before request_finished: apply there
                self._saved[req_id] = None
                while len(self._saved) > _SAVED_MEMORY:
                    self._saved.popitem(last=False)

    def _retain(self, req_id: str, retention: Retention, keys: list[bytes]) -> None:
        """``SetRetention`` for the request's stored blocks, in every TP rank's namespace."""
        client = self._link.client()
        if not keys or client is None:
            return
        stored, _ = self._stored_keys(keys)
        try:
            for namespace in self._namespaces:
                for start in range(0, len(stored), MAX_LOOKUP_KEYS):
                    client.set_retention(
                        namespace,
                        stored[start : start + MAX_LOOKUP_KEYS],
                        pin=retention.pin,
                        ttl_s=retention.ttl_s,
                        priority=retention.priority,
                    )
        except UcmError as exc:
            if not self._link.failed(exc):
                logger.warning("UCM scheduler: retention of request %s refused: %s", req_id, exc)
            return
        self._link.succeeded()

    @property
    def stats(self) -> UcmConnectorStats:
        return self._stats

    def take_stats(self) -> UcmConnectorStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        """Apply the retention still waiting for saves vLLM never reported (the engine stopped
        stepping after the request ended: its blocks are stored by now or missing), then close."""
        for req_id, parked in list(self._retain_after_save.items()):
            self._retain(req_id, *parked)
        self._retain_after_save.clear()
        self._link.close()
