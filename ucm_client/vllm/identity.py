"""What makes stored KV bytes reusable: block keys and the namespace they live in.

A block's key is vLLM's own ``request.block_hashes`` entry for it. Those hashes already chain the
whole token prefix and carry the extra keys that change KV (``cache_salt`` on the first block, LoRA
name, multimodal hashes, prompt embeddings), so two requests share a key only when vLLM itself would
share the block. Everything else that makes bytes incompatible goes into the namespace: model
identity (path or name plus a weight fingerprint or revision), KV dtype and quantization, memory
layout, block size, head geometry, layer count, and the TP rank and size whose shard the bytes are.
A lookup under a different namespace is a miss, never a wrong load. With ``use_layerwise`` each block
is stored as one object per attention layer (``layer_key(key, index)``, the index being the layer's
place in ``layer_order``), and the namespace says so: whole-block and layerwise stores never mix.

The hashes are only useful if another process computes the same ones: vLLM's ``xxhash`` variants
seed themselves randomly per process unless ``PYTHONHASHSEED`` is set, so that setting is refused.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ucm_client.types import key_digest
from ucm_client.vllm.config import ConfigError, ConnectorConfig, WeightFingerprint
from ucm_protocol.keys import KEY_BYTES

__all__ = [
    "KeySpace",
    "block_keys",
    "check_hash_stability",
    "layer_key",
    "layer_order",
    "model_identity",
    "weight_fingerprint",
]

_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_UNSTABLE_ALGOS = ("xxhash", "xxhash_cbor")


def check_hash_stability(algo: str, config: ConnectorConfig, environ: dict[str, str] | None = None) -> None:
    """Refuse block hashes that differ between processes: a store keyed on them never hits.

    vLLM seeds its ``xxhash`` variants with random bytes per process unless ``PYTHONHASHSEED`` is
    set; ``sha256`` variants use a fixed seed and are stable.
    """
    env = os.environ if environ is None else environ
    if algo in _UNSTABLE_ALGOS and env.get("PYTHONHASHSEED") is None and not config.allow_unstable_hashes:
        raise ConfigError(
            f"prefix_caching_hash_algo={algo!r} seeds block hashes randomly in every process, so "
            "blocks stored by one vLLM process would never be found by another. Set PYTHONHASHSEED "
            "to the same value in every vLLM process, or use --prefix-caching-hash-algo sha256 "
            "(or set allow_unstable_hashes: true to accept a cache that only this process can hit)."
        )


def block_keys(block_hashes: Sequence[bytes], block_size: int, hash_block_size: int) -> list[bytes]:
    """One 32-byte key per full KV block, from vLLM's hashes.

    When vLLM hashes at a finer granularity than it allocates blocks (``hash_block_size`` smaller
    than ``block_size``), a block's key is the hash of its last sub-block, which chains over the
    whole prefix. Hashes that are not 32 bytes (xxhash: 16) are widened with BLAKE2b so every key
    has the store's fixed size.
    """
    if block_size % hash_block_size:
        raise ValueError(f"block_size {block_size} is not a multiple of hash_block_size {hash_block_size}")
    ratio = block_size // hash_block_size
    picked = block_hashes[ratio - 1 :: ratio]
    return [bytes(h) if len(h) == KEY_BYTES else _widen(bytes(h)) for h in picked]


def layer_order(layer_names: Iterable[str]) -> tuple[str, ...]:
    """Attention layer names in layer order: numbers inside names compare as numbers.

    The index of a name here is the layer index of its per-layer keys: the scheduler (which looks
    them up) and every worker (which loads and dumps them), and any later vLLM process, must agree
    without exchanging anything. A sort of the names alone gives that, whatever order vLLM lists them
    in; ``model.layers.10.self_attn.attn`` sorts after ``model.layers.9.self_attn.attn``.
    """

    def natural(name: str) -> tuple[tuple[int, int | str], ...]:
        return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)

    return tuple(sorted(set(layer_names), key=natural))


def layer_key(key: bytes, layer: int) -> bytes:
    """The key of one layer's part of a block, for layerwise dumps and loads."""
    return key_digest(key, "layer", layer)


