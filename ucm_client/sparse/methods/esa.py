"""ESA: retrieval by block representatives that keep single-token outliers, per KV head.

Each full block is kept once as int8 channel-major key codes (a scale per block and channel); at
retrieval the query's largest ``score_channels`` channels (per KV head) give every token an
approximate logit, and a block scores its best token, so one needle token is enough to fetch its
block (a mean key dilutes it 1:block_size: measured recall 0.5 on single-token needles). The top
blocks, plus the initial and local windows, are attended exactly. Retrieval runs every
``retrieval_stride`` decode steps, and earlier when the query drifts (``drift_cosine``). Where
blocks live off-device (in the UCM daemon), cold KV (:mod:`ucm_client.sparse.coldkv`) loads the
selected ones that are not resident.
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

__all__ = ["ESA", "EsaSpec"]


@dataclass(frozen=True, slots=True)
class EsaSpec:
    """ESA settings, upstream UCM's ``ESA:`` section."""

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
    score_channels: int = 16
    """Key channels read per token at retrieval: the query's largest ones (per KV head)."""
    drift_cosine: float = 0.9
    """Retrieve before the stride is up when a KV head's query direction has turned this far
    (cosine to the query of the last retrieval below this; 0 disables)."""

    def __post_init__(self) -> None:
        if self.retrieval_stride < 1:
            raise ValueError(f"retrieval_stride must be >= 1, got {self.retrieval_stride}")
        if self.block_size < 1 or self.score_channels < 1:
            raise ValueError(
                f"block_size and score_channels must be >= 1, got {self.block_size}, {self.score_channels}"
            )
        if not -1.0 <= self.drift_cosine <= 1.0:
            raise ValueError(f"drift_cosine must be in [-1, 1], got {self.drift_cosine}")
        self.budget()  # validates the shared fields

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


class ESA(ChannelMajorFeatures):
    """Mean-key block representatives, inner-product top-k."""

    spec: EsaSpec

    def _parse_spec(self, config: Mapping[str, Any]) -> EsaSpec:
        return parse_fields(EsaSpec, config, "ucm_sparse_config.ESA")

    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        return self._code(keys, block_size, state)  # [H, D, n]

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        heads, dim = features.shape[0], features.shape[1]
        if features.device.type == "cpu":
            dims = state.aux.get("dims")
            if dims is None:  # every query channel, in order: ESA codes them all
                dims = state.aux["dims"] = torch.arange(dim).expand(heads, -1).contiguous()
            return self._host_scores(queries[-1:], features, state, dims, 1.0 / math.sqrt(dim))[0]
        q = group_query(queries[-1].float(), heads).sum(dim=1)  # [H, D]: the KV head's query group
        block_size = int(state.aux["block_size"])
        return channel_token_max(
            q[None],
            self._coded(features, state),
            self.spec.score_channels,
            block_size,
            self._shrink(features, state),
        )[0] / math.sqrt(dim)
