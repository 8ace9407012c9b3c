"""Which KV connectors carry sparse attention's scheduler → worker channel, and the refusal without one.

Sparse attention keyed by anything but the request is wrong as soon as two requests share a prefix
(vLLM's prefix caching gives them the same first blocks): it was measured decoding at 0.06x dense,
every step of every layer rebuilding every block's features. So the backend does not start sparse
attention in an engine whose connector does not carry the channel; the error names the exact
configuration to use instead.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from ucm_client.sparse.config import UcmSparseConfig

__all__ = ["channel_problem"]


def _carries_channel(connector: str | None, module_path: str | None) -> bool:
    if not connector or not module_path:
        return False
    try:
        cls = getattr(importlib.import_module(module_path), connector)
    except (ImportError, AttributeError):
        return False
    return bool(getattr(cls, "carries_sparse_channel", False))


def channel_problem(vllm_config: Any, config: UcmSparseConfig) -> str | None:
    """Why sparse attention cannot run keyed by request in this engine (no connector carries the
    channel), with the exact configuration to use instead; ``None`` when a connector carries it.

    vLLM's ``MultiConnector`` counts when one of its connectors carries it.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    connector = getattr(transfer, "kv_connector", None)
    module_path = getattr(transfer, "kv_connector_module_path", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    if _carries_channel(connector, module_path):
        return None
    if connector == "MultiConnector":
        for sub in extra.get("connectors") or ():
            if isinstance(sub, Mapping) and _carries_channel(
                sub.get("kv_connector"), sub.get("kv_connector_module_path")
            ):
                return None
    sparse: dict[str, Any] = {
        "enabled": config.enabled,
        "min_seq_len": config.min_seq_len,
        config.algorithm: dict(config.method_config),
    }
    if config.module_path is not None:
        sparse.update(module_path=config.module_path, class_name=config.class_name)
    storage = {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm_client.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"ucm_sparse_config": sparse},
    }
    alone = {
        "kv_connector": "UcmSparseConnector",
        "kv_connector_module_path": "ucm_client.sparse.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"ucm_sparse_config": sparse},
    }
    where = f"kv_connector {connector!r}" if connector else "no kv_transfer_config"
    return (
        f"ucm_sparse_config enables {config.algorithm}, but this engine has {where}: no connector carries "
        "the scheduler's sparse metadata to the workers, so a worker could not tell requests that share "
        "a prefix apart (vLLM's prefix caching gives them the same first blocks). Refusing to start "
        "rather than run sparse attention keyed by block. Start vLLM with --kv-transfer-config "
        f"'{json.dumps(storage)}' (prefix KV in ucm-server plus sparse attention), or "
        f"'{json.dumps(alone)}' (sparse attention alone)."
    )
