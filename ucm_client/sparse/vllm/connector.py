"""``UcmSparseConnector``: sparse attention's scheduler → worker channel, alone (no KV storage).

The channel itself (:class:`~ucm_client.sparse.vllm.channel.SparseChannel`) is what any connector of
ours carries; ``UCMConnector`` carries it too when its extra config holds ``ucm_sparse_config``, so
prefix storage in ``ucm-server`` plus sparse attention is one connector. This one is for sparse
attention without storage: it moves no KV, so every load/save hook is a no-op. Configure it as::

    kv_transfer_config={"kv_connector": "UcmSparseConnector",
                        "kv_connector_module_path": "ucm_client.sparse.vllm_connector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"ucm_sparse_config": {...}}}

With a ``cold_kv`` entry in the extra config (and ``scheduler_cls`` set to
:class:`~ucm_client.sparse.coldkv_scheduler.ColdKVScheduler`) it also carries the cold-KV orders: long
requests' cold blocks go to ``ucm-server`` and leave vLLM's block pool (:mod:`ucm_client.sparse.coldkv`).

With the channel, worker state is keyed by request id (prefix caching and parallel sampling are safe)
and finished requests are dropped as the scheduler finishes them. Without a connector that carries
it, the attention backend refuses to start sparse attention (:mod:`ucm_client.sparse.vllm.carrier`).
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

from ucm_client.sparse.coldkv.orders import ColdKVConfig, ColdKVStepMeta, ColdStepPlanner
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.vllm.channel import SparseChannel, SparseStep, cold_worker, scheduler_bridge

__all__ = [
    "SparseConnectorMetadata",
    "UcmSparseConnector",
    "cold_worker",
    "kv_transfer_config",
    "scheduler_bridge",
]


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


@dataclass(slots=True)
class SparseConnectorMetadata(KVConnectorMetadata):
    """One step's sparse metadata (``None`` parts: that half is off)."""

    sparse: Any
    cold: ColdKVStepMeta | None = None

    @property
    def step(self) -> SparseStep:
        return SparseStep(self.sparse, self.cold)


class UcmSparseConnector(KVConnectorBase_V1):
    """KV connector whose only job is the sparse scheduler → worker channel."""

    carries_sparse_channel = True

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        raw_extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra = dict(raw_extra) if raw_extra else None
        self.channel = SparseChannel(vllm_config, role is KVConnectorRole.SCHEDULER, extra)

    @property
    def cold_config(self) -> ColdKVConfig | None:
        """The ``cold_kv`` setting (``None``: every block stays in vLLM's cache)."""
        return self.channel.cold_config

    # ------------------------------------------------------------ scheduler
    def sparse_budget(self) -> BlockBudget | None:
        return self.channel.sparse_budget()

    def attach_cold_planner(self, planner: ColdStepPlanner) -> None:
        self.channel.attach_cold_planner(planner)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        step = self.channel.step(scheduler_output)
        return SparseConnectorMetadata(step.sparse, step.cold)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.channel.finish(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.channel.register_kv_caches(kv_caches)

    def shutdown(self) -> None:
        """Release the cold-KV worker's daemon client and staging buffer (the worker's shutdown)."""
        self.channel.shutdown()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, SparseConnectorMetadata):
            self.channel.bind(connector_metadata.step)

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
