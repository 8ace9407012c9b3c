"""GSA: hash-code retrieval. Keys and queries become sign bits of a fixed random projection.

A key is stored as ``hash_bits`` sign bits of ``k @ R`` (``R`` Gaussian, seeded, the same for every
layer and step), packed into ``hash_bits / 8`` bytes instead of ``4 * head_dim`` (the point: the codes
of a long context fit where the keys do not). The angle between query and key is estimated from the
Hamming distance of their codes (SimHash); a token scores ``hash_bits - hamming`` against its KV
head's query code, and a block scores its best token, so one relevant token is enough to fetch it.
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

__all__ = ["GSA", "GsaSpec", "hamming", "hash_codes", "pack_bits"]


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


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int16)


def pack_bits(codes: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., bits]`` → uint8 ``[..., bits / 8]`` (what is stored per key and head)."""
    grouped = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.uint8)
    return (grouped * _BIT_WEIGHTS.to(codes.device)).sum(dim=-1, dtype=torch.uint8)


def hamming(packed_a: torch.Tensor, packed_b: torch.Tensor) -> torch.Tensor:
    """Bit differences between packed codes (broadcasting), summed over the last axis."""
    diff = torch.bitwise_xor(packed_a, packed_b)
    return _POPCOUNT.to(diff.device)[diff.long()].sum(dim=-1)


class GSA(BlockSparseMethod):
    """SimHash codes per token (packed, ``hash_bits / 8`` bytes), Hamming-similarity top-k blocks.

    The query side uses one code per KV head, hashed from the sum of that head's query group, so a
    step costs one XOR-popcount pass over the stored codes.
    """

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
        return pack_bits(codes).reshape(n // block_size, block_size, heads, -1)

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        heads = features.shape[2]
        proj = self._projection(queries.shape[-1], state).to(queries.device)
        q = torch.stack([group_query(qi, heads) for qi in queries]).sum(dim=(0, 2))  # [H, D]
        qcode = pack_bits(hash_codes(q, proj))  # [H, bytes]
        sim = self.spec.hash_bits - hamming(features, qcode[None, None])  # [m, bs, H]
        return sim.amax(dim=1).T.float() / math.sqrt(self.spec.hash_bits)
