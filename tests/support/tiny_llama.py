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
from pathlib import Path

__all__ = ["build_tiny_llama"]

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
) -> Path:
    """Build (or reuse) a tiny Llama checkpoint under ``path`` and return its directory.

    The returned directory is ``path / <key>`` where ``<key>`` hashes all parameters; it is reused
    when its marker file exists, so repeated test sessions pay the build cost (~2 s) once.
    ``head_dim`` must be one the vLLM CPU backend accepts (32, 64, 80, ...).
    """
    params = {
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
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(path) / f"tiny-llama-{key}"
    if (out / _DONE_MARKER).exists():
        return out

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(tmp)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))  # type: ignore[no-untyped-call]
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / _DONE_MARKER).write_text(json.dumps(params, sort_keys=True))
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished the same build first; its checkpoint is identical.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / _DONE_MARKER).exists():
            raise
    return out
