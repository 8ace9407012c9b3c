"""Run one fresh vLLM ``LLM`` in this process and report what it did, as JSON.

The vLLM tests start this script once per engine so every run is a new process: vLLM's own prefix
cache is empty, and any hit must have come from the daemon. Input and output are JSON files:

    python tests/vllm/vllm_runner.py spec.json result.json

spec: ``model``, ``prompts`` (lists of token ids), optional ``cache_salts``, ``max_tokens``,
``connector`` (bool), ``extra_config``, ``dtype`` (the model's: float32 by default),
``kv_cache_dtype``, ``block_size``, ``hash_algo``, ``prefix_caching`` (bool), ``check_shm``,
``report_keys``, ``report_groups`` (vLLM's KV cache groups), ``kv_events`` (``{"endpoint": ...}``:
vLLM's own ZeroMQ publisher), ``pause_s`` (a pause before each prompt after the first), ``kv_role``,
``transfer_params`` (per prompt, the ``kv_transfer_params`` a P/D proxy passes, or the ``ucm``
retention entry), and ``start_daemon`` (``{"before_prompt": i, "socket": ..., "data_dir": ...}``:
start a real daemon in the middle of the run, to test reconnection).
result: generated token ids per prompt, the ``kv_transfer_params`` each output returned, vLLM's metrics
after each prompt
(``vllm:external_prefix_cache_hits`` and the connector's ``vllm:ucm_*`` counters), each prompt's
block keys, and whether vLLM's KV cache lies in the daemon-shared memory.
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


def _drain(llm: Any, timeout_s: float = 60.0) -> bool:
    """Step the engine until no finished request waits for its dump; whether any step was taken.

    ``generate`` returns when the last output is done, but vLLM keeps a request whose blocks the
    connector is still saving until a later step reports the save finished, and only that step
    carries the save's stats. A serving engine takes that step with its next request; a test's
    process takes it here, so the last prompt's ``vllm:ucm_save_*`` figures count on every run.
    """
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    stepped = False
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        stepped = True
        time.sleep(0.005)
    return stepped


def _kv_in_shm(llm: Any) -> dict[str, Any]:
    """Whether every attention layer's bound KV tensor lies inside the registered shared buffer."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from ucm_client.vllm.connector import UCMConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, UCMConnector) and connector.worker is not None
    memory = connector.worker.memory
    assert memory is not None
    base, size = memory.base, memory.buffer.size
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = {}
    for name, layer in context.items():
        kv = getattr(layer, "kv_cache", None)
        if kv is not None and hasattr(kv, "data_ptr") and kv.numel():
            layers[name] = base <= kv.data_ptr() < base + size
    return {"layers": layers, "shm_name": memory.buffer.name, "block_bytes": memory.block_bytes}


def _block_keys(tokens: list[int], block_size: int) -> list[str]:
    """The keys vLLM gives an unsalted prompt's full blocks (sha256 block hashes), in hex."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    keys: list[str] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(sha256, parent, tokens[start : start + block_size], None)
        keys.append(bytes(parent).hex())
    return keys


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "enforce_eager": True,
        "dtype": spec.get("dtype", "float32"),
        "disable_log_stats": False,
        "max_model_len": spec.get("max_model_len", 4096),
        "seed": 0,
        "enable_prefix_caching": spec.get("prefix_caching", True),
    }
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("hash_algo"):
        kwargs["prefix_caching_hash_algo"] = spec["hash_algo"]
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm_client.vllm.connector",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_connector_extra_config": spec.get("extra_config", {}),
        }
    if spec.get("kv_events"):  # vLLM's own publisher (its GPU events plus the connector's take_events)
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events"]["endpoint"]
        )
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    salts = spec.get("cache_salts") or [None] * len(spec["prompts"])
    transfer = spec.get("transfer_params") or [None] * len(spec["prompts"])
    returned: list[Any] = []
    outputs: list[list[int]] = []
    seconds: list[float] = []
    metrics: list[dict[str, float]] = []
    daemon = None
    start = spec.get("start_daemon")
    for index, (tokens, salt) in enumerate(zip(spec["prompts"], salts, strict=True)):
        if start is not None and index == start["before_prompt"]:
            from ucm_server.testing.daemon import DaemonProcess

            workdir = Path(start["data_dir"]).parent
            daemon = DaemonProcess(workdir, socket=Path(start["socket"]), data_dir=Path(start["data_dir"]))
            daemon.start()
            time.sleep(start.get("settle_s", 0.0))
        if index and spec.get("pause_s"):
            time.sleep(spec["pause_s"])
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if salt:
            prompt["cache_salt"] = salt
        this = params
        if transfer[index] is not None:  # P/D: what a proxy passes (vLLM reads extra_args)
            this = params.clone()
            this.extra_args = {"kv_transfer_params": transfer[index]}
        started = time.perf_counter()
        result = llm.generate([prompt], this, use_tqdm=False)
        returned.append(result[0].kv_transfer_params)
        seconds.append(time.perf_counter() - started)
        outputs.append(list(result[0].outputs[0].token_ids))
        metrics.append(_metrics(llm))
    if spec.get("connector") and _drain(llm):
        metrics[-1] = _metrics(llm)  # the last prompt's dump, counted once it ended
    report: dict[str, Any] = {
        "outputs": outputs,
        "seconds": seconds,
        "metrics": metrics,
        "kv_transfer_params": returned,
    }
    if spec.get("report_keys"):
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        report["keys"] = [_block_keys(tokens, block_size) for tokens in spec["prompts"]]
    if spec.get("report_groups"):
        kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        report["kv_cache_groups"] = [
            [type(g.kv_cache_spec).__name__, list(g.layer_names)] for g in kv_cache_config.kv_cache_groups
        ]
    if spec.get("connector") and spec.get("check_shm"):
        report["shm"] = _kv_in_shm(llm)
    Path(result_path).write_text(json.dumps(report))
    if spec.get("kv_events"):
        time.sleep(1.0)  # vLLM's publisher thread sends the last batches
    if daemon is not None:
        daemon.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
