"""GSA: hash-code retrieval. Keys and queries become sign bits of a fixed random projection.

A key is stored as ``hash_bits`` sign bits of ``k @ R`` (``R`` Gaussian, seeded, the same for every
layer and step), packed into ``hash_bits / 8`` bytes instead of ``4 * head_dim`` (the point: the codes
of a long context fit where the keys do not). The angle between query and key is estimated from the
Hamming distance of their codes (SimHash); a token scores ``hash_bits - hamming`` against its KV
head's query code, and a block scores its best token, so one relevant token is enough to fetch it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ucm_client.sparse.config import BlockBudget, parse_fields
from ucm_client.sparse.kernels.attention import group_query
from ucm_client.sparse.kernels.scoring import block_min_hamming, hash_block_scores
from ucm_client.sparse.methods.block_sparse import BlockSparseMethod, DecodeState

__all__ = ["GSA", "GSAOnDevice", "GsaSpec", "hamming_words", "hash_codes", "pack_words", "popcount64"]


@dataclass(frozen=True, slots=True)
class GsaSpec:
    """GSA settings (``ucm_sparse_config.GSA``)."""

    sparse_ratio: float = 0.3
    local_window_sz: int = 2
    init_window_sz: int = 1
    retrieval_stride: int = 1
    min_blocks: int = 4
    block_size: int = 128
    hash_bits: int = 256
    """Sign bits per key and head (32 bytes at 256; a float32 key of head_dim 128 is 512)."""
    reliable_bits: float = 0.5
    """Fraction of the bits compared at retrieval: those whose hyperplane the query is farthest from
    (largest ``|q·r|``), where a matching key agrees most reliably and a random one still at chance.
    Measured: with all 256 bits, needles at 60° from the query fall among the haystack's best."""
    seed: int = 0
    """Seed of the projection; workers must agree, so it is config, not randomness."""
    drift_cosine: float = 0.9
    """Retrieve before the stride is up when the query direction turned this far (0 disables)."""

    def __post_init__(self) -> None:
        if self.retrieval_stride < 1 or self.block_size < 1:
            raise ValueError("retrieval_stride and block_size must be >= 1")
        if self.hash_bits < 8 or self.hash_bits % 8:
            raise ValueError(f"hash_bits must be a positive multiple of 8, got {self.hash_bits}")
        if not 0.0 < self.reliable_bits <= 1.0:
            raise ValueError(f"reliable_bits must be in (0, 1], got {self.reliable_bits}")
        if not -1.0 <= self.drift_cosine <= 1.0:
            raise ValueError(f"drift_cosine must be in [-1, 1], got {self.drift_cosine}")
        self.budget()

    def budget(self) -> BlockBudget:
        return BlockBudget(self.sparse_ratio, self.init_window_sz, self.local_window_sz, self.min_blocks)


