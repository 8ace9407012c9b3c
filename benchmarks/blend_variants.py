"""Alternative ways to measure a reused token's deviation, compared with Blend's default in the benchmark.

Each is a :data:`ucm_client.sparse.methods.blend.Scorer`. They answer "what goes wrong" questions about the
default (the L2 distance of K plus that of V over all heads): is V or K alone the better signal, does
a head with large K/V norms drown the others, and does a deviation matter only as much as the
attention paid to the token, by the recomputed rows and by the question.
"""

from __future__ import annotations

import math

import torch

from ucm_client.sparse.methods.blend import DeviationInputs, Scorer, kv_deviation

__all__ = [
    "SCORERS",
    "attention_weighted",
    "key_only",
    "per_head_normalised",
    "question_weighted",
    "value_only",
]


def _per_head(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """L2 distance per token and KV head: ``[C, kv_heads]``."""
    out: torch.Tensor = torch.linalg.vector_norm(fresh - reused, dim=-1)
    return out


def value_only(x: DeviationInputs) -> torch.Tensor:
    out: torch.Tensor = torch.linalg.vector_norm(x.fresh_values - x.reused_values, dim=(1, 2))
    return out


def key_only(x: DeviationInputs) -> torch.Tensor:
    out: torch.Tensor = torch.linalg.vector_norm(x.fresh_keys - x.reused_keys, dim=(1, 2))
    return out


def per_head_normalised(x: DeviationInputs) -> torch.Tensor:
    """Each KV head's K and V distance divided by that head's mean reused norm, then summed."""
    k_scale = torch.linalg.vector_norm(x.reused_keys, dim=-1).mean(0).clamp_min(1e-12)
    v_scale = torch.linalg.vector_norm(x.reused_values, dim=-1).mean(0).clamp_min(1e-12)
    dk = _per_head(x.fresh_keys, x.reused_keys) / k_scale
    dv = _per_head(x.fresh_values, x.reused_values) / v_scale
    return torch.sum(dk + dv, dim=-1)


def _received(x: DeviationInputs, rows: slice) -> torch.Tensor:
    """Attention each candidate receives from the active rows ``rows``, per KV head: ``[C, kv_heads]``."""
    q, q_pos = x.queries[rows], x.query_positions[rows]
    heads, kv_heads = q.shape[1], x.keys.shape[1]
    grouped = q.reshape(q.shape[0], kv_heads, heads // kv_heads, -1)
    logits = torch.einsum("mhgd,nhd->mhgn", grouped, x.keys) / math.sqrt(q.shape[-1])
    hidden = x.key_positions[None, :] > q_pos[:, None]
    probs = torch.softmax(logits.masked_fill(hidden[:, None, None, :], float("-inf")), dim=-1)
    return probs[..., x.candidates].sum(dim=(0, 2)).T


def _weighted(x: DeviationInputs, rows: slice) -> torch.Tensor:
    per_head = _per_head(x.fresh_keys, x.reused_keys) + _per_head(x.fresh_values, x.reused_values)
    return torch.sum(_received(x, rows) * per_head, dim=-1)


def attention_weighted(x: DeviationInputs) -> torch.Tensor:
    """Per-head K+V distance times the attention the token receives from every active row."""
    return _weighted(x, slice(None))


def question_weighted(x: DeviationInputs) -> torch.Tensor:
    """Per-head K+V distance times the attention the token receives from the question (suffix) rows."""
    return _weighted(x, slice(x.candidates.numel(), None))


SCORERS: dict[str, Scorer] = {
    "kv": kv_deviation,
    "value": value_only,
    "key": key_only,
    "per-head": per_head_normalised,
    "attention": attention_weighted,
    "question": question_weighted,
}
"""Name → scorer; ``kv`` is Blend's default."""
