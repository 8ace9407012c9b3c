"""ESA: retrieval by block representatives (the mean key of each block, per KV head).

Each full block is summarised once by its mean key; at retrieval the query's inner product with those
means ranks the blocks, and the top ones, plus the initial and local windows, are attended exactly.
Retrieval runs every ``retrieval_stride`` decode steps. Where blocks live off-device (in the UCM
daemon), :mod:`ucm_client.sparse.esa_offload` fetches the selected ones that are not resident.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.block_sparse import BlockSparseMethod, DecodeState
from ucm_client.sparse.config import BlockBudget, parse_fields
from ucm_client.sparse.kernels import block_means, group_query

__all__ = ["ESA", "EsaSpec"]


@dataclass(frozen=True, slots=True)
class EsaSpec:
    """ESA settings, the seed's ``ESA:`` section."""

    sparse_ratio: float = 0.3
    """Fraction of blocks attended; 1.0 is dense."""
    local_window_sz: int = 2
    """Trailing blocks always attended."""
    init_window_sz: int = 1
    """Leading blocks always attended."""
    retrieval_stride: int = 5
    """Decode steps between retrievals; the selection is reused in between."""
    min_blocks: int = 4
    """Lower bound on attended blocks."""
    block_size: int = 128
    """Tokens per block as the scheduler counts them (the worker reads it from the cache)."""

    def __post_init__(self) -> None:
        if self.retrieval_stride < 1:
            raise ValueError(f"retrieval_stride must be >= 1, got {self.retrieval_stride}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.budget()  # validates the shared fields

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


class ESA(BlockSparseMethod):
    """Mean-key block representatives, inner-product top-k."""

    spec: EsaSpec

    def _parse_spec(self, config: Mapping[str, Any]) -> EsaSpec:
        return parse_fields(EsaSpec, config, "ucm_sparse_config.ESA")

    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        return block_means(keys.float(), block_size)

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        heads = features.shape[1]
        q = torch.stack([group_query(qi.float(), heads) for qi in queries])  # [G, H, g, D]
        return torch.einsum("xhgd,bhd->hb", q, features) / math.sqrt(features.shape[-1])
