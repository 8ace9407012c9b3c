"""Fixtures for the connector tests: a tiny local Llama, a tiny hybrid Gemma3 and real daemons."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_llama import build_tiny_deepseek_v2, build_tiny_gemma3, build_tiny_llama


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    """The default tiny Llama (seed 0): 2 layers, 2 KV heads of 32, float32."""
    return Path(build_tiny_llama(models_dir))


@pytest.fixture(scope="session")
def tiny_gemma3(models_dir: Path) -> Path:
    """A tiny Gemma3 (layers S S F S S F, sliding window 64): 3 KV cache groups in vLLM."""
    return Path(build_tiny_gemma3(models_dir))


@pytest.fixture(scope="session")
def tiny_deepseek(models_dir: Path) -> Path:
    """A tiny DeepseekV2 (MLA: one latent KV of 576 per token, the same on every TP rank)."""
    return Path(build_tiny_deepseek_v2(models_dir))
