"""ReRoPE against brute-force references: exact RoPE inside the window, clamped position beyond it."""

from __future__ import annotations

import math

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.attention import causal_attention
from ucm_client.sparse.methods.rerope import ReRoPE, rerope_attention, rerope_logits
from ucm_client.sparse.rope import apply_rope


def _qkv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 4, 32, generator=g),
        torch.randn(n, 2, 32, generator=g),
        torch.randn(n, 2, 32, generator=g),
    )


def test_window_covering_the_sequence_is_plain_rope_attention() -> None:
    q, k, v = _qkv(96)
    pos = torch.arange(96)
    ref = causal_attention(apply_rope(q, pos), pos, apply_rope(k, pos), v, pos, scale=1 / math.sqrt(32))
    out = rerope_attention(q, pos, k, v, pos, window=96)
    assert torch.allclose(out, ref, atol=1e-5)


def test_beyond_the_window_relative_position_is_clamped() -> None:
    q, k, v = _qkv(40, seed=1)
    pos = torch.arange(40)
    window = 8
    out = rerope_attention(q, pos, k, v, pos, window=window)
    # Brute force: for each (i, j) rotate q by min(i - j, window) and leave k at position 0.
    expect = torch.empty_like(out)
    for i in range(40):
        rel = torch.clamp(i - pos[: i + 1], max=window)
        qi = apply_rope(q[i].expand(i + 1, -1, -1), rel.to(torch.float64))  # [i+1, 4, 32]
        logits = torch.einsum(
            "jgd,jgd->gj", qi.view(i + 1, 2, 2, 32).flatten(1, 2), k[: i + 1].repeat_interleave(2, 1)
        )
        probs = torch.softmax(logits / math.sqrt(32), dim=-1)
        expect[i] = torch.einsum("gj,jgd->gd", probs, v[: i + 1].repeat_interleave(2, 1))
    assert torch.allclose(out, expect, atol=1e-5)
    # and it is not plain RoPE (the clamp changes far logits)
    plain = rerope_attention(q, pos, k, v, pos, window=40)
    assert not torch.allclose(out, plain, atol=1e-3)


def test_quarter_window_still_finds_far_needles() -> None:
    # 1024 tokens, window 256 (25%): needles 500-900 tokens back must be the top-attended tokens,
    # because beyond the window every key reads as `window` away and content alone decides.
    n, window = 1024, 256
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 32, generator=g)
    k = torch.randn(n, 2, 32, generator=g)
    v = torch.randn(n, 2, 32, generator=g)
    needles = torch.tensor([100, 300, 450, 520])
    group_mean = q.view(1, 2, 2, 32).mean(2)  # [1, kv_heads, D]
    target = apply_rope(group_mean, torch.tensor([float(window)]))[0]  # what R(w)·q meets beyond the window
    k[needles] = 3.0 * math.sqrt(32) * target / target.norm(dim=-1, keepdim=True)
    pos = torch.arange(n)
    qpos = torch.tensor([n - 1])
    logits = rerope_logits(q, qpos, k, pos, window=window)  # [2, 2, 1, n]
    top = torch.topk(logits.mean(dim=(0, 1))[0], needles.numel()).indices
    assert float(torch.isin(needles, top).float().mean()) >= 0.95
    probs = torch.softmax(logits, dim=-1)[..., needles].sum(-1)
    assert float(probs.min()) > 0.5  # most attention mass on the needles in every head
    out = rerope_attention(q, qpos, k, v, pos, window=window)
    assert torch.isfinite(out).all()


def test_rerope_method_reads_its_spec() -> None:
    method = UcmSparseFactory.create_sparse_method("ReRoPE", UcmSparseRole.WORKER, {"window": 16})
    assert isinstance(method, ReRoPE) and method.spec.window == 16
    q, k, v = _qkv(32, seed=3)
    pos = torch.arange(32)
    assert torch.allclose(method.attend(q, pos, k, v, pos), rerope_attention(q, pos, k, v, pos, window=16))