def _widen(digest: bytes) -> bytes:
    return key_digest(b"vllm-block-hash", digest)


def weight_fingerprint(model_dir: Path, mode: WeightFingerprint) -> str:
    """A short digest of the weight files in ``model_dir`` (see ``ConnectorConfig.weight_fingerprint``).

    ``sampled`` hashes each file's name, size, first and last MiB: two checkpoints with the same
    shapes but different values differ in both (safetensors headers hold only shapes, the data
    right after them differs), and it costs milliseconds even for a 100 GB model.
    """
    return _fingerprint(model_dir.resolve(), mode)


@cache
def _fingerprint(model_dir: Path, mode: WeightFingerprint) -> str:
    if mode == "off":
        return "off"
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as fh:
            if mode == "full" or size <= 2 * _SAMPLE_BYTES:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
            else:
                digest.update(fh.read(_SAMPLE_BYTES))
                fh.seek(size - _SAMPLE_BYTES)
                digest.update(fh.read(_SAMPLE_BYTES))
    return f"{mode}:{digest.hexdigest()}" if files else "no-weight-files"


def model_identity(model: str, revision: str | None, config: ConnectorConfig) -> dict[str, str]:
    """Namespace fields naming the model: an explicit ``model_id``, else name/path + weights."""
    if config.model_id:
        return {"model_id": config.model_id}
    fields = {"model": model, "revision": revision or ""}
    local = Path(model).expanduser()
    if not local.is_dir():
        local = _hub_snapshot(model, revision) or local
    if local.is_dir():
        fields["weights"] = weight_fingerprint(local, config.weight_fingerprint)
    return fields


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of a hub model (its path names the commit), if present."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached, offline, not a repo id: identity falls back to name + revision
        return None


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The namespace fields shared by every rank; ``namespace(rank)`` adds the rank.

    Built identically by the scheduler (which looks up every rank's shard) and by each worker
    (which loads and saves its own), from configuration both processes see.
    """

    fields: tuple[tuple[str, str], ...]
    tp_size: int
    layer_names: tuple[str, ...] = ()
    """The KV cache's attention layers in ``layer_order``: layer ``i``'s keys are ``layer_key(key, i)``."""
    layerwise: bool = False
    """Blocks are stored per layer (``use_layerwise``); part of ``fields`` too, so namespaces differ."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> KeySpace:
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(
                f"UCMConnector supports models with one KV cache group, this one has {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        layout = kv_cache_config.kv_cache_layout or str(getattr(cache_config, "kv_cache_layout", ""))
        fields: dict[str, str] = dict(model_identity(model_config.model, model_config.revision, config))
        fields.update(
            kv_dtype=str(spec.dtype).removeprefix("torch."),
            cache_dtype=str(cache_config.cache_dtype),
            kv_quant=str(getattr(spec, "kv_quant_mode", "none")),
            layout=str(layout),
            block_size=str(spec.block_size),
            num_kv_heads=str(spec.num_kv_heads),
            head_size=str(spec.head_size),
            head_size_v=str(getattr(spec, "head_size_v", spec.head_size)),
            spec=type(spec).__name__,
            num_layers=str(len(groups[0].layer_names)),
            hash_algo=str(cache_config.prefix_caching_hash_algo),
        )
        if config.use_layerwise:  # only then: whole-block namespaces stay what they always were
            fields["layerwise"] = "one object per layer"
        if int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("UCMConnector does not support pipeline parallelism yet (use TP only)")
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        fields["tp_size"] = str(tp_size)
        layers = layer_order(groups[0].layer_names)
        return cls(tuple(sorted(fields.items())), tp_size, layers, config.use_layerwise)

    def namespace(self, tp_rank: int) -> bytes:
        from ucm_client import namespace_id

        return bytes(namespace_id(**dict(self.fields), tp_rank=tp_rank))
