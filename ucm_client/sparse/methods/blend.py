"""Blend (CacheBlend): reuse the KV of chunks cached on their own, then repair the worst tokens.

A RAG prompt is ``[chunk A][chunk B]…[question]``. Each chunk's KV was computed (and stored in UCM)
when that chunk stood alone, at positions from 0 and without seeing the chunks before it. Reusing it
needs two corrections:

1. Position: cached keys carry RoPE for their old positions. RoPE is a rotation, so rotating a cached
   key by the chunk's new offset yields exactly the key at the new position (see :mod:`.rope`).
2. Cross-attention: a reused token never attended to the earlier chunks. Layers before the *check
   layer* (>= 1) are recomputed for all tokens; from it on, each of ``filter_layers`` layers compares
   the freshly computed K/V of the tokens still recomputed with their reused K/V and keeps the most
   deviating ones (CacheBlend's gradual filtering), down to ``recompute_ratio``; those tokens and the
   new suffix run through all later layers, every other token keeps its cached KV.

The model is reached through :class:`BlendModel`, a protocol of per-layer steps, so the algorithm is
independent of any one model implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import parse_fields
from ucm_client.sparse.kernels.attention import causal_attention
from ucm_client.sparse.methods.passthrough import DenseInVllmMethod
from ucm_client.sparse.rope import apply_rope

__all__ = [
    "Blend",
    "BlendModel",
    "BlendResult",
    "BlendSpec",
    "Chooser",
    "ChunkKV",
    "blend",
    "prefill",
    "top_deviation",
]


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
    """Fraction of reused tokens recomputed through the last layer."""
    check_layer: int = 1
    """First layer at which deviations are measured; earlier layers are recomputed for all tokens.
    Layer 0 is refused: its K/V are projections of the token's embedding, the same in any context, so
    their deviation is float noise (measured: 1.8e-6 at layer 0 vs 35 at layer 1)."""
    filter_layers: int = 2
    """Layers over which the selection narrows (CacheBlend's gradual filtering): at the ``j``-th of
    them ``recompute_ratio ** ((j + 1) / filter_layers)`` of the reused tokens stay, each time the
    most deviating among those still recomputed, so the last one keeps ``recompute_ratio``."""
    rope_correction: bool = True
    """Rotate reused keys to their new positions (off only to measure what it is worth)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if self.check_layer < 1:
            raise ValueError(
                f"check_layer must be >= 1, got {self.check_layer}: layer-0 K/V do not depend on the "
                "context, so their deviation selects tokens at random"
            )
        if self.filter_layers < 1:
            raise ValueError(f"filter_layers must be >= 1, got {self.filter_layers}")

    def kept(self, step: int, num_reused: int) -> int:
        """Reused tokens still recomputed after filtering step ``step`` (0-based)."""
        ratio: float = self.recompute_ratio ** ((step + 1) / self.filter_layers)
        return min(num_reused, math.ceil(ratio * num_reused))


Chooser = Callable[[torch.Tensor, int], torch.Tensor]
"""``(deviation of the candidates, how many to keep)`` → indices into the candidates."""


def top_deviation(deviation: torch.Tensor, count: int) -> torch.Tensor:
    """The default chooser: the ``count`` most deviating candidates."""
    return torch.topk(deviation, count).indices


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


def blend(
    model: BlendModel,
    chunks: Sequence[ChunkKV],
    suffix_ids: torch.Tensor,
    spec: BlendSpec,
    *,
    chooser: Chooser = top_deviation,
) -> BlendResult:
    """Prefill ``chunks + suffix`` reusing the chunks' cached KV, recomputing only what ``spec`` allows.

    Layers before ``check_layer`` run for every token. From ``check_layer`` on, only *active* rows
    (the tokens still recomputed, plus the suffix) run; their fresh K/V replace the reused ones, and
    on each of the ``filter_layers`` filtering layers the active reused tokens are narrowed to those
    whose fresh K/V deviate most from the reused K/V. ``chooser`` replaces that choice (tests pass a
    random one as the negative control).
    """
    if suffix_ids.numel() == 0:
        raise ValueError("blend needs a non-empty suffix (the new tokens that follow the chunks)")
    if spec.check_layer + spec.filter_layers > model.num_layers:
        raise ValueError(
            f"check_layer {spec.check_layer} + filter_layers {spec.filter_layers} exceed the model's "
            f"{model.num_layers} layers"
        )
    reused_ids = torch.cat([c.token_ids for c in chunks])
    n_reused = reused_ids.numel()
    all_ids = torch.cat([reused_ids, suffix_ids])
    positions = torch.arange(all_ids.numel())
    offsets = torch.cat(
        [torch.full((c.token_ids.numel(),), off) for c, off in zip(chunks, _starts(chunks), strict=True)]
    )
    n_suffix = suffix_ids.numel()

    def reused(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([c.keys[layer] for c in chunks])
        v = torch.cat([c.values[layer] for c in chunks])
        if spec.rope_correction:
            k = apply_rope(k, offsets.to(k.dtype), model.rope_base)
        return k, v

    hidden = model.embed(all_ids)  # one row per active token
    active = positions
    for layer in range(model.num_layers):
        q, k_new, v_new = model.qkv(layer, hidden, positions[active])
        k_old, v_old = reused(layer)
        k = torch.cat([k_old, k_new[-n_suffix:]])
        v = torch.cat([v_old, v_new[-n_suffix:]])
        k[active] = k_new
        v[active] = v_new
        step = layer - spec.check_layer
        if 0 <= step < spec.filter_layers:
            cand = active[:-n_suffix]  # reused tokens still recomputed (active is sorted, suffix last)
            deviation = (k_new[:-n_suffix] - k_old[cand]).norm(dim=(1, 2)) + (
                v_new[:-n_suffix] - v_old[cand]
            ).norm(dim=(1, 2))
            count = min(spec.kept(step, n_reused), cand.numel())
            chosen = chooser(deviation, count).sort().values if count else torch.zeros(0, dtype=torch.long)
            rows = torch.cat([chosen, torch.arange(cand.numel(), active.numel())])
            q, hidden, active = q[rows], hidden[rows], active[rows]
        attn = causal_attention(q, positions[active], k, v, positions, scale=_scale(q))
        hidden = model.finish_layer(layer, hidden, attn)
    return BlendResult(model.logits(hidden[-1:])[0], active[:-n_suffix], n_reused)


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
