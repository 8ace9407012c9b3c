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
from typing import Any, Literal

from ucm_client.types import key_digest
from ucm_client.vllm.config import ConfigError, ConnectorConfig, WeightFingerprint
from ucm_protocol.keys import KEY_BYTES

__all__ = [
    "CacheGroup",
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


GroupKind = Literal["full", "sliding_window", "mamba"]


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One of vLLM's KV cache groups as the connector stores it.

    A model with one group (every layer full attention, or a model vLLM gave one group) is stored
    exactly as before hybrid support: ``fields`` is empty, so its namespace is unchanged. With
    several groups (vLLM's hybrid KV cache manager) each group is stored under its own namespace,
    ``fields`` saying which group it is: its index, kind, window, spec and layers.

    A ``mamba`` group (Mamba / linear attention, e.g. Qwen3-Next's Gated DeltaNet) holds no KV per
    token but one state per block boundary: with prefix caching vLLM runs it in
    ``mamba_cache_mode="align"``, where block ``i`` of the group's block table holds the recurrent
    state after token ``(i + 1) * block_size``, and the other entries are its null block. Such a block
    is stored under the same key as the other groups' block ``i`` (vLLM's hash of that prefix), and a
    hit of ``n`` blocks needs only its block ``n - 1``, and only at a block boundary.
    """

    index: int = 0
    kind: GroupKind = "full"
    layer_names: tuple[str, ...] = ()
    fields: tuple[tuple[str, str], ...] = ()
    window: int = 0
    """Sliding window in tokens (``sliding_window`` groups)."""
    retained: int = 0
    """Tokens vLLM keeps below the window (``SlidingWindowSpec.extra_retained_tokens``)."""

    def first_block(self, num_tokens: int, block_size: int) -> int:
        """The first block a hit of ``num_tokens`` tokens needs from this group.

        vLLM's rule (``SlidingWindowManager.get_num_skipped_tokens``): after ``num_tokens`` computed
        tokens, the next token attends to the last ``window - 1`` of them, and the blocks wholly
        below those are null in the request's block table, neither loaded nor needed. A full
        attention group needs every block from the first.
        A Mamba group needs the one state block ending at the hit (``num_tokens`` a block boundary).
        """
        if self.kind == "mamba":
            return max(num_tokens // block_size - 1, 0)
        if self.kind != "sliding_window":
            return 0
        return max(0, num_tokens - self.window + 1 - self.retained) // block_size


def _spec_fields(spec: Any, layer_names: Sequence[str], total_layers: int | None = None) -> dict[str, str]:
    """Namespace fields describing one group's KV bytes (the fields a single group always had).

    ``total_layers`` (pipeline parallelism): the model's layer count replaces the group's, which is
    only this stage's; the stage's own layer range goes into the namespace with the stage.
    """
    return {
        "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "kv_quant": str(getattr(spec, "kv_quant_mode", "none")),
        "block_size": str(spec.block_size),
        "num_kv_heads": str(spec.num_kv_heads),
        "head_size": str(spec.head_size),
        "head_size_v": str(getattr(spec, "head_size_v", spec.head_size)),
        "spec": type(spec).__name__,
        "num_layers": str(len(layer_names) if total_layers is None else total_layers),
    }


def _mamba_fields(spec: Any, layer_names: Sequence[str]) -> dict[str, str]:
    """Namespace fields describing one Mamba group's state bytes (shapes and dtypes of its states)."""
    return {
        "kv_dtype": ",".join(str(d).removeprefix("torch.") for d in spec.dtypes),
        "state_shapes": repr(tuple(tuple(s) for s in spec.shapes)),
        "mamba_type": str(getattr(spec.mamba_type, "name", spec.mamba_type)),
        "mamba_cache_mode": str(spec.mamba_cache_mode),
        "block_size": str(spec.block_size),
        "page_size": str(spec.page_size_bytes),
        "spec": type(spec).__name__,
        "num_layers": str(len(layer_names)),
    }


def check_mamba_group(index: int, spec: Any, layer_names: Sequence[str]) -> None:
    """Refuse a Mamba group whose states the connector cannot store, saying why."""
    group = f"KV cache group {index} (MambaSpec, layers {', '.join(layer_names)})"
    if spec.mamba_cache_mode != "align":
        raise ConfigError(
            f"UCMConnector: {group} runs with mamba_cache_mode={spec.mamba_cache_mode!r}: vLLM keeps one "
            "running state per request and no state at block boundaries, so there is no prefix state "
            "to store or load. Enable prefix caching (vLLM then sets mamba_cache_mode='align')"
        )
    if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
        raise ConfigError(
            f"UCMConnector: {group} has speculative ({spec.num_speculative_blocks}) or prefill checkpoint "
            f"({spec.num_prefill_checkpoint_blocks}) state blocks, which vLLM moves inside the block "
            "table; not supported yet"
        )


def _hybrid_group(index: int, group: Any, block_size: int, total_layers: int | None) -> CacheGroup:
    """One group of a hybrid model, or a ``ConfigError`` naming what is not supported."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    kind: GroupKind
    if isinstance(spec, MambaSpec):
        kind, window, retained = "mamba", 0, 0
        check_mamba_group(index, spec, group.layer_names)
    elif isinstance(spec, SlidingWindowSpec):
        kind, window, retained = "sliding_window", int(spec.sliding_window), int(spec.extra_retained_tokens)
    elif type(spec) is FullAttentionSpec:
        kind, window, retained = "full", 0, 0
    else:
        raise ConfigError(
            f"UCMConnector stores full-attention, sliding-window and Mamba KV cache groups; group {index} of "
            f"this model is {type(spec).__name__} (layers {', '.join(group.layer_names)}), not supported yet"
        )
    if int(spec.block_size) != block_size:
        raise ConfigError(
            f"UCMConnector needs every KV cache group to use the block size {block_size}; "
            f"group {index} ({type(spec).__name__}) uses {spec.block_size}"
        )
    layers = layer_order(group.layer_names)
    fields = _mamba_fields(spec, layers) if kind == "mamba" else _spec_fields(spec, layers)
    fields.update(
        group=str(index), kind=kind, window=str(window), retained=str(retained), layers=",".join(layers)
    )
    return CacheGroup(index, kind, layers, tuple(sorted(fields.items())), window, retained)


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The namespace fields shared by every rank; ``namespace(rank, group)`` adds rank and group.

    Built identically by the scheduler (which looks up every rank's shard of every group) and by
    each worker (which loads and saves its own), from configuration both processes see.
    """

    fields: tuple[tuple[str, str], ...]
    tp_size: int
    layer_names: tuple[str, ...] = ()
    """The KV cache's attention layers in ``layer_order``: layer ``i``'s keys are ``layer_key(key, i)``."""
    layerwise: bool = False
    """Blocks are stored per layer (``use_layerwise``); part of ``fields`` too, so namespaces differ."""
    groups: tuple[CacheGroup, ...] = (CacheGroup(),)
    """vLLM's KV cache groups; one (with no fields of its own) unless the model is hybrid."""
    stages: tuple[str, ...] = ()
    """Pipeline parallelism: each stage's layer range (``"0-3"``), by stage; empty without it."""
    replicated: bool = False
    """MLA (latent KV, one head): every TP rank holds the same KV, so one copy is stored, TP rank 0's
    (``namespace`` gives every rank rank 0's namespace; only rank 0 dumps, every rank loads)."""

    @property
    def has_state_groups(self) -> bool:
        """A Mamba group: its state is read by layers that never wait for a load (see ``UcmWorker``)."""
        return any(group.kind == "mamba" for group in self.groups)

    @property
    def pp_size(self) -> int:
        return max(len(self.stages), 1)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups (vLLM's hybrid KV cache manager), each stored apart."""
        return len(self.groups) > 1

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> KeySpace:
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ConfigError("UCMConnector: this model has no KV cache group (nothing to store)")
        spec = groups[0].kv_cache_spec
        layout = kv_cache_config.kv_cache_layout or str(getattr(cache_config, "kv_cache_layout", ""))
        fields: dict[str, str] = dict(model_identity(model_config.model, model_config.revision, config))
        fields.update(
            cache_dtype=str(cache_config.cache_dtype),
            layout=str(layout),
            hash_algo=str(cache_config.prefix_caching_hash_algo),
        )
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
        stages = _stage_ranges(model_config, pp_size)
        total_layers = model_config.get_total_num_hidden_layers() if stages else None
        if stages and config.use_layerwise:
            raise ConfigError("use_layerwise is not supported with pipeline parallelism; use whole blocks")
        if stages:
            fields["pp_size"] = str(pp_size)
        cache_groups: tuple[CacheGroup, ...] = (CacheGroup(layer_names=layer_order(groups[0].layer_names)),)
        if len(groups) == 1 and _is_mamba(spec):
            raise ConfigError(
                "UCMConnector stores Mamba state beside attention KV (hybrid models); this model's only "
                f"KV cache group is {type(spec).__name__} (layers {', '.join(groups[0].layer_names)}), "
                "not supported yet"
            )
        if len(groups) == 1:  # exactly the fields a single-group model always had: its blocks still hit
            fields.update(_spec_fields(spec, groups[0].layer_names, total_layers))
        else:
            if config.use_layerwise:
                raise ConfigError(
                    f"use_layerwise is not supported with several KV cache groups (this model has "
                    f"{len(groups)}: vLLM's hybrid KV cache manager); use whole blocks"
                )
            block_size = int(cache_config.block_size)  # the unit of vLLM's block hashes, hence of keys
            cache_groups = tuple(_hybrid_group(i, g, block_size, total_layers) for i, g in enumerate(groups))
            fields["kv_cache_groups"] = str(len(groups))
        if config.use_layerwise:  # only then: whole-block namespaces stay what they always were
            fields["layerwise"] = "one object per layer"
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        fields["tp_size"] = str(tp_size)
        layers = layer_order(groups[0].layer_names)
        replicated = len(groups) == 1 and _is_mla(spec)
        return cls(
            tuple(sorted(fields.items())),
            tp_size,
            layers,
            config.use_layerwise,
            cache_groups,
            stages,
            replicated,
        )

    def namespace(self, tp_rank: int, group: int = 0, pp_rank: int = 0) -> bytes:
        """The namespace of TP rank ``tp_rank``'s shard of KV cache group ``group`` on stage ``pp_rank``."""
        from ucm_client import namespace_id

        stage = {"pp_rank": str(pp_rank), "pp_layers": self.stages[pp_rank]} if self.stages else {}
        if self.replicated:
            tp_rank = 0  # MLA: the one copy every rank loads is rank 0's
        return bytes(
            namespace_id(**dict(self.fields), **dict(self.groups[group].fields), **stage, tp_rank=tp_rank)
        )

    def shard_namespaces(self, group: int = 0) -> list[bytes]:
        """Every namespace one block of ``group`` is stored under: one per TP rank and pipeline stage.

        A hit needs all of them (each holds a different part of the block's KV).
        """
        ranks = 1 if self.replicated else self.tp_size
        return [self.namespace(r, group, p) for p in range(self.pp_size) for r in range(ranks)]


def _is_mamba(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _is_mla(spec: Any) -> bool:
    """DeepSeek-style latent KV (``MLAAttentionSpec``): one latent vector per token, the same on every
    TP rank (vLLM does not shard it), so one stored copy serves them all."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(spec, MLAAttentionSpec)


def _stage_ranges(model_config: Any, pp_size: int) -> tuple[str, ...]:
    """Each pipeline stage's layers as ``"start-end"``, as vLLM splits them (``get_pp_indices``,
    which honours ``VLLM_PP_LAYER_PARTITION``); empty without pipeline parallelism."""
    if pp_size <= 1:
        return ()
    from vllm.distributed.utils import get_pp_indices

    total = model_config.get_total_num_hidden_layers()
    return tuple("{}-{}".format(*get_pp_indices(total, rank, pp_size)) for rank in range(pp_size))
