"""The scheduler half of cold KV: order cold blocks dumped, free them once durable, give scratch blocks.

vLLM 0.32's full-attention manager never frees a block before its request finishes, but the
sliding-window manager shows how a block leaves a running request: it is replaced by the null block
in the request's block list (``SingleTypeKVCacheManager._remove_blocks_in_range``) and returned to
the pool. :class:`ColdKVPlanner` does the same for a long sparse request's cold blocks, and only once
``ucm-server`` answers a lookup for every (block, layer) object: the free is what lets another long
request fit. In their place the request gets ``num_kept(max blocks)`` scratch blocks from the pool
(enough for any ESA selection), which the workers fill with the selected cold blocks.

:class:`ColdKVScheduler` is vLLM's scheduler with the planner wired in (``scheduler_cls``); it is
used with a connector that carries the sparse channel (``UCMConnector`` or ``UcmSparseConnector``)
and its ``cold_kv`` setting.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from ucm_client.sparse.base import layer_index
from ucm_client.sparse.coldkv.orders import (
    ColdDump,
    ColdKVConfig,
    ColdKVStepMeta,
    ColdRelease,
    SupportsColdKV,
    cold_block_key,
)
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sync import UcmClient

__all__ = ["ColdKVPlanner", "ColdKVScheduler"]


@dataclass(slots=True)
class _Offload:
    """One request's cold range: dumped (``scratch`` empty) or released (``scratch`` held)."""

    first: int
    last: int
    physical: tuple[int, ...]
    scratch: list[Any]


