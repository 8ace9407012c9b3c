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

__all__ = ["NeedleCase", "drifting_needles", "planted_needles", "relative_error"]


@dataclass(frozen=True, slots=True)
class NeedleCase:
    """One decode query over ``num_tokens`` of token-major KV with known needle blocks."""

    query: torch.Tensor  # [num_heads, D]
    keys: torch.Tensor  # [N, num_kv_heads, D]
    values: torch.Tensor  # [N, num_kv_heads, D]
    needle_blocks: torch.Tensor  # sorted block ids (union over KV heads)
    block_size: int
    needle_mask: torch.Tensor | None = None
    """``[num_kv_heads, num_blocks]`` bool: which blocks hold a needle *for that KV head*
    (``None``: every head's needles are ``needle_blocks``)."""

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    @property
    def num_blocks(self) -> int:
        return -(-self.keys.shape[0] // self.block_size)

    def mask(self) -> torch.Tensor:
        """Per-KV-head needle mask ``[num_kv_heads, num_blocks]``."""
        if self.needle_mask is not None:
            return self.needle_mask
        m = torch.zeros(self.keys.shape[1], self.num_blocks, dtype=torch.bool)
        m[:, self.needle_blocks] = True
        return m

    def recall(self, selected_blocks: torch.Tensor) -> float:
        """Fraction of (KV head, needle block) pairs selected.

        ``selected_blocks`` is one list for every head (``[k]``) or one per KV head (``[kv_heads, k]``).
        """
        mask = self.mask()
        chosen = torch.zeros_like(mask)
        if selected_blocks.dim() == 1:
            chosen[:, selected_blocks] = True
        else:
            chosen.scatter_(1, selected_blocks.long(), True)
        return float((chosen & mask).sum() / mask.sum())


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
    distractors: int = 0,
    per_head: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> NeedleCase:
    """Build a case; ``strength`` is a needle token's attention logit (haystack logits are ~N(0, 1)).

    Needles sit at least ``margin_blocks`` away from both ends, so the initial and local windows
    cannot find them by position alone. ``needle_tokens`` tokens of a needle block carry the needle
    (1: a single outlier that a block mean dilutes 1:block_size). ``per_head``: each KV head has its
    own ``num_needles`` blocks, disjoint from the other heads' (one shared block list cannot cover
    them within a small budget). ``distractors`` blocks get keys of four times the haystack norm that
    are orthogonal to every head's query direction: they attract a selector that looks at keys
    without the query, and no real attention.
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
    order = candidates[torch.randperm(candidates.numel(), generator=gen)]
    per = num_needles * (num_kv_heads if per_head else 1)
    if per + distractors > order.numel():
        raise ValueError(f"{per} needle and {distractors} distractor blocks do not fit in {num_blocks}")
    mask = torch.zeros(num_kv_heads, -(-num_tokens // block_size), dtype=torch.bool)
    for head in range(num_kv_heads):
        # Every KV head gets needles (at its own offsets): a head without one would attend the
        # haystack uniformly, and no sparse method can reproduce that from a fraction of it.
        first = head * num_needles if per_head else 0
        for blk in order[first : first + num_needles].tolist():
            mask[head, blk] = True
            offs = torch.randperm(block_size, generator=gen)[:needle_tokens]
            for off in offs.tolist():
                tok = blk * block_size + off
                keys[tok, head] = strength * direction[head] + 0.1 * torch.randn(head_dim, generator=gen)
    for blk in order[per : per + distractors].tolist():
        loud = torch.randn(block_size, num_kv_heads, head_dim, generator=gen)
        loud -= (loud * direction).sum(-1, keepdim=True) * direction  # orthogonal to the query
        loud *= 4.0 * sqrt_d / loud.norm(dim=-1, keepdim=True)
        keys[blk * block_size : (blk + 1) * block_size] = loud
    needle_blocks = torch.nonzero(mask.any(dim=0)).flatten()
    return NeedleCase(
        query=query.to(dtype),
        keys=keys.to(dtype),
        values=values.to(dtype),
        needle_blocks=needle_blocks,
        block_size=block_size,
        needle_mask=mask if per_head else None,
    )


def drifting_needles(
    num_tokens: int, *, steps: int = 12, seed: int = 0, **kwargs: object
) -> list[NeedleCase]:
    """A query that turns, over ``steps`` decode steps, from one set of needles to another.

    Two cases with the same haystack but disjoint needles (directions ``a``, ``b``) are merged; at
    step ``t`` the query is ``cos θ·q_a + sin θ·q_b`` with θ going from 0 to π/2. A step's needles are
    the blocks whose needle logit is at least half the full strength (``cos θ`` or ``sin θ`` ≥ 0.5),
    so a selection kept from the early steps misses the late needles.
    """
    a = planted_needles(num_tokens, seed=seed, **kwargs)  # type: ignore[arg-type]
    b = planted_needles(num_tokens, seed=seed + 10_000, **kwargs)  # type: ignore[arg-type]
    a_needles = a.mask().any(dim=0)
    b_needles = b.mask().any(dim=0) & ~a_needles
    bs = a.block_size
    keys = a.keys.clone()
    for blk in torch.nonzero(b_needles).flatten().tolist():
        keys[blk * bs : (blk + 1) * bs] = b.keys[blk * bs : (blk + 1) * bs]
    cases = []
    for t in range(steps):
        theta = 0.5 * math.pi * t / max(1, steps - 1)
        query = math.cos(theta) * a.query + math.sin(theta) * b.query
        current = torch.zeros_like(a_needles)
        if math.cos(theta) >= 0.5:
            current |= a_needles
        if math.sin(theta) >= 0.5:
            current |= b_needles
        cases.append(
            NeedleCase(
                query=query,
                keys=keys,
                values=a.values,
                needle_blocks=torch.nonzero(current).flatten(),
                block_size=bs,
            )
        )
    return cases


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` over the whole output."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm())
