"""KVStarMultiStep: pruned-dimension block representatives, scored against a group of recent queries.

Two savings over ESA. (1) Only the ``dim_keep_ratio`` channels with the largest mean magnitude per KV
head, chosen once from the prefix, are kept in the block representatives: keys of real models
concentrate their energy in few channels, so the inner product survives the pruning while the
representative store shrinks. (2) Retrieval runs every ``retrieval_stride`` steps and scores blocks
against the last ``query_group`` decode queries together, so the selection serves the steps that
follow rather than only the step that triggered it.
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

__all__ = ["KVStarMultiStep", "KvStarSpec"]


@dataclass(frozen=True, slots=True)
class KvStarSpec:
    """KVStarMultiStep settings (``ucm_sparse_config.KVStarMultiStep``)."""

    sparse_ratio: float = 0.3
    local_window_sz: int = 2
    init_window_sz: int = 1
    retrieval_stride: int = 4
    min_blocks: int = 4
    block_size: int = 128
    dim_keep_ratio: float = 0.5
    """Fraction of head_dim channels kept in the representatives."""
    query_group: int = 4
    """Recent decode queries scored together at a retrieval."""

    def __post_init__(self) -> None:
        if self.retrieval_stride < 1 or self.block_size < 1 or self.query_group < 1:
            raise ValueError("retrieval_stride, block_size and query_group must be >= 1")
        if not 0.0 < self.dim_keep_ratio <= 1.0:
            raise ValueError(f"dim_keep_ratio must be in (0, 1], got {self.dim_keep_ratio}")
        self.budget()

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


class KVStarMultiStep(BlockSparseMethod):
    """Pruned mean-key representatives, multi-query scoring."""

    spec: KvStarSpec

    def _parse_spec(self, config: Mapping[str, Any]) -> KvStarSpec:
        return parse_fields(KvStarSpec, config, "ucm_sparse_config.KVStarMultiStep")

    def _history_len(self) -> int:
        return self.spec.query_group

    def _queries_for_retrieval(self, state: DecodeState) -> torch.Tensor:
        return torch.stack(state.queries)

    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        keys = keys.float()
        dims = state.aux.get("dims")
        if dims is None:
            keep = max(1, math.ceil(self.spec.dim_keep_ratio * keys.shape[-1]))
            energy = keys.abs().mean(dim=0)  # [H, D]
            dims = torch.topk(energy, keep, dim=-1).indices.sort(dim=-1).values  # [H, r]
            state.aux["dims"] = dims
        means = block_means(keys, block_size)  # [m, H, D]
        return torch.gather(means, 2, dims[None].expand(means.shape[0], -1, -1))

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        dims = state.aux["dims"]
        heads = features.shape[1]
        q = torch.stack([group_query(qi.float(), heads) for qi in queries])  # [G, H, g, D]
        idx = dims[None, :, None, :].expand(q.shape[0], -1, q.shape[2], -1)
        qp = torch.gather(q, 3, idx)  # [G, H, g, r]
        logits = torch.einsum("xhgr,bhr->xhgb", qp, features) / math.sqrt(q.shape[-1])
        # Each query votes with its own distribution over blocks, so one step's outlier cannot
        # dominate the group; summing logits instead would let the largest-norm query decide.
        return torch.softmax(logits, dim=-1).sum(dim=(0, 2)).clamp_min(1e-30).log()
