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
from ucm_client.sparse.config import load_sparse_config
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.scheduler_bridge import SparseSchedulerBridge
from ucm_client.sparse.vllm_runtime import worker_runtime

__all__ = ["SparseConnectorMetadata", "UcmSparseConnector", "kv_transfer_config", "scheduler_bridge"]

_BRIDGE: SparseSchedulerBridge | None = None


def kv_transfer_config(ucm_sparse_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` that loads this connector with ``ucm_sparse_config``."""
    return {
        "kv_connector": "UcmSparseConnector",
        "kv_connector_module_path": __name__,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"ucm_sparse_config": dict(ucm_sparse_config)},
    }


def scheduler_bridge() -> SparseSchedulerBridge | None:
    """The scheduler bridge of the connector built last in this process (tests read its trace)."""
    return _BRIDGE


@dataclass(slots=True)
class SparseConnectorMetadata(KVConnectorMetadata):
    """One step's sparse metadata (``None`` when sparse attention is off)."""

    sparse: SparseMeta | None


class UcmSparseConnector(KVConnectorBase_V1):
    """KV connector whose only job is the sparse scheduler → worker channel."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        global _BRIDGE
        super().__init__(vllm_config, role, kv_cache_config)
        self._bridge: SparseSchedulerBridge | None = None
        if role is KVConnectorRole.SCHEDULER:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            config = load_sparse_config(dict(extra) if extra else None)
            if config is not None and config.enabled:
                method = UcmSparseFactory.from_config(config, UcmSparseRole.SCHEDULER)
                self._bridge = SparseSchedulerBridge(method, int(vllm_config.cache_config.block_size))
            _BRIDGE = self._bridge

    # ------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sparse = None if self._bridge is None else self._bridge.build(scheduler_output)
        return SparseConnectorMetadata(sparse)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._bridge is not None:
            self._bridge.finish(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        runtime = worker_runtime()
        if runtime is not None and isinstance(connector_metadata, SparseConnectorMetadata):
            runtime.bind_step_meta(connector_metadata.sparse)

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
