"""Sparse attention for UCM: the ``UcmSparseBase`` lifecycle, the method factory and the built-ins.

Importing this package does not import vLLM; the vLLM integration lives in
:mod:`ucm_client.sparse.vllm.plugin` (``register()``, ``verify_patches()``) and is loaded only there.
"""

from ucm_client.sparse.base import (
    AttentionInputs,
    LayerSpec,
    PagedAttentionMeta,
    SparseMeta,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm_client.sparse.config import UcmSparseConfig, load_sparse_config
from ucm_client.sparse.errors import (
    SparseConfigError,
    SparseError,
    SparseInputError,
    SparseRoleError,
    SparseSessionError,
    UnknownSparseMethodError,
)
from ucm_client.sparse.factory import UcmSparseFactory

__all__ = [
    "AttentionInputs",
    "LayerSpec",
    "PagedAttentionMeta",
    "SparseConfigError",
    "SparseError",
    "SparseInputError",
    "SparseMeta",
    "SparseRoleError",
    "SparseSessionError",
    "UcmSparseBase",
    "UcmSparseConfig",
    "UcmSparseFactory",
    "UcmSparseRole",
    "UnknownSparseMethodError",
    "load_sparse_config",
]
