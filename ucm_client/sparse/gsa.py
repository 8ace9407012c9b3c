"""GSA: hash-code retrieval. Keys and queries become sign bits of a fixed random projection.

A key is stored as ``hash_bits`` sign bits of ``k @ R`` (``R`` Gaussian, seeded, the same for every
layer and step), which is ``hash_bits / 8`` bytes instead of ``2 * head_dim`` (the point: the codes of
a long context fit where the keys do not). The angle between query and key is estimated from the
Hamming distance of their codes (SimHash); a token scores ``hash_bits - hamming`` summed over the query
heads of its KV head, and a block scores its best token, so one relevant token is enough to fetch it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.block_sparse import BlockSparseMethod, DecodeState
from ucm_client.sparse.config import BlockBudget, parse_fields
from ucm_client.sparse.kernels import group_query

__all__ = ["GSA", "GsaSpec", "hash_codes"]


@dataclass(frozen=True, slots=True)
class GsaSpec:
    """GSA settings (``ucm_sparse_config.GSA``)."""

    sparse_ratio: float = 0.3
    local_window_sz: int = 2
    init_window_sz: int = 1
    retrieval_stride: int = 1
    min_blocks: int = 4
    block_size: int = 128
    hash_bits: int = 128
    """Sign bits per key and head; more bits, finer angle estimate."""
    seed: int = 0
    """Seed of the projection; workers must agree, so it is config, not randomness."""

    def __post_init__(self) -> None:
        if self.retrieval_stride < 1 or self.block_size < 1:
            raise ValueError("retrieval_stride and block_size must be >= 1")
        if self.hash_bits < 8 or self.hash_bits % 8:
            raise ValueError(f"hash_bits must be a positive multiple of 8, got {self.hash_bits}")
        self.budget()

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


def hash_codes(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x @ projection`` as a bool tensor ``[..., hash_bits]``."""
    return (x.float() @ projection) > 0


class GSA(BlockSparseMethod):
    """SimHash codes per token, Hamming-similarity top-k blocks."""

    spec: GsaSpec

    def _parse_spec(self, config: Mapping[str, Any]) -> GsaSpec:
        return parse_fields(GsaSpec, config, "ucm_sparse_config.GSA")

    def _projection(self, head_dim: int, state: DecodeState) -> torch.Tensor:
        proj = state.aux.get("projection")
        if proj is None:
            gen = torch.Generator().manual_seed(self.spec.seed)
            proj = torch.randn(head_dim, self.spec.hash_bits, generator=gen)
            state.aux["projection"] = proj
        return proj

    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        n, heads, dim = keys.shape
        codes = hash_codes(keys, self._projection(dim, state).to(keys.device))  # [n, H, bits]
        return codes.reshape(n // block_size, block_size, heads, -1)

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        heads = features.shape[2]
        proj = self._projection(queries.shape[-1], state).to(queries.device)
        q = torch.stack([group_query(qi, heads) for qi in queries])  # [G, H, g, D]
        qcodes = hash_codes(q, proj).float() * 2 - 1  # ±1, [G, H, g, bits]
        kcodes = features.float() * 2 - 1  # [m, bs, H, bits]
        # agreement = bits - hamming = (bits + <±1, ±1>) / 2, summed over the group's query heads
        dots = torch.einsum("xhgc,mthc->hmt", qcodes, kcodes)
        groups = qcodes.shape[0] * qcodes.shape[2]
        sim = (dots + groups * self.spec.hash_bits) / 2
        return sim.amax(dim=-1) / math.sqrt(groups * self.spec.hash_bits)