class ColdKVPlanner:
    """Decides, per step, which requests' cold blocks are dumped, released, or forgotten."""

    def __init__(
        self,
        config: ColdKVConfig,
        *,
        manager: Any,
        block_pool: Any,
        budget: BlockBudget,
        block_size: int,
        layers: Sequence[int],
        requests: Mapping[str, Any],
        max_model_len: int,
    ) -> None:
        self.config = config
        self.nonce = uuid.uuid4().hex
        self.namespace = config.namespace_bytes(self.nonce)
        self.client = UcmClient(config.target, client_name="ucm-cold-kv-scheduler")
        # Deleting a finished request's objects is hygiene, not on the step's critical path (one
        # Delete of 72 objects was seen taking 3 s while the daemon wrote them back to its Posix tier).
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucm-cold-kv-delete")
        self._manager = manager
        self._pool = block_pool
        self._budget = budget
        self._block_size = block_size
        self._layers = tuple(layers)
        self._requests = requests
        self._max_model_len = max_model_len
        self._dumped: dict[str, _Offload] = {}
        self._released: dict[str, _Offload] = {}
        self._new_releases: list[ColdRelease] = []
        self.released_history: dict[str, _Offload] = {}
        """Every release of this engine, by request (tests check the freed ids were reused)."""
        self._forget: set[str] = set()
        self.trace: Counter[str] = Counter()
        """Counts of ``dumps``, ``released_blocks``, ``scratch_blocks``, ``not_durable``, ``dropped``."""

    def keys(self, request_id: str, first: int, last: int) -> list[bytes]:
        return [
            cold_block_key(self.nonce, request_id, layer, b)
            for b in range(first, last)
            for layer in self._layers
        ]

    # ------------------------------------------------------------ before each schedule
    def release_durable(self) -> None:
        """Free the cold blocks of every dumped request whose objects the daemon now holds."""
        for req_id, off in list(self._dumped.items()):
            present = self.client.lookup(self.namespace, self.keys(req_id, off.first, off.last)).present
            if not all(present):
                self.trace["not_durable"] += 1
                continue  # the dump is still in flight (or failed): keep the blocks, ask again
            blocks = self._manager.req_to_blocks.get(req_id, [])
            if tuple(b.block_id for b in blocks[off.first : off.last]) != off.physical:
                del self._dumped[req_id]  # preempted and reallocated meanwhile: the dump is stale
                continue
            request = self._requests[req_id]
            max_tokens = getattr(request, "max_tokens", None) or self._max_model_len
            max_blocks = -(-(request.num_prompt_tokens + max_tokens) // self._block_size)
            num_scratch = min(self._budget.num_kept(max_blocks), off.last - off.first)
            self._manager._remove_blocks_in_range(req_id, off.first, off.last)
            off.scratch = self._pool.get_new_blocks(num_scratch)
            del self._dumped[req_id]
            self._released[req_id] = self.released_history[req_id] = off
            self._new_releases.append(
                ColdRelease(req_id, off.first, off.last, tuple(b.block_id for b in off.scratch))
            )
            self.trace["released_blocks"] += off.last - off.first
            self.trace["scratch_blocks"] += num_scratch

    # ------------------------------------------------------------ inside schedule (connector meta)
    def step_meta(self, scheduler_output: Any) -> ColdKVStepMeta:
        """This step's orders: dumps for requests whose prefill finished before this step."""
        dumps = []
        init, local = self._budget.init_window_sz, self._budget.local_window_sz
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id in self._dumped or req_id in self._released:
                continue
            request = self._requests.get(req_id)
            if request is None or request.num_computed_tokens < request.num_prompt_tokens:
                continue  # still in prefill: its KV is not all written
            first, last = init, request.num_computed_tokens // self._block_size - local
            if last - first < self.config.min_cold_blocks:
                continue
            blocks = self._manager.req_to_blocks[req_id][first:last]
            physical = tuple(b.block_id for b in blocks)
            self._dumped[req_id] = _Offload(first, last, physical, [])
            dumps.append(ColdDump(req_id, tuple(range(first, last)), physical))
            self.trace["dumps"] += 1
        meta = ColdKVStepMeta(self.nonce, tuple(dumps), tuple(self._new_releases), frozenset(self._forget))
        self._new_releases.clear()
        self._forget.clear()
        return meta

    # ------------------------------------------------------------ finish / preemption
    def drop(self, request_id: str) -> None:
        """The request's blocks are being freed (finished or preempted): free its scratch too."""
        off = self._released.pop(request_id, None) or self._dumped.pop(request_id, None)
        if off is None:
            return
        if off.scratch:
            self._pool.free_blocks(off.scratch)
        self._forget.add(request_id)
        self.trace["dropped"] += 1
        # Its objects are of no use to anyone now (keys carry this engine's nonce): drop them.
        self._deleter.submit(self.client.delete, self.namespace, self.keys(request_id, off.first, off.last))

    def close(self) -> None:
        self._deleter.shutdown(wait=True)
        self.client.close()


class ColdKVScheduler(Scheduler):
    """vLLM's scheduler with cold KV: configure ``scheduler_cls`` to this class' path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cold: ColdKVPlanner | None = None
        connector = self.connector
        if not isinstance(connector, SupportsColdKV) or connector.cold_config is None:
            raise SparseInputError(
                "ColdKVScheduler needs kv_transfer_config with UCMConnector or UcmSparseConnector, "
                "ucm_sparse_config and a cold_kv entry"
            )
        if self.parallel_config.world_size != 1:
            # Keys carry no rank: two workers would overwrite each other's shard of a block.
            raise SparseInputError(
                f"cold KV supports one worker (tensor and pipeline parallel size 1), this engine has "
                f"{self.parallel_config.world_size}"
            )
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise SparseInputError(f"cold KV supports one KV cache group, this model has {len(managers)}")
        budget = connector.sparse_budget()
        if budget is None:
            raise SparseInputError("cold KV needs a block-sparse method (ESA, GSA, KVStarMultiStep) enabled")
        group = self.kv_cache_config.kv_cache_groups[0]
        self.cold = ColdKVPlanner(
            connector.cold_config,
            manager=managers[0],
            block_pool=self.kv_cache_manager.block_pool,
            budget=budget,
            block_size=self.block_size,
            layers=sorted(layer_index(name) for name in group.layer_names),
            requests=self.requests,
            max_model_len=self.max_model_len,
        )
        connector.attach_cold_planner(self.cold)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.cold is not None:
            self.cold.release_durable()
        return super().schedule(*args, **kwargs)

    def _free_request_blocks(self, request: Any) -> None:
        if self.cold is not None:
            self.cold.drop(request.request_id)
        super()._free_request_blocks(request)

    def shutdown(self) -> None:
        super().shutdown()
        if self.cold is not None:
            self.cold.close()
