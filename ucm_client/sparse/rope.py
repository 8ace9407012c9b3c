"""Rotary position embedding (Llama / NeoX "rotate half" layout), as a plain function of positions.

ReRoPE needs queries rotated to positions that are not their own, and Blend needs cached keys moved
from one position to another; both need RoPE as a function rather than a model layer. Because a
rotation by ``a`` followed by one by ``b`` is a rotation by ``a + b``, moving a key from position
``p`` to ``p + d`` is ``apply_rope(k, d)`` on the already-rotated key.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, D]`` to ``positions`` ``[N]`` (integers or floats)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
