"""The attention arithmetic every sparse method shares, on one request's token-major KV.

Shapes: one decode query ``[num_heads, head_dim]``; keys and values ``[num_tokens, num_kv_heads,
head_dim]``; grouped-query attention maps query head ``h`` to KV head ``h // (num_heads //
num_kv_heads)``. Sparse attention here is *exact attention over a subset of tokens*: with every token
selected it is the dense computation, operation for operation, which is what the full-budget tests
rely on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ucm_client.sparse.kernels.scoring import block_max_logits, code_blocks

__all__ = [
    "ChannelCodes",
    "aggregate_heads",
    "block_means",
    "blocks_to_tokens",
    "causal_attention",
    "channel_codes",
    "channel_codes_reference",
    "channel_token_max",
    "dense_decode_attention",
    "group_query",
    "norm_shrink",
    "per_head_sparse_attention",
    "select_blocks",
    "select_blocks_per_head",
    "sparse_decode_attention",
]


def group_query(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[num_heads, D]`` → ``[num_kv_heads, group, D]`` (the query heads sharing each KV head)."""
    heads, dim = query.shape
    return query.reshape(num_kv_heads, heads // num_kv_heads, dim)


def dense_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of one query over all tokens: ``[num_heads, D]``."""
    q = group_query(query, keys.shape[1])  # [H, G, D]
    logits = torch.einsum("hgd,nhd->hgn", q, keys) * scale
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgn,nhd->hgd", probs, values)
    return out.reshape(query.shape)


def sparse_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_idx: torch.Tensor,
    scale: float,
    *,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact attention restricted to ``token_idx`` (sorted, unique).

    ``workspace`` (two ``[capacity, kv_heads, D]`` buffers) receives the gathered rows: a fresh
    multi-MiB allocation per step costs as much in page faults as the copy itself.
    """
    n = int(token_idx.numel())
    if workspace is not None and workspace[0].shape[0] >= n:
        k_sel = torch.index_select(keys, 0, token_idx, out=workspace[0][:n])
        v_sel = torch.index_select(values, 0, token_idx, out=workspace[1][:n])
    else:
        # index_select copies whole [kv_heads, D] rows; about twice as fast as advanced indexing.
        k_sel, v_sel = keys.index_select(0, token_idx), values.index_select(0, token_idx)
    return dense_decode_attention(query, k_sel, v_sel, scale)


def block_means(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean key per block and KV head, ``[num_blocks, num_kv_heads, D]``; the last block may be partial."""
    n, heads, dim = keys.shape
    num_blocks = -(-n // block_size)
    pad = num_blocks * block_size - n
    if pad:
        keys = torch.cat([keys, keys.new_zeros(pad, heads, dim)])
    sums = keys.reshape(num_blocks, block_size, heads, dim).sum(dim=1)
    counts = torch.full((num_blocks,), float(block_size), dtype=keys.dtype, device=keys.device)
    counts[-1] = block_size - pad
    return sums / counts[:, None, None]


class ChannelCodes(NamedTuple):
    """Keys kept for scoring: int8 ``codes`` ``[H, C, n]`` times float32 ``scales`` ``[H, C, n / block]``.

    Channel-major per KV head, as vLLM's CPU cache pages are, so reading a few channels of every
    token is reading a few contiguous rows. One scale per (head, channel, block): a block's loudest
    key in a channel sets that channel's step there, so a single-token outlier is kept exactly (it
    is the maximum) and one loud block costs no precision elsewhere. A quarter of float32 keys, half
    of the float16 kept before, and what the compiled scoring loop reads.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[H, C, n]`` (tests and diagnostics; scoring reads the codes)."""
        heads, chans, n = self.codes.shape
        blocks = self.scales.shape[-1]
        grid = self.codes.float().view(heads, chans, blocks, n // blocks)
        return (grid * self.scales[..., None]).view(heads, chans, n)


def channel_codes(keys: torch.Tensor, block_size: int) -> tuple[ChannelCodes, torch.Tensor]:
    """Token-major keys ``[m * block_size, H, D]`` of whole blocks → their :class:`ChannelCodes` and
    the keys' squared norms ``[H, n]`` (taken before coding, so the shrink does not inherit the
    codes' rounding). One compiled pass per block on the host; torch ops elsewhere."""
    n, heads, dim = keys.shape
    if n % block_size:
        raise ValueError(f"channel_codes takes whole blocks: {n} tokens, block size {block_size}")
    if keys.device.type != "cpu":
        return channel_codes_reference(keys, block_size)
    codes = torch.empty(heads, dim, n, dtype=torch.int8)
    scales = torch.empty(heads, dim, n // block_size, dtype=torch.float32)
    sq_norms = torch.empty(heads, n, dtype=torch.float32)
    source = keys.float().contiguous()
    code_blocks(source.numpy(), block_size, codes.numpy(), scales.numpy(), sq_norms.numpy())
    return ChannelCodes(codes, scales), sq_norms


def channel_codes_reference(keys: torch.Tensor, block_size: int) -> tuple[ChannelCodes, torch.Tensor]:
    """:func:`channel_codes` in torch ops (any device; the compiled pass is tested against it)."""
    n, heads, dim = keys.shape
    grid = keys.float().permute(1, 2, 0).reshape(heads, dim, n // block_size, block_size)
    scales = grid.abs().amax(dim=-1).div_(127.0).clamp_min_(1e-30)
    codes = torch.round(grid / scales[..., None]).to(torch.int8).reshape(heads, dim, n)
    sq_norms = keys.float().square().sum(dim=-1).t().contiguous()
    return ChannelCodes(codes.contiguous(), scales.contiguous()), sq_norms


def channel_token_max(
    queries: torch.Tensor, keys: ChannelCodes, channels: int, block_size: int, shrink: torch.Tensor
) -> torch.Tensor:
    """Per block, the best token's approximate logit, from the query's ``channels`` largest channels.

    ``queries`` ``[X, H, C]`` (one per KV head), ``keys`` :class:`ChannelCodes` of ``m`` blocks,
    ``shrink`` ``[H, m * block_size]`` (:func:`norm_shrink`) → ``[X, H, m]``. The channels are
    chosen per query and KV head by magnitude (SparQ): they carry most of ``q·k``, so a block's
    score is its best token's, and a single-token needle keeps its block's score where a mean
    would dilute it by the block size.

    A partial dot product of a key with a large norm is noise of that size even when the full one is
    ~0 (keys that no query matches); so each token's partial logit is multiplied by its ``shrink``,
    which scores a key longer than the median as if it had the median length (its direction still
    counts). The factor depends on the key alone, so it is kept with the features rather than
    recomputed from the chosen channels at every retrieval.
    """
    heads, dim, n = keys.codes.shape
    count, r = queries.shape[0], min(channels, dim)
    q = queries.float()
    chosen = torch.topk(q.abs(), r, dim=-1).indices  # [X, H, r]
    picked = q.gather(-1, chosen)
    if keys.codes.device.type != "cpu":  # the compiled loop reads host memory
        masked = torch.zeros_like(q).scatter_(-1, chosen, picked)
        dots = torch.einsum("xhc,hcn->xhn", masked, keys.dequantize()) * shrink
        return dots.view(count, heads, -1, block_size).amax(dim=-1)
    rows, weights = chosen, picked  # each query reads its own rows of a block, cached meanwhile
    pad = -rows.shape[-1] % 4  # the loop reads channels four at a time
    if pad:
        rows = torch.cat([rows, rows.new_zeros(count, heads, pad)], dim=-1)
        weights = torch.cat([weights, weights.new_zeros(count, heads, pad)], dim=-1)
    out = torch.empty(count, heads, n // block_size, dtype=torch.float32)
    block_max_logits(
        keys.codes.numpy(),
        keys.scales.numpy(),
        rows.contiguous().numpy(),
        weights.contiguous().numpy(),
        shrink.float().contiguous().numpy(),
        block_size,
        out.numpy(),
    )
    return out


SHRINK_SAMPLE_STRIDE = 8
"""Every 8th key estimates the median norm (5.9 -> ~0.8 ms at 32k tokens, 8 KV heads)."""


def norm_shrink(squared_norms: torch.Tensor) -> torch.Tensor:
    """Per token, ``min(1, median norm / norm)`` per KV head, from squared key norms ``[H, n]``.

    The median is over every ``SHRINK_SAMPLE_STRIDE``-th key from the first: a fixed stride, so a
    context and the same context one block shorter sample the same keys but the last block's (the
    paged path features the current block one step after the tensor-level path, and both must
    select alike; a stride growing with ``n`` sampled them differently). Callers keep the result
    until more tokens are featured.
    """
    typical = squared_norms[:, ::SHRINK_SAMPLE_STRIDE].median(dim=-1, keepdim=True).values
    return (typical / squared_norms.clamp_min(1e-24)).clamp_max_(1.0).sqrt_()


def aggregate_heads(scores: torch.Tensor) -> torch.Tensor:
    """Per-head block scores ``[num_kv_heads, num_blocks]`` → one score per block.

    vLLM's kernels take one block table per request, so the heads must agree on a selection. Each
    head's scores become a softmax distribution (comparable across heads whatever their scale) and a
    block scores its best head: a needle that only one head looks at still wins its block.
    """
    return torch.softmax(scores, dim=-1).amax(dim=0)


def select_blocks(scores: torch.Tensor, keep: int, init_window: int, local_window: int) -> torch.Tensor:
    """Sorted block ids: the init and local windows, then the top-scoring blocks up to ``keep``."""
    return select_blocks_per_head(scores[None], keep, init_window, local_window)[0]


def select_blocks_per_head(
    scores: torch.Tensor, keep: int, init_window: int, local_window: int
) -> torch.Tensor:
    """:func:`select_blocks` for each KV head's scores ``[kv_heads, num_blocks]`` → ``[kv_heads, k]``.

    One ``topk`` over scores with the windows forced to +inf: the count is known on the host from the
    integers given, so nothing is read back from the scores' device.
    """
    heads, num_blocks = scores.shape
    if keep >= num_blocks:
        return torch.arange(num_blocks, device=scores.device)[None].expand(heads, -1)
    init = min(init_window, num_blocks)
    local_start = max(init, num_blocks - local_window)
    forced = torch.zeros(num_blocks, dtype=torch.bool, device=scores.device)
    forced[:init] = True
    forced[local_start:] = True
    count = max(keep, init + (num_blocks - local_start))
    masked = scores.float().masked_fill(forced[None], float("inf"))
    return torch.topk(masked, count, dim=-1).indices.sort(dim=-1).values


def per_head_sparse_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Exact attention where KV head ``h`` attends only to blocks ``block_ids[h]`` (``[kv_heads, k]``).

    Each head gathers its own rows (one ``index_select`` per head over that head's column of the KV),
    and positions past the context (a partial last block) are masked out.
    """
    n, kv_heads, _ = keys.shape
    tokens = (
        block_ids[:, :, None].long() * block_size + torch.arange(block_size, device=keys.device)
    ).flatten(1)
    valid = tokens < n
    tokens = tokens.clamp_max(n - 1)
    k = torch.stack([keys[:, h].index_select(0, tokens[h]) for h in range(kv_heads)])  # [H, T, D]
    v = torch.stack([values[:, h].index_select(0, tokens[h]) for h in range(kv_heads)])
    q = group_query(query, kv_heads)  # [H, g, D]
    logits = torch.einsum("hgd,htd->hgt", q, k) * scale
    if not bool(valid.all()):
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("hgt,htd->hgd", torch.softmax(logits, dim=-1), v)
    return out.reshape(query.shape)


def blocks_to_tokens(block_ids: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Token indices covered by ``block_ids`` (sorted), clipped at ``num_tokens``."""
    offsets = torch.arange(block_size, device=block_ids.device)
    tokens = (block_ids[:, None] * block_size + offsets[None, :]).flatten()
    return tokens[tokens < num_tokens]


def causal_attention(
    query: torch.Tensor,
    q_pos: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[M, heads, D]`` over ``keys`` ``[N, kv_heads, D]``, causal by position."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    q = query.reshape(query.shape[0], kv_heads, heads // kv_heads, -1)  # [M, H, G, D]
    logits = torch.einsum("mhgd,nhd->hgmn", q, keys) * scale
    mask = k_pos[None, :] > q_pos[:, None]  # [M, N]
    logits = logits.masked_fill(mask, float("-inf"))
    out = torch.einsum("hgmn,nhd->mhgd", torch.softmax(logits, dim=-1), values)
    return out.reshape(query.shape)
