"""The paths vLLM's configuration and entry points name keep working after ``sparse/`` got sub-folders.

``kv_connector_module_path``, ``scheduler_cls`` and the ``vllm.general_plugins`` entry point are strings
in users' configurations and in installed package metadata: each must still import, and give the very
same object as the module that now holds it (an ``isinstance`` against either path matches both).
"""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _resolve(path: str) -> object:
    module, _, name = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_entry_point_in_pyproject_resolves_to_the_plugin() -> None:
    pytest.importorskip("vllm")
    from ucm_client.sparse.vllm import plugin

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["vllm.general_plugins"]["ucm_sparse"]
    assert entry == "ucm_client.sparse.vllm_plugin:register"
    assert _resolve(entry) is plugin.register


def test_config_strings_give_the_same_classes() -> None:
    pytest.importorskip("vllm")
    from ucm_client.sparse.coldkv import scheduler
    from ucm_client.sparse.vllm import connector

    assert _resolve("ucm_client.sparse.vllm_connector.UcmSparseConnector") is connector.UcmSparseConnector
    assert _resolve("ucm_client.sparse.coldkv_scheduler.ColdKVScheduler") is scheduler.ColdKVScheduler
    config = connector.kv_transfer_config({"ESA": {}})
    assert (
        _resolve(f"{config['kv_connector_module_path']}.{config['kv_connector']}")
        is connector.UcmSparseConnector
    )


def test_every_built_in_method_and_the_backend_path_import() -> None:
    pytest.importorskip("vllm")
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.vllm.plugin import BACKEND_PATH

    for name in ("ESA", "GSA", "GSAOnDevice", "KVStarMultiStep", "Blend", "ReRoPE"):
        assert UcmSparseFactory.load_class(name).__name__ == name
    assert _resolve(BACKEND_PATH).__name__ == "UcmSparseCPUAttentionBackend"  # type: ignore[attr-defined]


def test_blend_keeps_its_old_path() -> None:
    from ucm_client.sparse import blend
    from ucm_client.sparse.methods import blend as moved

    assert blend.Blend is moved.Blend and blend.prefill is moved.prefill
