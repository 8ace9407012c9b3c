"""Run one fresh vLLM ``LLM`` in this process and report what it did, as JSON.

The vLLM tests start this script once per engine so every run is a new process: vLLM's own prefix
cache is empty, and any hit must have come from the daemon. Input and output are JSON files:

    python tests/vllm/vllm_runner.py spec.json result.json

spec: ``model``, ``prompts`` (lists of token ids), optional ``cache_salts``, ``max_tokens``,
``connector`` (bool), ``extra_config``, ``kv_cache_dtype``, ``check_shm``.
result: generated token ids per prompt, vLLM's metrics (``vllm:external_prefix_cache_hits`` and the
connector's ``vllm:ucm_*`` counters), and whether vLLM's KV cache lies in the daemon-shared memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

for _var, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_var, _value)


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, int | float) and (
            metric.name.startswith("vllm:ucm_") or "prefix_cache" in metric.name
        ):
            out[metric.name] = out.get(metric.name, 0) + value
    return out


def _kv_in_shm(llm: Any) -> dict[str, Any]:
    """Whether every attention layer's bound KV tensor lies inside the registered shared buffer."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    memory = worker.memory
    base, size = memory.base, memory.buffer.size
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = {}
    for name, layer in context.items():
        kv = getattr(layer, "kv_cache", None)
        if kv is not None and hasattr(kv, "data_ptr") and kv.numel():
            layers[name] = base <= kv.data_ptr() < base + size
    return {"layers": layers, "shm_name": memory.buffer.name, "block_bytes": memory.block_bytes}


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "enforce_eager": True,
        "dtype": "float32",
        "disable_log_stats": False,
        "max_model_len": spec.get("max_model_len", 4096),
        "seed": 0,
    }
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm_client.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec.get("extra_config", {}),
        }
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    salts = spec.get("cache_salts") or [None] * len(spec["prompts"])
    outputs: list[list[int]] = []
    seconds: list[float] = []
    for tokens, salt in zip(spec["prompts"], salts, strict=True):
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt:
            prompt["cache_salt"] = salt
        started = time.perf_counter()
        result = llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
        outputs.append(list(result[0].outputs[0].token_ids))
    report: dict[str, Any] = {"outputs": outputs, "seconds": seconds, "metrics": _metrics(llm)}
    if spec.get("connector") and spec.get("check_shm"):
        report["shm"] = _kv_in_shm(llm)
    Path(result_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
