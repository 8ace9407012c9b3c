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

Hybrid models (several KV cache groups: vLLM's hybrid KV cache manager) store each group under its
own namespace, and a hit of ``n`` blocks is granted only where every group can serve it: a full
attention group needs blocks ``0..n-1``, a sliding-window group only the blocks inside the window of
the hit's next token (``CacheGroup.first_block``). Loads and saves follow vLLM's per-group block
table: a sliding-window group's blocks outside the window are vLLM's null block there, and are
neither loaded nor saved.

A Mamba group (``mamba_cache_mode="align"``) holds one recurrent state per block boundary it
reached: block ``i`` holds the state after token ``(i + 1) * block_size``, every other entry of its
table is null. Each state block is saved when a step ends on its boundary (the only time it is not
null below the running state), under the prefix's key. A hit must end on a block boundary where
every Mamba group stored its state, so a hit of ``n`` blocks is granted only when ``n *
block_size`` tokens still leave one to compute; it loads the Mamba group's block ``n - 1`` (where
vLLM keeps the state of a prefix hit), and, when loaded synchronously, the block the step runs from
(the table's last) too: vLLM's V1 model runner copies the state from block ``n - 1`` into that block
(``preprocess_mamba``) before it calls the connector's ``start_load_kv``, so the copy may have read
the block before the load filled it. Loading both makes the order irrelevant (an async load ends
before the request is scheduled, so vLLM's copy reads the loaded state).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ucm_client import UcmClient, tracing
from ucm_client.errors import UcmError
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.disagg import PdRole
from ucm_client.vllm.identity import KeySpace, block_keys, layer_key
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.prefetch import start_prefetch
from ucm_client.vllm.retention import Retention, retention_of
from ucm_client.vllm.stats import UcmConnectorStats

__all__ = ["MAX_LOOKUP_KEYS", "NULL_BLOCK_ID", "UcmScheduler", "hit_tokens"]

logger = logging.getLogger(LOGGER_NAME)

MAX_LOOKUP_KEYS = 65536
_SAVED_MEMORY = 4096
"""Keys in one Lookup at most (the daemon's default ``max_batch_blocks``). Only layerwise lookups
(blocks x layers keys) come near it: a longer prefix is asked in several Lookups, in order, stopping
at the first one that does not hit in full."""


NULL_BLOCK_ID = 0
"""vLLM's null block (``BlockPool.null_block``, the pool's first block, never handed to a request): it
fills a sliding-window group's block table where blocks fell out of the window. Never moved."""


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
    block_ids: list[list[int]] = field(default_factory=list)
    """vLLM's block table, one list per KV cache group (block index -> block id)."""
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
        self._namespaces = keyspace.shard_namespaces()
        """One per TP rank (and pipeline stage): a hit needs every shard."""
        self._group_namespaces = [keyspace.shard_namespaces(group.index) for group in keyspace.groups]
        """Hybrid models: each group's shard namespaces."""
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
        self._pd = PdRole.from_vllm(vllm_config, config.pd_wait_timeout_s)

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

    def _lookup(self, keys: list[bytes], num_tokens: int) -> int:
        """Stored prefix length (blocks) present for every TP rank (and group); 0 when the daemon is down."""
        if not keys:
            return 0
        client = self._link.client()
        if client is None:
            self._stats.add(daemon_unavailable=1)
            return 0
        started = time.monotonic()
        try:
            if self._keyspace.hybrid:
                prefix = self._hybrid_prefix(client, keys, num_tokens)
            else:
                prefix = self._single_prefix(client, keys)
        except UcmError as exc:
            if self._link.failed(exc):
                self._stats.add(daemon_unavailable=1)
            else:
                logger.warning("UCM scheduler: lookup failed: %s", exc)
            return 0
        finally:
            self._stats.add(lookup_seconds=time.monotonic() - started)
        self._link.succeeded()
        if prefix and self._config.prefetch_on_lookup:  # promote to a faster tier while vLLM schedules
            self._prefetch(client, keys, prefix, num_tokens)
        return prefix

    def _prefetch(self, client: UcmClient, keys: list[bytes], prefix: int, num_tokens: int) -> None:
        """Start promoting the ``prefix`` blocks of a hit into the daemon's Cache: per group, the
        blocks the load will read (a sliding-window group only those inside the window)."""
        if not self._keyspace.hybrid:
            stored, per_block = self._stored_keys(keys)
            start_prefetch(client, self._namespaces, stored[: prefix * per_block])
            return
        end_token = min(prefix * self._block_size, num_tokens - 1)
        for group in self._keyspace.groups:
            first = 0 if group.kind == "full" else group.first_block(end_token, self._block_size)
            start_prefetch(client, self._group_namespaces[group.index], keys[first:prefix])

    def _single_prefix(self, client: UcmClient, keys: list[bytes]) -> int:
        """One KV cache group: the prefix every rank holds (each rank asked only for what the last had)."""
        stored, per_block = self._stored_keys(keys)
        prefix = len(stored) // per_block
        for namespace in self._namespaces:
            prefix = self._stored_prefix(client, namespace, stored[: prefix * per_block], per_block)
            if prefix == 0:
                break
        return prefix

    def _present(self, client: UcmClient, namespaces: list[bytes], keys: list[bytes]) -> list[bool]:
        """Per key: stored under every one of ``namespaces`` (a group's TP ranks)."""
        present = [True] * len(keys)
        for namespace in namespaces:
            for start in range(0, len(keys), MAX_LOOKUP_KEYS):
                part = client.lookup(namespace, keys[start : start + MAX_LOOKUP_KEYS]).present
                self._stats.add(lookups=1)
                for i, hit in enumerate(part, start):
                    present[i] = present[i] and hit
        return present

    def _hybrid_prefix(self, client: UcmClient, keys: list[bytes], num_tokens: int) -> int:
        """The longest hit, in blocks, that every group can serve on every rank.

        A full-attention group must hold every block of the hit; a sliding-window group only those
        vLLM keeps for the hit's next token (the window), so its older blocks may be missing. The
        hit ends where vLLM's grant ends (``hit_tokens``: the last token of a full hit recomputed).
        """
        groups = self._keyspace.groups
        present = {g.index: self._present(client, self._group_namespaces[g.index], keys) for g in groups}
        longest = len(keys)
        for group in groups:
            if group.kind == "full":
                flags = present[group.index]
                longest = min(longest, flags.index(False) if False in flags else len(flags))
        states = any(g.kind == "mamba" for g in groups)
        for blocks in range(longest, 0, -1):
            end_token = min(blocks * self._block_size, num_tokens - 1)
            if states and end_token != blocks * self._block_size:
                continue  # a Mamba state exists only at a block boundary
            if all(
                all(present[g.index][g.first_block(end_token, self._block_size) : blocks])
                for g in groups
                if g.kind != "full"
            ):
                return blocks
        return 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request, retention=retention_of(request))
        state.request = request
        state.local_tokens = num_computed_tokens
        if not self._config.enable_load:
            return 0, False
        if state.stored_blocks is None:
            keys = self._keys(state)
            trace_headers = getattr(request, "trace_headers", None)
            with tracing.scheduler_lookup(request.request_id, trace_headers, len(keys)) as found:
                stored = self._lookup(keys, request.num_tokens)
                found(stored)
            if self._pd.must_wait(request, stored, len(keys)):  # a prefill's saves not all visible yet
                return None, False
            state.stored_blocks = stored
            self._stats.add(query_tokens=max(request.num_tokens - num_computed_tokens, 0))
        granted = hit_tokens(state.stored_blocks, self._block_size, request.num_tokens, num_computed_tokens)
        if self._keyspace.has_state_groups and (num_computed_tokens + granted) % self._block_size:
            granted = 0  # a Mamba state exists only at a block boundary (vLLM's own hits end on one)
        return granted, bool(granted) and self._config.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        state = self._requests[request.request_id]
        first = state.local_tokens // self._block_size
        end = -(-(state.local_tokens + num_external_tokens) // self._block_size)
        keys = self._keys(state)
        for group, block_ids in enumerate(blocks.get_block_ids()):
            if self._keyspace.groups[group].kind == "mamba":
                pairs = self._state_load(block_ids, keys, state.local_tokens + num_external_tokens)
            else:
                pairs = [
                    (b, k)
                    for b, k in zip(block_ids[first:end], keys[first:end], strict=False)
                    if b != NULL_BLOCK_ID
                ]
            if not pairs:
                continue
            self._pending_loads.append(
                BlockTransfer(
                    request.request_id,
                    tuple(b for b, _ in pairs),
                    tuple(k for _, k in pairs),
                    is_async=self._config.load_async,
                    group=group,
                )
            )
        self._stats.add(hit_tokens=num_external_tokens)

    def _state_load(self, block_ids: list[int], keys: list[bytes], hit: int) -> list[tuple[int, bytes]]:
        """A Mamba group's loads for a hit of ``hit`` tokens (a block boundary): the state into the
        hit's last block, and (sync loads) into the block the step runs from, the table's last."""
        last = hit // self._block_size - 1
        if hit % self._block_size or not 0 <= last < min(len(block_ids), len(keys)):
            raise RuntimeError(
                f"UCM scheduler: a Mamba state hit must end on a block boundary (got {hit} tokens)"
            )
        targets = [block_ids[last]]
        if not self._config.load_async and block_ids[-1] not in (NULL_BLOCK_ID, block_ids[last]):
            targets.append(block_ids[-1])
        return [(b, keys[last]) for b in targets if b != NULL_BLOCK_ID]

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: Any) -> UcmConnectorMetadata:
        meta = UcmConnectorMetadata(
            loads=self._pending_loads,
            preempted_req_ids=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        )
        self._pending_loads = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        allocated: set[int] = set()

        for new in scheduler_output.scheduled_new_reqs:
            if self._keyspace.hybrid:
                allocated.update(b for ids in new.block_ids for b in ids)
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(meta, new.req_id, state, new.num_computed_tokens + num_scheduled[new.req_id])

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if self._keyspace.hybrid and new_ids is not None:
                allocated.update(b for ids in new_ids for b in ids)
            state = self._requests.get(req_id)
            if state is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for table, ids in zip(state.block_ids, new_ids, strict=True):
                    table.extend(ids)
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        allocated.discard(NULL_BLOCK_ID)
        meta.allocated_block_ids = frozenset(allocated)
        return meta

    def _plan_save(self, meta: UcmConnectorMetadata, req_id: str, state: _Request, computed: int) -> None:
        """Save the blocks that become full (and hashed) once this step's tokens are computed.

        Per KV cache group, only the blocks vLLM holds (a sliding-window group's null entries are
        blocks vLLM never computed here: they were loaded, or fell out of the window before).
        """
        if not self._config.enable_save or not self._pd.saves or not state.block_ids:
            return
        keys = self._keys(state)
        full = min(computed // self._block_size, len(keys), max(len(ids) for ids in state.block_ids))
        start = max(state.saved_blocks, state.stored_blocks or 0)
        if full <= start:
            return
        if state.retention is not None and state.retention.store is False:  # {"ucm": {"store": false}}
            self._stats.add(save_declined_blocks=full - start)
            state.saved_blocks = full
            return
        for group, table in enumerate(state.block_ids):
            pairs = [
                (table[i], keys[i]) for i in range(start, min(full, len(table))) if table[i] != NULL_BLOCK_ID
            ]
            if pairs:
                meta.saves.append(
                    BlockTransfer(req_id, tuple(b for b, _ in pairs), tuple(k for _, k in pairs), group=group)
                )
                state.had_save = True
        state.saved_blocks = full

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a request with saves until the workers report them stored."""
        state = self._requests.pop(request.request_id, None)
        self._pd.forget(request.request_id)
        if state is not None and state.retention is not None and state.retention.retains:
            stored = max(state.saved_blocks, state.stored_blocks or 0)
            keys = self._keys(state)[:stored]
            saved = request.request_id in self._saved
            self._saved.pop(request.request_id, None)
            if state.had_save and not saved:
                self._retain_after_save[request.request_id] = (state.retention, keys)
            else:
                self._retain(request.request_id, state.retention, keys)
        return (state is not None and state.had_save), self._pd.finished_params(request)

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
        namespaces = [ns for group in self._group_namespaces for ns in group]  # one group unless hybrid
        try:
            for namespace in namespaces:  # a window group's blocks out of its window are just missing
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
