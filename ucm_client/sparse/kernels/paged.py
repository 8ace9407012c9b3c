"""Reading keys and values out of a paged KV cache (the layout vLLM's attention backends share).

Each layer's cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``: per (block, head) page,
the first half holds keys, the second values. Whole-block copies need nothing more, but sparse methods
read individual key vectors, and the CPU backend stores a page's keys transposed (``[head_dim,
block_size]``) for its kernels. Which one a cache uses is detected from data (a key just written must
be found where the layout says), never assumed from a version number.
"""

from __future__ import annotations

import enum

import torch

from ucm_client.sparse.errors import SparseInputError

__all__ = ["PageLayout", "detect_page_layout", "read_request_kv", "write_request_kv"]


class PageLayout(enum.Enum):
    """How keys sit inside one (block, head) page; values are always token-major."""

    TOKEN_MAJOR = "token_major"
    """Keys ``[block_size, head_dim]``, as FlashAttention-style backends store them."""
    KEY_TRANSPOSED = "key_transposed"
    """Keys ``[head_dim, block_size]``, as vLLM's CPU attention backend stores them."""


def _halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, heads, block_size, two_d = kv_cache.shape
    paged = kv_cache.view(num_blocks, heads, 2 * block_size, two_d // 2)
    return paged[:, :, :block_size], paged[:, :, block_size:]


def detect_page_layout(kv_cache: torch.Tensor, slot: int, key: torch.Tensor) -> PageLayout:
    """Find the layout in which ``key`` (``[num_kv_heads, head_dim]``, just written at ``slot``) sits.

    Raises :class:`SparseInputError` when neither layout matches: reading keys with a wrong guess
    would select blocks at random, which is worse than failing.
    """
    _, heads, block_size, _ = kv_cache.shape
    block, offset = divmod(int(slot), block_size)
    keys, _ = _halves(kv_cache)
    page = keys[block]  # [heads, block_size, head_dim] (memory of either layout)
    token_major = page[:, offset, :]
    transposed = page.reshape(heads, -1, block_size)[:, :, offset]
    want = key.to(kv_cache.dtype)
    tol = 1e-3 * (1.0 + float(want.abs().max()))
    if torch.allclose(token_major, want, atol=tol, rtol=0.0):
        return PageLayout.TOKEN_MAJOR
    if torch.allclose(transposed, want, atol=tol, rtol=0.0):
        return PageLayout.KEY_TRANSPOSED
    raise SparseInputError(f"kv_cache: the key written at slot {slot} is in neither known page layout")


def read_request_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, layout: PageLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_tokens, num_kv_heads, head_dim]`` of one request, in token order."""
    keys, values = _halves(kv_cache)
    _, heads, block_size, head_dim = keys.shape
    k = keys[block_ids]  # [n, H, bs, D] view contents in `layout`
    v = values[block_ids]
    n = int(block_ids.numel())
    if layout is PageLayout.KEY_TRANSPOSED:
        k_tok = k.reshape(n, heads, head_dim, block_size).permute(0, 3, 1, 2)
    else:
        k_tok = k.permute(0, 2, 1, 3)
    v_tok = v.permute(0, 2, 1, 3)
    return (
        k_tok.reshape(n * block_size, heads, head_dim)[:num_tokens],
        v_tok.reshape(n * block_size, heads, head_dim)[:num_tokens],
    )


def write_request_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: PageLayout,
) -> None:
    """Write token-major ``keys`` / ``values`` ``[num_tokens, num_kv_heads, head_dim]`` into one
    request's blocks, in ``layout`` (the inverse of :func:`read_request_kv`)."""
    halves_k, halves_v = _halves(kv_cache)
    _, heads, block_size, head_dim = halves_k.shape
    n = keys.shape[0]
    for i, block in enumerate(block_ids.tolist()):
        start, end = i * block_size, min((i + 1) * block_size, n)
        if start >= end:
            break
        k = keys[start:end].to(kv_cache.dtype).permute(1, 0, 2)  # [H, t, D]
        v = values[start:end].to(kv_cache.dtype).permute(1, 0, 2)
        if layout is PageLayout.KEY_TRANSPOSED:
            page = halves_k[block].view(heads, head_dim, block_size)  # a view: writes land in the cache
            page[:, :, : end - start] = k.transpose(1, 2)
        else:
            halves_k[block, :, : end - start] = k
        halves_v[block, :, : end - start] = v
