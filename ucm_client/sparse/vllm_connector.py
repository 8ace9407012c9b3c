"""The public path of ``UcmSparseConnector`` (what ``kv_connector_module_path`` names); the connector
itself is :mod:`ucm_client.sparse.vllm.connector`."""

from ucm_client.sparse.vllm.connector import (
    SparseConnectorMetadata,
    UcmSparseConnector,
    cold_worker,
    kv_transfer_config,
    scheduler_bridge,
)

__all__ = [
    "SparseConnectorMetadata",
    "UcmSparseConnector",
    "cold_worker",
    "kv_transfer_config",
    "scheduler_bridge",
]
