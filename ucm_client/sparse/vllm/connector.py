"""``UcmSparseConnector``: the channel that carries sparse metadata from vLLM's scheduler to its workers.

vLLM has exactly one supported path from the scheduler to the workers for out-of-tree code: the KV
connector's metadata (built by ``build_connector_meta`` in the engine core, bound by
``bind_connector_metadata`` in every worker before the forward). This connector uses it for the
sparse method's request-level hooks and nothing else: it moves no KV, so every load/save hook is a
no-op. Configure it as::

    kv_transfer_config={"kv_connector": "UcmSparseConnector",
                        "kv_connector_module_path": "ucm_client.sparse.vllm_connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"ucm_sparse_config": {...}}}

With a ``cold_kv`` entry in the extra config (and ``scheduler_cls`` set to
:class:`~ucm_client.sparse.coldkv_scheduler.ColdKVScheduler`) it also carries the cold-KV orders: long
requests' cold blocks go to ``ucm-server`` and leave vLLM's block pool (:mod:`ucm_client.sparse.coldkv`).

With it, worker state is keyed by request id (prefix caching and parallel sampling are safe) and
finished requests are dropped as the scheduler finishes them. Without it, the backend falls back to
keying rows by their first physical block, which is wrong whenever requests share a prefix; to use
it next to the UCM connector, list both in vLLM's ``MultiConnector``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm_client.sparse.base import SparseMeta, UcmSparseRole
from ucm_client.sparse.coldkv.orders import ColdKVConfig, ColdKVStepMeta, ColdStepPlanner
from ucm_client.sparse.coldkv.worker import ColdKVWorker
from ucm_client.sparse.config import BlockBudget, load_sparse_config
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.methods.block_sparse import BlockSparseMethod
from ucm_client.sparse.vllm.bridge import SparseSchedulerBridge
from ucm_client.sparse.vllm.runtime import worker_runtime

__all__ = [
    "SparseConnectorMetadata",
    "UcmSparseConnector",
    "cold_worker",
    "kv_transfer_config",
    "scheduler_bridge",
]

_BRIDGE: SparseSchedulerBridge | None = None
_COLD_WORKER: ColdKVWorker | None = None


def kv_transfer_config(
    ucm_sparse_config: Mapping[str, Any], cold_kv: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads this connector with ``ucm_sparse_config``.

    ``cold_kv`` (see :class:`~ucm_client.sparse.coldkv.orders.ColdKVConfig`) also needs
    ``scheduler_cls=ucm_client.sparse.coldkv_scheduler.ColdKVScheduler``.
    """
    extra: dict[str, Any] = {"ucm_sparse_config": dict(ucm_sparse_config)}
    if cold_kv is not None:
        extra["cold_kv"] = dict(cold_kv)
    return {
        "kv_connector": "UcmSparseConnector",
        "kv_connector_module_path": "ucm_client.sparse.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def scheduler_bridge() -> SparseSchedulerBridge | None:
    """The scheduler bridge of the connector built last in this process (tests read its trace)."""
    return _BRIDGE


def cold_worker() -> ColdKVWorker | None:
    """The cold-KV worker of the connector registered last in this process (tests read its stats)."""
    return _COLD_WORKER


@dataclass(slots=True)
class SparseConnectorMetadata(KVConnectorMetadata):
    """One step's sparse metadata (``None`` when sparse attention is off)."""

    sparse: SparseMeta | None
    cold: ColdKVStepMeta | None = None


class UcmSparseConnector(KVConnectorBase_V1):
    """KV connector whose only job is the sparse scheduler → worker channel."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        global _BRIDGE
        super().__init__(vllm_config, role, kv_cache_config)
        self._bridge: SparseSchedulerBridge | None = None
        self._cold_planner: ColdStepPlanner | None = None
        self._cold_worker: ColdKVWorker | None = None
        raw_extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra = dict(raw_extra) if raw_extra else None
        self.cold_config = ColdKVConfig.from_extra(extra)
        """The ``cold_kv`` setting (``None``: every block stays in vLLM's cache)."""
        if role is KVConnectorRole.SCHEDULER:
            config = load_sparse_config(extra)
            if config is not None and config.enabled:
                method = UcmSparseFactory.from_config(config, UcmSparseRole.SCHEDULER)
                self._bridge = SparseSchedulerBridge(method, int(vllm_config.cache_config.block_size))
            _BRIDGE = self._bridge

    # ------------------------------------------------------------ scheduler
    def sparse_budget(self) -> BlockBudget | None:
        """The block budget of the configured method, if it is block-sparse (what cold KV sizes by)."""
        method = None if self._bridge is None else self._bridge.method
        return method.spec.budget() if isinstance(method, BlockSparseMethod) else None

    def attach_cold_planner(self, planner: ColdStepPlanner) -> None:
        """Called by :class:`~ucm_client.sparse.coldkv_scheduler.ColdKVScheduler` once it is built."""
        self._cold_planner = planner

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sparse = None if self._bridge is None else self._bridge.build(scheduler_output)
        cold = None if self._cold_planner is None else self._cold_planner.step_meta(scheduler_output)
        return SparseConnectorMetadata(sparse, cold)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._bridge is not None:
            self._bridge.finish(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _COLD_WORKER
        if self.cold_config is not None:
            if _COLD_WORKER is not None:  # a previous engine of this process that was not shut down
                _COLD_WORKER.close()
            _COLD_WORKER = self._cold_worker = ColdKVWorker(self.cold_config, kv_caches)

    def shutdown(self) -> None:
        """Release the cold-KV worker's daemon client and staging buffer (the worker's shutdown)."""
        global _COLD_WORKER
        worker, self._cold_worker = self._cold_worker, None
        if worker is not None:
            worker.close()
            if _COLD_WORKER is worker:
                _COLD_WORKER = None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        runtime = worker_runtime()
        if not isinstance(connector_metadata, SparseConnectorMetadata):
            return
        if runtime is not None:
            runtime.bind_step_meta(connector_metadata.sparse)
        cold = connector_metadata.cold
        if cold is not None:
            if _COLD_WORKER is None:
                raise RuntimeError("cold KV metadata arrived before the worker registered its KV caches")
            if cold.releases and (runtime is None or not isinstance(runtime.method, BlockSparseMethod)):
                raise RuntimeError("cold KV released blocks, but this worker runs no block-sparse method")
            _COLD_WORKER.apply(cold)
            if runtime is not None and isinstance(runtime.method, BlockSparseMethod):
                runtime.method.block_resolver = _COLD_WORKER

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
