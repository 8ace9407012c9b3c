"""Judging a block selection: recall, error against dense, the oracle, and the negative controls.

A quality bound means something only if a selector that does not do the job breaks it. So every
assessment here comes with three *negative controls*, selectors with the same budget that are wrong
on purpose: **query-blind** (the blocks with the largest key norm: what a selector that ignores the
query picks), **random** blocks, and **stale** (the best blocks for a different query: what reusing an
old selection after the query moved gives). The *oracle* picks, per KV head, the blocks holding the
most true attention mass; a method's error is compared with the oracle's at the same block count.

Selections are ``[k]`` (one list for every KV head, what vLLM's block table can express) or
``[kv_heads, k]`` (one list per KV head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ucm_client.sparse.kernels.attention import dense_decode_attention, group_query, per_head_sparse_attention
from ucm_client.sparse.testing import NeedleCase, relative_error

__all__ = [
    "CONTROLS",
    "Quality",
    "assess",
    "block_attention_mass",
    "oracle_blocks",
    "per_head_block_attention",
    "query_blind_blocks",
    "random_blocks",
    "stale_blocks",
]

RECALL_TARGET = 0.95
ERROR_FACTOR = 1.25
ERROR_SLACK = 0.005
"""Absolute slack on the error bound: where the oracle's error is ~0, float noise must not fail a method."""


@dataclass(frozen=True, slots=True)
class Quality:
    """How a selection did on one case."""

    recall: float
    error: float
    oracle_error: float

    @property
    def passes(self) -> bool:
        """Needle recall ≥ 0.95 and error within 1.25× the oracle's (plus a small absolute slack)."""
        return self.recall >= RECALL_TARGET and self.error <= ERROR_FACTOR * self.oracle_error + ERROR_SLACK


def _per_head(selection: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return selection[None].expand(kv_heads, -1) if selection.dim() == 1 else selection


def per_head_block_attention(
    case: NeedleCase, selection: torch.Tensor, query: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact attention where KV head ``h`` attends only to the blocks ``selection[h]``."""
    query = case.query if query is None else query
    sel = _per_head(selection, case.keys.shape[1])
    return per_head_sparse_attention(query, case.keys, case.values, sel, case.block_size, case.scale)


def block_attention_mass(case: NeedleCase, query: torch.Tensor | None = None) -> torch.Tensor:
    """True attention mass per KV head and block ``[kv_heads, num_blocks]`` (summed over the group)."""
    query = case.query if query is None else query
    n, kv_heads, _ = case.keys.shape
    q = group_query(query.float(), kv_heads)
    probs = torch.softmax(torch.einsum("hgd,nhd->hgn", q, case.keys.float()) * case.scale, dim=-1).sum(1)
    pad = case.num_blocks * case.block_size - n
    probs = torch.nn.functional.pad(probs, (0, pad))
    return probs.reshape(kv_heads, case.num_blocks, case.block_size).sum(-1)


def _top_per_head(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(scores, min(k, scores.shape[-1]), dim=-1).indices.sort(dim=-1).values


def oracle_blocks(case: NeedleCase, k: int) -> torch.Tensor:
    """Per KV head, the ``k`` blocks with the most true attention mass."""
    return _top_per_head(block_attention_mass(case), k)


def query_blind_blocks(case: NeedleCase, k: int) -> torch.Tensor:
    """Negative control: per KV head, the ``k`` blocks whose largest key norm is largest."""
    n, kv_heads, _ = case.keys.shape
    norms = case.keys.float().norm(dim=-1).T  # [H, n]
    norms = torch.nn.functional.pad(norms, (0, case.num_blocks * case.block_size - n))
    return _top_per_head(norms.reshape(kv_heads, case.num_blocks, -1).amax(-1), k)


def random_blocks(case: NeedleCase, k: int, seed: int = 0) -> torch.Tensor:
    """Negative control: ``k`` random blocks per KV head."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(case.keys.shape[1], case.num_blocks, generator=gen)
    return _top_per_head(scores, k)


def stale_blocks(case: NeedleCase, k: int, seed: int = 0) -> torch.Tensor:
    """Negative control: the oracle's blocks for another query (a selection kept after the query moved)."""
    gen = torch.Generator().manual_seed(seed + 1)
    other = torch.randn(case.query.shape, generator=gen) * case.query.norm(dim=-1, keepdim=True).mean()
    return _top_per_head(block_attention_mass(case, other), k)


CONTROLS: dict[str, Callable[[NeedleCase, int], torch.Tensor]] = {
    "query-blind": query_blind_blocks,
    "random": random_blocks,
    "stale": stale_blocks,
}


def assess(case: NeedleCase, selection: torch.Tensor, output: torch.Tensor | None = None) -> Quality:
    """Recall, error vs dense and the oracle's error with as many blocks per KV head.

    ``output`` is the method's own attention output when it computed one; otherwise exact attention
    over ``selection`` is used.
    """
    dense = dense_decode_attention(case.query, case.keys, case.values, case.scale)
    if output is None:
        output = per_head_block_attention(case, selection)
    k = int(selection.shape[-1])
    oracle_out = per_head_block_attention(case, oracle_blocks(case, k))
    return Quality(
        recall=case.recall(selection),
        error=relative_error(output, dense),
        oracle_error=relative_error(oracle_out, dense),
    )
