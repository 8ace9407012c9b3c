"""The scheduler → worker channel of sparse attention, carried inside a KV connector's metadata.

vLLM has exactly one supported path from the scheduler to the workers for out-of-tree code: the KV
connector's metadata (built by ``build_connector_meta`` in the engine core, bound by
``bind_connector_metadata`` in every worker before the forward). Sparse attention needs it: only the
scheduler knows which request owns which block, and with prefix caching requests that share a prefix
share their first blocks, so a worker keying its state by any block of a row would mix requests up.
:class:`SparseChannel` is what a connector holds to carry it — the scheduler bridge (request hooks,
this step's :class:`~ucm_client.sparse.base.SparseMeta`) and, with a ``cold_kv`` setting, cold KV's
planner and worker. ``UCMConnector`` (prefix storage) and ``UcmSparseConnector`` (sparse attention
alone) both carry one, so storage plus sparse attention is one connector.

A connector class that carries it says so with ``carries_sparse_channel = True``; the attention
backend refuses to start without one (:mod:`ucm_client.sparse.vllm.carrier`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.base import SparseMeta, UcmSparseRole
from ucm_client.sparse.coldkv.orders import ColdKVConfig, ColdKVStepMeta, ColdStepPlanner
from ucm_client.sparse.coldkv.worker import ColdKVWorker
from ucm_client.sparse.config import BlockBudget, load_sparse_config
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.methods.block_sparse import BlockSparseMethod
from ucm_client.sparse.vllm.bridge import SparseSchedulerBridge
from ucm_client.sparse.vllm.runtime import worker_runtime

__all__ = [
    "SparseChannel",
    "SparseStep",
    "cold_worker",
    "scheduler_bridge",
]

_BRIDGE: SparseSchedulerBridge | None = None
_COLD_WORKER: ColdKVWorker | None = None


def scheduler_bridge() -> SparseSchedulerBridge | None:
    """The scheduler bridge of the channel built last in this process (tests read its trace)."""
    return _BRIDGE


def cold_worker() -> ColdKVWorker | None:
    """The cold-KV worker of the channel registered last in this process (tests read its stats)."""
    return _COLD_WORKER


@dataclass(frozen=True, slots=True)
class SparseStep:
    """One step's sparse orders for the workers (``None`` parts: that half is off)."""

    sparse: SparseMeta | None = None
    cold: ColdKVStepMeta | None = None


class SparseChannel:
    """The sparse halves a connector carries, one instance per connector (scheduler or worker role)."""

    def __init__(self, vllm_config: Any, scheduler: bool, extra: Mapping[str, Any] | None) -> None:
        global _BRIDGE
        self.cold_config = ColdKVConfig.from_extra(extra)
        """The ``cold_kv`` setting (``None``: every block stays in vLLM's cache)."""
        self._bridge: SparseSchedulerBridge | None = None
        self._cold_planner: ColdStepPlanner | None = None
        self._cold_worker: ColdKVWorker | None = None
        if scheduler:
            config = load_sparse_config(extra)
            if config is not None and config.enabled:
                method = UcmSparseFactory.from_config(config, UcmSparseRole.SCHEDULER)
                self._bridge = SparseSchedulerBridge(method, int(vllm_config.cache_config.block_size))
            _BRIDGE = self._bridge

    @classmethod
    def wanted(cls, extra: Mapping[str, Any] | None) -> bool:
        """Whether a connector with this extra config (and this environment) needs a channel."""
        return load_sparse_config(extra) is not None or ColdKVConfig.from_extra(extra) is not None

    # ------------------------------------------------------------ scheduler
    def sparse_budget(self) -> BlockBudget | None:
        """The block budget of the configured method, if it is block-sparse (what cold KV sizes by)."""
        method = None if self._bridge is None else self._bridge.method
        return method.spec.budget() if isinstance(method, BlockSparseMethod) else None

    def attach_cold_planner(self, planner: ColdStepPlanner) -> None:
        """Called by ``ColdKVScheduler`` once it is built."""
        self._cold_planner = planner

    def step(self, scheduler_output: Any) -> SparseStep:
        """This step's orders; call once per ``build_connector_meta``."""
        sparse = None if self._bridge is None else self._bridge.build(scheduler_output)
        cold = None if self._cold_planner is None else self._cold_planner.step_meta(scheduler_output)
        return SparseStep(sparse, cold)

    def finish(self, request_id: str) -> None:
        """The request left the scheduler (``request_finished``)."""
        if self._bridge is not None:
            self._bridge.finish(request_id)

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _COLD_WORKER
        if self.cold_config is not None:
            if _COLD_WORKER is not None:  # a previous engine of this process that was not shut down
                _COLD_WORKER.close()
            _COLD_WORKER = self._cold_worker = ColdKVWorker(self.cold_config, kv_caches)

    def bind(self, step: SparseStep) -> None:
        """Before the forward: hand the scheduler's metadata to the runtime, apply cold-KV orders."""
        runtime = worker_runtime()
        if runtime is not None:
            runtime.bind_step_meta(step.sparse)
        cold = step.cold
        if cold is None:
            return
        worker = self._cold_worker
        if worker is None:
            raise RuntimeError("cold KV metadata arrived before the worker registered its KV caches")
        if cold.releases and (runtime is None or not isinstance(runtime.method, BlockSparseMethod)):
            raise RuntimeError("cold KV released blocks, but this worker runs no block-sparse method")
        worker.apply(cold)
        if runtime is not None and isinstance(runtime.method, BlockSparseMethod):
            runtime.method.block_resolver = worker

    def shutdown(self) -> None:
        """Release the cold-KV worker's daemon client and staging buffer (the worker's shutdown)."""
        global _COLD_WORKER
        worker, self._cold_worker = self._cold_worker, None
        if worker is not None:
            worker.close()
            if _COLD_WORKER is worker:
                _COLD_WORKER = None
