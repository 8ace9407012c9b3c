"""Random-weight decoders for the Blend benchmark, built independently of the model Blend was tuned on.

Blend's defaults were first measured on the tiny Hugging Face Llama of the tests (4 layers, 4 query /
2 KV heads, default initialisation, random token prompts). The shapes here differ from it on purpose
in depth, head counts (MHA, GQA, MQA), head size, attention sharpness and in how much heads look for
matching content, so that a setting that only fits that one model shows up as a loss here.

``sharpness`` multiplies every attention logit (a random model's logits have unit variance, so 1 is
a nearly flat softmax over a few hundred tokens and 4 is peaky, closer to a trained model's heads).
``match`` mixes each head's key projection towards its query projection, so a token's query prefers
keys of tokens like itself, the content-addressed look-up of a trained model's retrieval heads;
0 leaves the two projections independent. ``locality`` adds one shared vector to every query and key
of a head before RoPE: their product ``b·R(m - n)·b`` is largest at distance 0 and falls off with
distance, the mechanism by which trained RoPE models make local heads; 0 leaves attention blind to
distance, so a random model's tokens look as far back as near.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ucm_client.sparse.rope import apply_rope

__all__ = ["DecoderShape", "RandomDecoder"]


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The geometry and character of one random decoder."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    sharpness: float
    match: float = 0.0
    locality: float = 0.0
    vocab: int = 2048
    rope_base: float = 10000.0


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


class RandomDecoder:
    """A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with seeded random weights.

    Implements :class:`ucm_client.sparse.methods.blend.BlendModel`; float32 on the CPU.
    """

    def __init__(self, shape: DecoderShape, seed: int) -> None:
        if shape.heads % shape.kv_heads:
            raise ValueError(f"{shape.name}: heads {shape.heads} not a multiple of kv_heads {shape.kv_heads}")
        self.shape = shape
        gen = torch.Generator().manual_seed(seed)

        def rand(*size: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
            return torch.randn(*size, generator=gen) * (gain / math.sqrt(fan_in))

        s = shape
        group = s.heads // s.kv_heads
        self.embedding = torch.randn(s.vocab, s.hidden, generator=gen)
        self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down = [], [], [], [], [], [], []
        self.qk_bias: list[torch.Tensor] = []
        for _ in range(s.layers):
            wq = rand(s.hidden, s.heads * s.head_dim, fan_in=s.hidden, gain=math.sqrt(s.sharpness))
            # The key of KV head h matches the first query head of its group by ``match``.
            q_first = wq.view(s.hidden, s.kv_heads, group, s.head_dim)[:, :, 0, :].reshape(s.hidden, -1)
            noise = rand(s.hidden, s.kv_heads * s.head_dim, fan_in=s.hidden, gain=math.sqrt(s.sharpness))
            wk = math.sqrt(1 - s.match**2) * noise + s.match * q_first
            self.wq.append(wq)
            self.wk.append(wk)
            self.wv.append(rand(s.hidden, s.kv_heads * s.head_dim, fan_in=s.hidden))
            self.wo.append(rand(s.heads * s.head_dim, s.hidden, fan_in=s.heads * s.head_dim))
            self.w_gate.append(rand(s.hidden, s.ffn, fan_in=s.hidden))
            self.w_up.append(rand(s.hidden, s.ffn, fan_in=s.hidden))
            self.w_down.append(rand(s.ffn, s.hidden, fan_in=s.ffn))
            bias = torch.randn(s.kv_heads, 1, s.head_dim, generator=gen) * s.locality
            self.qk_bias.append(bias)
        self.lm_head = rand(s.hidden, s.vocab, fan_in=s.hidden)

    @property
    def num_layers(self) -> int:
        return self.shape.layers

    @property
    def rope_base(self) -> float:
        return self.shape.rope_base

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[token_ids]

    def qkv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, n = self.shape, hidden.shape[0]
        h = _rms(hidden)
        bias = self.qk_bias[layer]
        q = (h @ self.wq[layer]).view(n, s.kv_heads, -1, s.head_dim) + bias[None]
        q = q.reshape(n, s.heads, s.head_dim)
        k = (h @ self.wk[layer]).view(n, s.kv_heads, s.head_dim) + bias[None, :, 0]
        v = (h @ self.wv[layer]).view(n, s.kv_heads, s.head_dim)
        return apply_rope(q, positions, s.rope_base), apply_rope(k, positions, s.rope_base), v

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn.reshape(attn.shape[0], -1) @ self.wo[layer]
        h = _rms(hidden)
        mlp = (torch.nn.functional.silu(h @ self.w_gate[layer]) * (h @ self.w_up[layer])) @ self.w_down[layer]
        return hidden + mlp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms(hidden) @ self.lm_head
