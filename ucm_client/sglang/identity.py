"""What makes SGLang's stored pages reusable: their keys and the namespace they live in.

A page's key is SGLang's own: the SHA-256 chain over the token prefix, page by page
(``get_storage_hash_str``: the previous page's hash, this page's tokens, and the request's
``extra_key`` / ``cache_salt`` folded into the chain's seed), as 64 hex characters; its 32 bytes are
the daemon's key as they are. Everything else that makes bytes incompatible goes into the namespace,
as for vLLM: the model (SGLang's model name, or ``model_id``, plus a fingerprint of the weight files
when the name is a local directory), the host pool's kind, dtype and page format, its layout, the
page size and head geometry, the layer count, and the TP rank and size whose shard the bytes are
(pipeline and context-parallel ranks too, when used). MLA pools hold the same latent KV on every TP
rank, so they are stored once, under TP rank 0's namespace, as the vLLM connector stores MLA.

The namespace also names the engine and its key scheme (``engine: sglang``): vLLM's block hashes and
SGLang's page hashes are both 32 bytes, and without that field a page hash that happened to equal a
block hash of the same model would read vLLM's bytes. With it, the two engines never share a namespace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ucm_client.types import namespace_id
from ucm_client.vllm.identity import weight_fingerprint
from ucm_protocol.errors import InvalidArgument
from ucm_protocol.keys import KEY_BYTES

__all__ = ["KEY_SCHEME", "namespace_fields", "page_keys", "sglang_namespace"]

KEY_SCHEME = "sglang-sha256-page-chain"
_HEX_CHARS = 2 * KEY_BYTES


def page_keys(keys: list[str]) -> list[bytes]:
    """SGLang's page hashes as the daemon's 32-byte keys; ``InvalidArgument`` naming a bad one."""
    if not isinstance(keys, list | tuple):
        raise InvalidArgument(f"keys must be a list of SGLang page hashes, got {type(keys).__name__}")
    out: list[bytes] = []
    for i, key in enumerate(keys):
        if not isinstance(key, str) or len(key) != _HEX_CHARS:
            what = f"{len(key)} characters" if isinstance(key, str) else f"a {type(key).__name__}"
            raise InvalidArgument(
                f"key {i} is {what}; UCM stores SGLang's SHA-256 page hashes: {_HEX_CHARS} hex characters"
            )
        try:
            out.append(bytes.fromhex(key))
        except ValueError:
            raise InvalidArgument(
                f"key {i} ({key[:16]}...) is not hexadecimal (an SGLang page hash)"
            ) from None
    return out


def _pool_fields(host_pool: Any) -> dict[str, str]:
    fields = {
        "pool": type(host_pool).__name__,
        "kv_dtype": str(host_pool.dtype).removeprefix("torch."),
        "layout": str(host_pool.layout),
        "page_size": str(host_pool.page_size),
        "num_layers": str(host_pool.layer_num),
        "page_format": str(getattr(host_pool, "storage_format_tag", None) or "plain"),
    }
    if hasattr(host_pool, "kv_cache_dim"):  # MLA: one latent row per token
        fields["kv_cache_dim"] = str(host_pool.kv_cache_dim)
    else:
        fields.update(
            num_kv_heads=str(host_pool.head_num),
            head_size=str(host_pool.head_dim),
            head_size_v=str(getattr(host_pool, "v_head_dim", host_pool.head_dim)),
        )
    return fields


def _model_fields(model_name: str | None, model_id: str | None) -> dict[str, str]:
    if model_id:
        return {"model_id": model_id}
    model = model_name or ""
    fields = {"model": model}
    local = Path(model).expanduser()
    if model and local.is_dir():
        fields["weights"] = weight_fingerprint(local, "sampled")
    return fields


def namespace_fields(storage_config: Any, host_pool: Any, model_id: str | None = None) -> dict[str, str]:
    """Every field of this rank's namespace (``storage_config``: SGLang's ``HiCacheStorageConfig``)."""
    mla = bool(storage_config.is_mla_model)
    fields = {
        "engine": "sglang",
        "key_scheme": KEY_SCHEME,
        **_model_fields(storage_config.model_name, model_id),
        **_pool_fields(host_pool),
        "tp_size": str(storage_config.tp_size),
        "tp_rank": "0" if mla else str(storage_config.tp_rank),
    }
    if mla:
        fields["replicated"] = "mla"
    if storage_config.pp_size > 1:
        fields.update(pp_size=str(storage_config.pp_size), pp_rank=str(storage_config.pp_rank))
    cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        fields.update(cp_size=str(cp_size), cp_rank=str(storage_config.attn_cp_rank))
    return fields


def sglang_namespace(storage_config: Any, host_pool: Any, model_id: str | None = None) -> bytes:
    """This rank's 16-byte namespace."""
    return bytes(namespace_id(**namespace_fields(storage_config, host_pool, model_id)))
