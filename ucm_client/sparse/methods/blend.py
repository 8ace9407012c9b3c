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
    "DeviationInputs",
    "Scorer",
    "blend",
    "kv_deviation",
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
    filter_layers: int = 3
    """Layers over which the selection narrows (CacheBlend's gradual filtering): at the ``j``-th of
    them ``recompute_ratio ** ((j + 1) / filter_layers)`` of the reused tokens stay, each time the
    most deviating among those still recomputed, so the last one keeps ``recompute_ratio``.
    3, not 2: on random-weight shapes Blend was not tuned on, three filtering layers gave a lower or
    equal error than two at the same number of recomputed layer steps (two at a higher ratio), and a
    larger or equal lead over a random selection of the same schedule (``docs/sparse.md``, Blend)."""
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


@dataclass(frozen=True, slots=True)
class DeviationInputs:
    """What a filtering layer knows when it scores the reused tokens still recomputed (*candidates*).

    ``fresh_*``/``reused_*`` are the candidates' K/V ``[C, kv_heads, D]`` computed in this prompt and
    taken from the cache (keys moved to their new positions). ``queries`` ``[A, heads, D]`` are the
    fresh queries of every active row (candidates first, the suffix last) at ``query_positions``;
    ``keys``/``values`` ``[N, kv_heads, D]`` are this layer's K/V of the whole prompt as attention will
    see them (fresh for active rows, reused for the rest) at ``key_positions``; ``candidates`` index
    them. Scorers that weigh a deviation by the attention paid to the token need these.
    """

    layer: int
    candidates: torch.Tensor
    fresh_keys: torch.Tensor
    fresh_values: torch.Tensor
    reused_keys: torch.Tensor
    reused_values: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_positions: torch.Tensor


Scorer = Callable[[DeviationInputs], torch.Tensor]
"""How much each candidate's reused KV is off: higher is recomputed first; ``[C]``."""


def kv_deviation(x: DeviationInputs) -> torch.Tensor:
    """The default score: L2 distance of the fresh from the reused K plus that of V, over all KV heads.

    Measured against the alternatives (V or K alone, per-head normalised distances, distances weighted
    by the attention each token receives from the recomputed rows or from the question) over model
    shapes Blend was not tuned on (``benchmarks/blend_bench.py --variants``): none was better on every
    shape (weighting by the attention a token receives helped some shapes and hurt others).
    """
    keys: torch.Tensor = torch.linalg.vector_norm(x.fresh_keys - x.reused_keys, dim=(1, 2))
    values: torch.Tensor = torch.linalg.vector_norm(x.fresh_values - x.reused_values, dim=(1, 2))
    return keys + values


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
    scorer: Scorer = kv_deviation,
    chooser: Chooser = top_deviation,
) -> BlendResult:
    """Prefill ``chunks + suffix`` reusing the chunks' cached KV, recomputing only what ``spec`` allows.

    Layers before ``check_layer`` run for every token. From ``check_layer`` on, only *active* rows
    (the tokens still recomputed, plus the suffix) run; their fresh K/V replace the reused ones, and
    on each of the ``filter_layers`` filtering layers the active reused tokens are narrowed to those
    whose fresh K/V deviate most from the reused K/V. ``scorer`` replaces how deviation is measured
    (the benchmark compares alternatives), ``chooser`` how the scored tokens are picked (tests and the
    benchmark pass a random one as the negative control).
    """
    if suffix_ids.numel() == 0:
        raise ValueError("blend needs a non-empty suffix (the new tokens that follow the chunks)")
    if not chunks:
        raise ValueError("blend needs at least one cached chunk; with none, run a plain prefill")
    for i, chunk in enumerate(chunks):
        _check_chunk(i, chunk, model.num_layers)
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
            deviation = scorer(
                DeviationInputs(
                    layer=layer,
                    candidates=cand,
                    fresh_keys=k_new[:-n_suffix],
                    fresh_values=v_new[:-n_suffix],
                    reused_keys=k_old[cand],
                    reused_values=v_old[cand],
                    queries=q,
                    query_positions=positions[active],
                    keys=k,
                    values=v,
                    key_positions=positions,
                )
            )
            if deviation.shape != cand.shape:
                raise ValueError(
                    f"scorer returned shape {tuple(deviation.shape)} at layer {layer}; expected one "
                    f"score per candidate, ({cand.numel()},)"
                )
            count = min(spec.kept(step, n_reused), cand.numel())
            chosen = chooser(deviation, count).sort().values if count else torch.zeros(0, dtype=torch.long)
            rows = torch.cat([chosen, torch.arange(cand.numel(), active.numel())])
            q, hidden, active = q[rows], hidden[rows], active[rows]
        attn = causal_attention(q, positions[active], k, v, positions, scale=_scale(q))
        hidden = model.finish_layer(layer, hidden, attn)
    return BlendResult(model.logits(hidden[-1:])[0], active[:-n_suffix], n_reused)


def _check_chunk(index: int, chunk: ChunkKV, num_layers: int) -> None:
    """A cached chunk must hold one K and one V per layer, each with a row per token."""
    n = chunk.token_ids.numel()
    if n == 0:
        raise ValueError(f"chunk {index} has no tokens")
    if len(chunk.keys) != num_layers or len(chunk.values) != num_layers:
        raise ValueError(
            f"chunk {index} holds K/V for {len(chunk.keys)}/{len(chunk.values)} layers; the model has "
            f"{num_layers} (KV cached by another model?)"
        )
    for layer, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        if k.shape[0] != n or v.shape[0] != n:
            raise ValueError(
                f"chunk {index} layer {layer}: K has {k.shape[0]} rows and V {v.shape[0]} for {n} tokens"
            )


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
