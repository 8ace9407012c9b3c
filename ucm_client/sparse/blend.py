"""Blend (CacheBlend): reuse the KV of chunks cached on their own, then repair the worst tokens.

A RAG prompt is ``[chunk A][chunk B]…[question]``. Each chunk's KV was computed (and stored in UCM)
when that chunk stood alone, at positions from 0 and without seeing the chunks before it. Reusing it
needs two corrections:

1. Position: cached keys carry RoPE for their old positions. RoPE is a rotation, so rotating a cached
   key by the chunk's new offset yields exactly the key at the new position (see :mod:`.rope`).
2. Cross-attention: a reused token never attended to the earlier chunks. At the *check layer* the K/V
   of every token is recomputed (projections only, no attention) and compared with the reused
   values; the ``recompute_ratio`` tokens that deviate most, plus the new suffix, are recomputed
   through all later layers, while every other token keeps its cached KV. Layers before the check
   layer are recomputed for all tokens.

The model is reached through :class:`BlendModel`, a protocol of per-layer steps, so the algorithm is
independent of any one model implementation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import parse_fields
from ucm_client.sparse.kernels import causal_attention
from ucm_client.sparse.passthrough import DenseInVllmMethod
from ucm_client.sparse.rope import apply_rope

__all__ = ["Blend", "BlendModel", "BlendResult", "BlendSpec", "ChunkKV", "prefill"]


class BlendModel(Protocol):
    """A decoder-only transformer, exposed one layer step at a time."""

    @property
    def num_layers(self) -> int: ...

    @property
    def rope_base(self) -> float: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` → hidden ``[N, hidden]``."""

    def qkv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key (both after RoPE at ``positions``) and value of ``hidden`` at ``layer``."""

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP: the hidden state after ``layer``."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head."""


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """A chunk's tokens and per-layer K/V ``[n, kv_heads, D]``, computed alone at positions ``0..n-1``."""

    token_ids: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class BlendResult:
    """Logits of every recomputed position's last token, and what was recomputed."""

    last_logits: torch.Tensor
    recomputed: torch.Tensor
    """Indices (into the reused chunk tokens) recomputed after the check layer."""
    num_reused: int

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed.numel() / max(1, self.num_reused)


@dataclass(frozen=True, slots=True)
class BlendSpec:
    """Blend settings (``ucm_sparse_config.Blend``)."""

    recompute_ratio: float = 0.15
    """Fraction of reused tokens recomputed after the check layer."""
    check_layer: int = 0
    """Layer at which deviations are measured; earlier layers are recomputed for all tokens."""
    rope_correction: bool = True
    """Rotate reused keys to their new positions (off only to measure what it is worth)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")


def prefill(model: BlendModel, token_ids: torch.Tensor) -> tuple[torch.Tensor, ChunkKV]:
    """Plain full prefill: last-token logits and the KV of every layer."""
    positions = torch.arange(token_ids.numel())
    hidden = model.embed(token_ids)
    keys, values = [], []
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, hidden, positions)
        keys.append(k)
        values.append(v)
        attn = causal_attention(q, positions, k, v, positions, scale=_scale(q))
        hidden = model.finish_layer(layer, hidden, attn)
    return model.logits(hidden[-1:])[0], ChunkKV(token_ids, tuple(keys), tuple(values))


def _select(deviation: torch.Tensor, ratio: float) -> torch.Tensor:
    count = math.ceil(ratio * deviation.numel())
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.topk(deviation, count).indices.sort().values


def blend(
    model: BlendModel, chunks: Sequence[ChunkKV], suffix_ids: torch.Tensor, spec: BlendSpec
) -> BlendResult:
    """Prefill ``chunks + suffix`` reusing the chunks' cached KV, recomputing only what ``spec`` allows."""
    if suffix_ids.numel() == 0:
        raise ValueError("blend needs a non-empty suffix (the new tokens that follow the chunks)")
    if spec.check_layer >= model.num_layers:
        raise ValueError(f"check_layer {spec.check_layer} >= num_layers {model.num_layers}")
    reused_ids = torch.cat([c.token_ids for c in chunks])
    n_reused = reused_ids.numel()
    all_ids = torch.cat([reused_ids, suffix_ids])
    positions = torch.arange(all_ids.numel())
    offsets = torch.cat(
        [torch.full((c.token_ids.numel(),), off) for c, off in zip(chunks, _starts(chunks), strict=True)]
    )
    suffix = torch.arange(n_reused, all_ids.numel())

    def reused(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([c.keys[layer] for c in chunks])
        v = torch.cat([c.values[layer] for c in chunks])
        if spec.rope_correction:
            k = apply_rope(k, offsets.to(k.dtype), model.rope_base)
        return k, v

    hidden = model.embed(all_ids)  # rows: every token until the check layer, then only `active`
    active = positions
    recomputed = torch.zeros(0, dtype=torch.long)
    for layer in range(model.num_layers):
        q, k_new, v_new = model.qkv(layer, hidden, positions[active])
        k, v = reused(layer)
        k = torch.cat([k, k_new[-suffix.numel() :]])
        v = torch.cat([v, v_new[-suffix.numel() :]])
        if layer <= spec.check_layer:
            k[:n_reused] = k_new[:n_reused]
            v[:n_reused] = v_new[:n_reused]
            if layer == spec.check_layer:
                fresh_k, fresh_v = k_new[:n_reused], v_new[:n_reused]
                old_k, old_v = reused(layer)
                deviation = (fresh_v - old_v).norm(dim=(1, 2)) + (fresh_k - old_k).norm(dim=(1, 2))
                recomputed = _select(deviation, spec.recompute_ratio)
                keep_rows = torch.cat([recomputed, suffix])
                attn = causal_attention(q[keep_rows], positions[keep_rows], k, v, positions, scale=_scale(q))
                hidden = model.finish_layer(layer, hidden[keep_rows], attn)
                active = keep_rows
                continue
        else:
            rows = active
            k[rows] = k_new
            v[rows] = v_new
        attn = causal_attention(q, positions[active], k, v, positions, scale=_scale(q))
        hidden = model.finish_layer(layer, hidden, attn)
    return BlendResult(model.logits(hidden[-1:])[0], recomputed, n_reused)


def _scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _starts(chunks: Sequence[ChunkKV]) -> list[int]:
    starts, pos = [], 0
    for c in chunks:
        starts.append(pos)
        pos += c.token_ids.numel()
    return starts


class Blend(DenseInVllmMethod):
    """The Blend method object: its spec plus :func:`blend` bound to it."""

    def __init__(self, role: UcmSparseRole, config: Mapping[str, Any], *, min_seq_len: int = 0) -> None:
        super().__init__(role, config, min_seq_len=min_seq_len)
        self.spec = parse_fields(BlendSpec, config, "ucm_sparse_config.Blend")

    def run(self, model: BlendModel, chunks: Sequence[ChunkKV], suffix_ids: torch.Tensor) -> BlendResult:
        """:func:`blend` with this method's spec."""
        return blend(model, chunks, suffix_ids, self.spec)
