"""The SGLang backend's namespaces, keys and settings, without SGLang (they are plain UCM code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ucm_client.sglang.config import load_config
from ucm_client.sglang.identity import namespace_fields, page_keys, sglang_namespace
from ucm_client.types import namespace_id
from ucm_protocol.errors import ConfigError, InvalidArgument


@dataclass(frozen=True)
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the namespace reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "tiny-model"


@dataclass(frozen=True)
class MHAPool:
    """The geometry fields of SGLang's ``MHATokenToKVPoolHost`` the namespace reads."""

    dtype: Any = torch.float16
    layout: str = "page_first"
    page_size: int = 64
    layer_num: int = 8
    head_num: int = 8
    head_dim: int = 128
    v_head_dim: int = 128


@dataclass(frozen=True)
class MLAPool:
    dtype: Any = torch.bfloat16
    layout: str = "page_first"
    page_size: int = 64
    layer_num: int = 8
    kv_cache_dim: int = 576


def test_everything_that_changes_the_bytes_changes_the_namespace() -> None:
    base = sglang_namespace(StorageConfig(), MHAPool())
    variants = [
        sglang_namespace(StorageConfig(model_name="other"), MHAPool()),
        sglang_namespace(StorageConfig(), MHAPool(dtype=torch.bfloat16)),
        sglang_namespace(StorageConfig(), MHAPool(layout="layer_first")),
        sglang_namespace(StorageConfig(), MHAPool(page_size=32)),
        sglang_namespace(StorageConfig(), MHAPool(head_num=4)),
        sglang_namespace(StorageConfig(), MHAPool(layer_num=4)),
        sglang_namespace(StorageConfig(tp_size=2, tp_rank=0), MHAPool()),
        sglang_namespace(StorageConfig(tp_size=2, tp_rank=1), MHAPool()),
        sglang_namespace(StorageConfig(pp_size=2, pp_rank=1), MHAPool()),
        sglang_namespace(StorageConfig(), MHAPool(), model_id="registry/model@sha256:1"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert sglang_namespace(StorageConfig(), MHAPool()) == base  # and nothing else does


def test_mla_is_stored_once_under_rank_0() -> None:
    ranks = [
        sglang_namespace(StorageConfig(tp_size=4, tp_rank=r, is_mla_model=True), MLAPool()) for r in range(4)
    ]
    assert len(set(ranks)) == 1
    mha = [sglang_namespace(StorageConfig(tp_size=4, tp_rank=r), MHAPool()) for r in range(4)]
    assert len(set(mha)) == 4


def test_sglang_and_vllm_namespaces_never_meet() -> None:
    """The same model and geometry under vLLM's field names and SGLang's: never one namespace."""
    fields = namespace_fields(StorageConfig(), MHAPool())
    assert fields["engine"] == "sglang"
    without_engine = {k: v for k, v in fields.items() if k not in ("engine", "key_scheme")}
    assert namespace_id(**without_engine) != sglang_namespace(StorageConfig(), MHAPool())
    vllm_like = {
        "model": "tiny-model",
        "revision": "",
        "kv_dtype": "float16",
        "block_size": "64",
        "num_kv_heads": "8",
        "head_size": "128",
        "num_layers": "8",
        "tp_size": "1",
        "tp_rank": "0",
    }
    assert namespace_id(**vllm_like) != sglang_namespace(StorageConfig(), MHAPool())


def test_page_keys_are_sglangs_hashes_as_bytes_and_bad_ones_are_named() -> None:
    key = "0123456789abcdef" * 4
    assert page_keys([key]) == [bytes.fromhex(key)]
    with pytest.raises(InvalidArgument, match="key 1 is 63 characters"):
        page_keys([key, key[:-1]])
    with pytest.raises(InvalidArgument, match="not hexadecimal"):
        page_keys(["g" * 64])


def test_settings_are_checked_and_the_environment_fills_the_target() -> None:
    sglang_keys = {"backend_name": "ucm", "module_path": "m", "class_name": "C", "interface_v1": 1}
    config, retention = load_config({**sglang_keys, "retention": {"pin": True, "ttl_s": 60}}, environ={})
    assert config.target is None and retention is not None and retention.pin and retention.ttl_s == 60
    config, _ = load_config(sglang_keys, environ={"UCM_SOCKET": "/run/ucm/ucm.sock"})
    assert config.target == "/run/ucm/ucm.sock"
    for bad, named in [
        ({"rpc_timeout_s": -1}, "rpc_timeout_s"),
        ({"staging_buffer_mib": 0}, "staging_buffer_mib"),
        ({"target": "dns:///host:1"}, "not a Unix socket"),
        ({"retention": {"priority": 500}}, "priority"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config({**sglang_keys, **bad}, environ={})
