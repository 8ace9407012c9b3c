"""ReRoPE: exact RoPE inside a window, relative position clamped to the window beyond it.

A model trained on contexts up to ``L`` never saw relative positions above ``L``. ReRoPE keeps the
true relative position for the ``window`` nearest tokens and treats every farther token as if it were
exactly ``window`` away: the query is rotated to position ``window`` and meets the key unrotated
(position 0), so their relative rotation is ``window``. Content still decides which distant tokens
win, but no logit ever sees an unseen position. Cost: two logit passes over the keys beyond the window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import parse_fields
from ucm_client.sparse.methods.passthrough import DenseInVllmMethod
from ucm_client.sparse.rope import apply_rope

__all__ = ["ReRoPE", "ReRopeSpec", "rerope_attention", "rerope_logits"]


@dataclass(frozen=True, slots=True)
class ReRopeSpec:
    """ReRoPE settings (``ucm_sparse_config.ReRoPE``)."""

    window: int = 512
    """Relative positions below this are exact; at or above it they read as ``window``."""
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


def rerope_logits(
    query: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int,
    rope_base: float = 10000.0,
) -> torch.Tensor:
    """Scaled, causally masked ReRoPE logits ``[kv_heads, group, M, N]``; inputs are *before* RoPE."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[2]
    group = heads // kv_heads
    rel = q_pos[:, None] - k_pos[None, :]
    logits = query.new_full((kv_heads, group, query.shape[0], keys.shape[0]), float("-inf"))
    # Each branch touches only the keys it can apply to: a decode query rotates the window's keys
    # and reads the rest raw, instead of rotating the whole context every step.
    near = (k_pos > q_pos.min() - window).nonzero().flatten()
    far = (k_pos <= q_pos.max() - window).nonzero().flatten()
    if near.numel():
        q_in = apply_rope(query, q_pos, rope_base).reshape(-1, kv_heads, group, dim)
        k_in = apply_rope(keys[near], k_pos[near], rope_base)
        logits[..., near] = torch.einsum("mhgd,nhd->hgmn", q_in, k_in)
    if far.numel():
        q_out = apply_rope(query, torch.full_like(q_pos, window), rope_base).reshape(-1, kv_heads, group, dim)
        out_logits = torch.einsum("mhgd,nhd->hgmn", q_out, keys[far])
        logits[..., far] = torch.where(rel[:, far] >= window, out_logits, logits[..., far])
    logits = logits / math.sqrt(dim)
    return logits.masked_fill(rel < 0, float("-inf"))


def rerope_attention(
    query: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int,
    rope_base: float = 10000.0,
) -> torch.Tensor:
    """Causal attention with ReRoPE; ``query`` and ``keys`` are *before* RoPE.

    Shapes: query ``[M, num_heads, D]``, keys/values ``[N, num_kv_heads, D]``; positions are integers.
    """
    logits = rerope_logits(query, q_pos, keys, k_pos, window=window, rope_base=rope_base)
    out = torch.einsum("hgmn,nhd->mhgd", torch.softmax(logits, dim=-1), values)
    return out.reshape(query.shape)


class ReRoPE(DenseInVllmMethod):
    """The ReRoPE method object: its spec plus :func:`rerope_attention` bound to it."""

    def __init__(self, role: UcmSparseRole, config: Mapping[str, Any], *, min_seq_len: int = 0) -> None:
        super().__init__(role, config, min_seq_len=min_seq_len)
        self.spec = parse_fields(ReRopeSpec, config, "ucm_sparse_config.ReRoPE")

    def attend(
        self,
        query: torch.Tensor,
        q_pos: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> torch.Tensor:
        """:func:`rerope_attention` with this method's window and base."""
        return rerope_attention(
            query, q_pos, keys, values, k_pos, window=self.spec.window, rope_base=self.spec.rope_base
        )