def hash_codes(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Sign bits of ``x @ projection`` as a bool tensor ``[..., hash_bits]``."""
    return (x.float() @ projection) > 0


_WORD_BITS = 64


def _bit_weights(device: torch.device) -> torch.Tensor:
    # 1 << 63 does not fit an int64; its two's-complement value does, and summing distinct bits is OR.
    w = [1 << i for i in range(_WORD_BITS - 1)] + [-(1 << (_WORD_BITS - 1))]
    return torch.tensor(w, dtype=torch.int64, device=device)


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., bits]`` → int64 ``[..., ceil(bits / 64)]`` (zero-padded: padding bits never differ)."""
    bits = codes.shape[-1]
    words = -(-bits // _WORD_BITS)
    if words * _WORD_BITS != bits:
        codes = torch.nn.functional.pad(codes, (0, words * _WORD_BITS - bits))
    if codes.device.type == "cpu" and sys.byteorder == "little":
        # numpy packs 8 bits per byte in one pass; little-endian bytes of a word are its bits in order
        packed = np.packbits(codes.numpy(), axis=-1, bitorder="little")
        return torch.from_numpy(np.ascontiguousarray(packed).view(np.int64))
    grouped = codes.reshape(*codes.shape[:-1], words, _WORD_BITS).to(torch.int64)
    return (grouped * _bit_weights(codes.device)).sum(dim=-1)


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits per int64 element, in torch elementwise ops on ``x``'s device (SWAR; no host trip)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x * 0x0101010101010101) >> 56  # the top byte holds the count (<= 64: sign bit clear)


def hamming_words(
    words: torch.Tensor, query_words: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Bit differences between packed codes ``[..., W]`` and ``query_words`` (broadcast), summed over W.

    ``mask`` (packed like the codes, broadcast) limits the count to its set bits. Torch ops on the
    tensors' device (:func:`popcount64`): GSAOnDevice's path, and GSA's off the host; on the host GSA
    counts with the compiled :func:`~ucm_client.sparse.kernels.scoring.block_min_hamming` instead.
    """
    diff = torch.bitwise_xor(words, query_words)
    if mask is not None:
        diff = diff & mask
    return popcount64(diff).sum(dim=-1)


class GSA(BlockSparseMethod):
    """SimHash codes per token (``hash_bits / 8`` bytes as int64 words), Hamming-similarity top-k blocks.

    The query side uses one code per KV head, hashed from the sum of that head's query group, so a
    step costs one XOR-popcount pass over the stored codes: 2 words per key and head at 128 bits.
    """

    spec: GsaSpec
    on_device = False
    """Count bits with torch ops on the cache's device instead of numpy on the host."""

    def _parse_spec(self, config: Mapping[str, Any]) -> GsaSpec:
        return parse_fields(GsaSpec, config, f"ucm_sparse_config.{type(self).__name__}")

    def _projection(self, head_dim: int, device: torch.device, state: DecodeState) -> torch.Tensor:
        proj = state.aux.get("projection")
        if proj is None or proj.device != device:
            gen = torch.Generator().manual_seed(self.spec.seed)
            proj = torch.randn(head_dim, self.spec.hash_bits, generator=gen).to(device)
            state.aux["projection"] = proj
        return proj

    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        n, heads, dim = keys.shape
        codes = hash_codes(keys, self._projection(dim, keys.device, state))  # [n, H, bits]
        return pack_words(codes).reshape(n // block_size, block_size, heads, -1)

    def _kv_heads(self, features: torch.Tensor) -> int:
        return int(features.shape[2])  # [m, block_size, H, words]

    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        heads = features.shape[2]
        proj = self._projection(queries.shape[-1], features.device, state)
        used = max(1, round(self.spec.reliable_bits * self.spec.hash_bits))
        if not self.on_device and features.device.type == "cpu" and sys.byteorder == "little":
            out = torch.empty(heads, features.shape[0])  # the query's code, mask and scoring: one call
            hash_block_scores(
                queries.float().contiguous().numpy(),
                proj.numpy(),
                used,
                features.numpy().view(np.uint64),
                out.numpy(),
            )
            return out
        q = torch.stack([group_query(qi, heads) for qi in queries]).sum(dim=(0, 2))  # [H, D]
        projected = q.float() @ proj  # [H, bits]
        qwords = pack_words(projected > 0)  # [H, W]
        reliable = torch.zeros_like(projected, dtype=torch.bool)
        reliable.scatter_(1, projected.abs().topk(used, dim=-1).indices, True)
        mask = pack_words(reliable)
        if self.on_device or features.device.type != "cpu":
            dist = hamming_words(features, qwords[None, None], mask=mask[None, None])
            best = dist.amin(dim=1).T  # [H, m]: a block scores its best token
        else:
            best = torch.empty(heads, features.shape[0], dtype=torch.int64)
            block_min_hamming(
                features.numpy().view(np.uint64),
                qwords.numpy().view(np.uint64),
                mask.numpy().view(np.uint64),
                best.numpy(),
            )
        sim = used - best
        return sim.float() / math.sqrt(used)


class GSAOnDevice(GSA):
    """GSA with selection kept on the KV cache's device: codes, projection, bit counts and top-k are
    torch ops there, and no value is read back to the host during retrieval (upstream UCM's variant for
    accelerators, where a host round trip per layer and step would cost more than the scoring)."""

    on_device = True
