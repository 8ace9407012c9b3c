"""Planted-needle workloads shared by the tests and the benchmark.

A haystack of random keys, a query pointing in one direction per KV head, and a few *needle blocks*
in which some tokens' keys point the same way. Dense attention then puts almost all its mass on the
needle tokens, so a sparse method is judged on two measurable things: whether it retrieved the needle
blocks (recall) and how far its output lies from dense attention (relative L2 error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["NeedleCase", "planted_needles", "relative_error"]


@dataclass(frozen=True, slots=True)
class NeedleCase:
    """One decode query over ``num_tokens`` of token-major KV with known needle blocks."""

    query: torch.Tensor  # [num_heads, D]
    keys: torch.Tensor  # [N, num_kv_heads, D]
    values: torch.Tensor  # [N, num_kv_heads, D]
    needle_blocks: torch.Tensor  # sorted block ids
    block_size: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def recall(self, selected_blocks: torch.Tensor) -> float:
        """Fraction of needle blocks among ``selected_blocks``."""
        hit = torch.isin(self.needle_blocks, selected_blocks)
        return float(hit.float().mean())


def planted_needles(
    num_tokens: int,
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 32,
    num_needles: int = 4,
    needle_tokens: int = 4,
    strength: float = 12.0,
    margin_blocks: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> NeedleCase:
    """Build a case; ``strength`` is a needle token's attention logit (haystack logits are ~N(0, 1)).

    Needles sit at least ``margin_blocks`` away from both ends, so the initial and local windows
    cannot find them by position alone.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    direction = torch.randn(num_kv_heads, head_dim, generator=gen)
    direction /= direction.norm(dim=-1, keepdim=True)
    group = num_heads // num_kv_heads
    sqrt_d = math.sqrt(head_dim)
    # q = sqrt(D) * u (+ small per-head noise): a haystack key's logit u·k is ~N(0, 1).
    noise = 0.1 * torch.randn(num_kv_heads, group, head_dim, generator=gen)
    query = (sqrt_d * direction[:, None, :] + noise).reshape(num_heads, head_dim)
    num_blocks = num_tokens // block_size
    candidates = torch.arange(margin_blocks, num_blocks - margin_blocks)
    pick = torch.randperm(candidates.numel(), generator=gen)[:num_needles]
    needle_blocks = candidates[pick].sort().values
    for blk in needle_blocks.tolist():
        # Every KV head gets the needle (at its own offsets): a head without one would attend the
        # haystack uniformly, and no sparse method can reproduce that from a fraction of it.
        for head in range(num_kv_heads):
            offs = torch.randperm(block_size, generator=gen)[:needle_tokens]
            for off in offs.tolist():
                tok = blk * block_size + off
                keys[tok, head] = strength * direction[head] + 0.1 * torch.randn(head_dim, generator=gen)
    return NeedleCase(
        query=query.to(dtype),
        keys=keys.to(dtype),
        values=values.to(dtype),
        needle_blocks=needle_blocks,
        block_size=block_size,
    )


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` over the whole output."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm())
