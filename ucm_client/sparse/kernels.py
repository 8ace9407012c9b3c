"""The attention arithmetic every sparse method shares, on one request's token-major KV.

Shapes: one decode query ``[num_heads, head_dim]``; keys and values ``[num_tokens, num_kv_heads,
head_dim]``; grouped-query attention maps query head ``h`` to KV head ``h // (num_heads //
num_kv_heads)``. Sparse attention here is *exact attention over a subset of tokens*: with every token
selected it is the dense computation, operation for operation, which is what the full-budget tests
rely on.
"""

from __future__ import annotations

import torch

__all__ = [
    "aggregate_heads",
    "block_means",
    "blocks_to_tokens",
    "causal_attention",
    "channel_major_keys",
    "channel_squared_norms",
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


def channel_major_keys(keys: torch.Tensor) -> torch.Tensor:
    """Token-major keys ``[n, H, D]`` → float16 ``[H, D, n]``.

    Channel-major per KV head, as vLLM's CPU cache pages are, so reading a few channels of every
    token is reading a few contiguous rows; float16 halves what is kept and read. Blocks append
    along the last axis.
    """
    return keys.permute(1, 2, 0).to(torch.float16).contiguous()


def channel_token_max(
    queries: torch.Tensor, keys_cm: torch.Tensor, channels: int, block_size: int, shrink: torch.Tensor
) -> torch.Tensor:
    """Per block, the best token's approximate logit, from the query's ``channels`` largest channels.

    ``queries`` ``[X, H, D]`` (one per KV head), ``keys_cm`` ``[H, D, m * block_size]``
    (:func:`channel_major_keys`), ``shrink`` ``[H, m * block_size]`` (:func:`norm_shrink`) →
    ``[X, H, m]``. The channels are chosen per query and KV head by magnitude (SparQ): they carry
    most of ``q·k``, so a block's score is its best token's, and a single-token needle keeps its
    block's score where a mean would dilute it by the block size.

    A partial dot product of a key with a large norm is noise of that size even when the full one is
    ~0 (keys that no query matches); so each token's partial logit is multiplied by its ``shrink``,
    which scores a key longer than the median as if it had the median length (its direction still
    counts). The factor depends on the key alone, so it is kept with the features rather than
    recomputed from the chosen channels at every retrieval (that was half of a retrieval's time).
    """
    heads, dim, n = keys_cm.shape
    r = min(channels, dim)
    q = queries.float()
    chosen = torch.topk(q.abs(), r, dim=-1).indices  # [X, H, r]
    q_chosen = q.gather(-1, chosen)  # [X, H, r]
    out = torch.empty(queries.shape[0], heads, n // block_size, dtype=torch.float32, device=keys_cm.device)
    # One head at a time, in one reused buffer: the working set (r x n floats) stays in cache, where
    # a batched [X, H, r, n] gather measured 2x slower than this loop at 32k tokens.
    if queries.shape[0] > 1 and queries.shape[0] * r >= dim:
        # Several queries whose chosen channels together cover at least ``dim`` rows: read every
        # channel once and score all queries in one product, each query zero outside its channels
        # (KVStar's group of 4 over 32 kept channels: 32 rows read instead of 64).
        masked = torch.zeros_like(q).scatter_(-1, chosen, q_chosen)  # [X, H, D]
        whole = torch.empty(dim, n, dtype=torch.float32, device=keys_cm.device)
        for h in range(heads):
            dots = masked[:, h] @ whole.copy_(keys_cm[h])  # [X, n]
            out[:, h] = dots.mul_(shrink[h]).view(queries.shape[0], -1, block_size).amax(dim=-1)
        return out
    sel = torch.empty(r, n, dtype=torch.float32, device=keys_cm.device)
    for x in range(queries.shape[0]):
        for h in range(heads):
            sel.copy_(keys_cm[h].index_select(0, chosen[x, h]))  # [r, n] contiguous rows
            dots = q_chosen[x, h] @ sel  # [n]
            out[x, h] = dots.mul_(shrink[h]).view(-1, block_size).amax(dim=-1)
    return out


SHRINK_SAMPLE_STRIDE = 8
"""Every 8th key estimates the median norm (5.9 -> ~0.8 ms at 32k tokens, 8 KV heads)."""


def channel_squared_norms(keys_cm: torch.Tensor) -> torch.Tensor:
    """Squared norm of every key of channel-major ``[H, D, n]`` keys, float32 ``[H, n]``.

    One channel at a time, accumulated in place: converting the whole float16 tensor and summing
    over its middle axis measured 135 ms at 32k tokens, 8 KV heads, D 128; this loop 8 ms.
    """
    out = torch.zeros(keys_cm.shape[0], keys_cm.shape[2], dtype=torch.float32, device=keys_cm.device)
    for d in range(keys_cm.shape[1]):
        row = keys_cm[:, d].float()
        out.addcmul_(row, row)
    return out


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
