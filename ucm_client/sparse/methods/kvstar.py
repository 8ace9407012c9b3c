"""KVStarMultiStep: channel-pruned block representatives, scored against a group of recent queries.

Two savings over ESA. (1) Optionally only the ``dim_keep_ratio`` channels with the largest median
magnitude per KV head, chosen once from the prefix, are kept (int8 codes, per token): where keys
concentrate their energy in few channels the inner product survives the pruning while the store
shrinks. The default keeps every channel: int8 codes of all channels take what float16 of half of
them took, and on keys without dominant channels pruning half of them lost needles of a drifting
query (19 of 24 steps at 0.5; 24 of 24 at 1.0). At retrieval the queries' largest
``score_channels`` kept channels score every token and a block scores its best token (single-token
needles survive). (2) Retrieval runs every ``retrieval_stride`` steps (earlier when the query
drifts) and scores blocks against the recent decode queries (up to ``query_group``, those still
pointing where the newest does) together, so the selection serves the steps that follow rather
than only the step that triggered it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.config import BlockBudget, parse_fields
from ucm_client.sparse.kernels.attention import channel_token_max, group_query
from ucm_client.sparse.methods.block_sparse import ChannelMajorFeatures, DecodeState

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
    dim_keep_ratio: float = 1.0
    """Fraction of head_dim channels kept in the representatives (those of largest median magnitude;
    lower it for models whose keys concentrate in few channels)."""
    query_group: int = 4
    """Recent decode queries scored together at a retrieval."""
    score_channels: int = 16
    """Kept channels read per token at retrieval: the queries' largest ones (per KV head)."""
    drift_cosine: float = 0.9
    """Retrieve before the stride is up when the query direction turned this far (0 disables)."""

    def __post_init__(self) -> None:
        if min(self.retrieval_stride, self.block_size, self.query_group, self.score_channels) < 1:
            raise ValueError("retrieval_stride, block_size, query_group and score_channels must be >= 1")
        if not -1.0 <= self.drift_cosine <= 1.0:
            raise ValueError(f"drift_cosine must be in [-1, 1], got {self.drift_cosine}")
        if not 0.0 < self.dim_keep_ratio <= 1.0:
            raise ValueError(f"dim_keep_ratio must be in (0, 1], got {self.dim_keep_ratio}")
        self.budget()

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


class KVStarMultiStep(ChannelMajorFeatures):
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
            # median, not mean: a few loud blocks (keys of large norm that no query matches) must not
            # decide which channels every later score is computed from
            sample = keys[:: max(1, keys.shape[0] // 2048)]  # a median needs no exact population
            energy = sample.abs().median(dim=0).values  # [H, D]
            dims = torch.topk(energy, keep, dim=-1).indices.sort(dim=-1).values  # [H, r]
            state.aux["dims"] = dims
        if dims.shape[-1] == keys.shape[-1]:  # every channel kept (the default): no copy to prune
            return self._code(keys, block_size, state)
        pruned = torch.gather(keys, 2, dims[None].expand(keys.shape[0], -1, -1))  # [n, H, r]
        return self._code(pruned, block_size, state)  # [H, r, n]

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        dims = state.aux["dims"]
        heads = features.shape[0]
        scale = 1.0 / math.sqrt(queries.shape[-1])
        if features.device.type == "cpu":
            logits = self._host_scores(queries, features, state, dims, scale)
        else:
            q = torch.stack([group_query(qi.float(), heads).sum(dim=1) for qi in queries])  # [G, H, D]
            qp = torch.gather(q, 2, dims[None].expand(q.shape[0], -1, -1))  # [G, H, r]
            block_size = int(state.aux["block_size"])
            logits = (
                channel_token_max(
                    qp,
                    self._coded(features, state),
                    self.spec.score_channels,
                    block_size,
                    self._shrink(features, state),
                )
                * scale
            )
        # Each query votes with its own distribution over blocks, so one step's outlier cannot
        # dominate the group; summing logits instead would let the largest-norm query decide.
        return torch.softmax(logits, dim=-1).sum(dim=0).clamp_min(1e-30).log()
