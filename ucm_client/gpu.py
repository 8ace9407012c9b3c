"""Moved: kept as re-exports until 0.2 (tests and third-party code import these names from here).

Export and ordering are :mod:`ucm_client.cuda_ipc`, vLLM's KV-cache layout is
:mod:`ucm_client.vllm.cuda_kv`, :func:`layer_key` is :mod:`ucm_client.vllm.identity` and
:class:`LayerwiseLoad` is :mod:`ucm_client.layerwise`. Importing this module loads no torch.
"""

from __future__ import annotations

from ucm_client.cuda_ipc import (
    IPC_HANDLE_BYTES,
    CudaIpcExport,
    CudaUnavailable,
    StreamMark,
    as_export,
    export_pointer,
    export_tensor,
    producers_done,
)
from ucm_client.layerwise import LayerwiseLoad
from ucm_client.vllm.cuda_kv import CudaKVCache
from ucm_client.vllm.identity import layer_key

__all__ = [
    "IPC_HANDLE_BYTES",
    "CudaIpcExport",
    "CudaKVCache",
    "CudaUnavailable",
    "LayerwiseLoad",
    "StreamMark",
    "as_export",
    "export_pointer",
    "export_tensor",
    "layer_key",
    "producers_done",
]
